"""On-policy distillation's term: its value and gradient by hand, zero against itself, and
the ``teacher`` section's checks."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from helpers_config import smoke_config

from grpo_jax.core.errors import ConfigError
from grpo_jax.objective import losses
from grpo_jax.objective.config import GRPOConfig
from grpo_jax.objective.distill import (
    TeacherConfig,
    distill_advantages,
    distill_metrics,
    full_reverse_kl,
)
from grpo_jax.run.config import parse_config

# Two rows: three tokens and two (the third slot is padding). The student's sampled
# tokens had probabilities p, the teacher's q.
P = np.array([[0.5, 0.25, 0.5], [0.8, 0.1, 0.3]])
Q = np.array([[0.25, 0.25, 1.0], [0.4, 0.2, 0.9]])
MASK = np.array([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
A = np.array([1.0, -1.0])
W = 0.5


def _arrays():
    f = lambda x: jnp.asarray(x, jnp.float32)
    return f(np.log(P)), f(np.log(Q)), f(MASK), f(A)


def test_the_term_is_minus_weight_times_the_sampled_reverse_kl():
    old, teacher, mask, _ = _arrays()
    d = np.asarray(distill_advantages(old, teacher, mask, W))
    by_hand = [
        [-W * math.log(2.0), 0.0, -W * math.log(0.5)],
        [-W * math.log(2.0), -W * math.log(0.5), 0.0],  # padding: 0 whatever was scored
    ]
    np.testing.assert_allclose(d, by_hand, rtol=1e-6)


def test_loss_value_and_gradient_with_the_term_match_the_hand_computation():
    """At rho = 1 (the first update) nothing clips, so with the "grpo" reduction

        L = -(1/N) sum_i (1/|o_i|) sum_t (A_i + D_it),   dL/dl_it = -(A_i + D_it) / (N |o_i|)

    with D_it = -w (log p_it - log q_it)."""
    old, teacher, mask, adv = _arrays()
    d = distill_advantages(old, teacher, mask, W)
    ln2 = math.log(2.0)
    a0 = [1 - W * ln2, 1.0, 1 + W * ln2]  # row 0: A = +1, D = -w ln2, 0, +w ln2
    a1 = [-1 - W * ln2, -1 + W * ln2]  # row 1: A = -1, D = -w ln2, +w ln2
    want_loss = -(sum(a0) / 3 + sum(a1) / 2) / 2
    want_grad = np.array([[-x / (2 * 3) for x in a0], [-a1[0] / 4, -a1[1] / 4, 0.0]])

    def loss_of(l):
        return losses.grpo_loss(l, old, adv, mask, GRPOConfig(G=2), distill_adv_NxT=d)[0]

    loss, grad = jax.value_and_grad(loss_of)(old)
    np.testing.assert_allclose(float(loss), want_loss, rtol=1e-6)
    np.testing.assert_allclose(np.asarray(grad), want_grad, rtol=1e-5, atol=1e-7)


def test_the_term_carries_no_gradient_of_its_own():
    old, teacher, mask, adv = _arrays()

    def loss_of(t):
        d = distill_advantages(old, t, mask, W)
        return losses.grpo_loss(old, old, adv, mask, GRPOConfig(G=2), distill_adv_NxT=d)[0]

    assert not np.asarray(jax.grad(loss_of)(teacher)).any()


def test_a_teacher_that_is_the_student_adds_nothing():
    old, _, mask, adv = _arrays()
    d = distill_advantages(old, old, mask, W)
    assert not np.asarray(d).any()
    cfg = GRPOConfig(G=2)
    with_t = jax.value_and_grad(
        lambda l: losses.grpo_loss(l, old, adv, mask, cfg, distill_adv_NxT=d)[0]
    )(old)
    without = jax.value_and_grad(lambda l: losses.grpo_loss(l, old, adv, mask, cfg)[0])(old)
    np.testing.assert_array_equal(with_t[0], without[0])
    np.testing.assert_array_equal(with_t[1], without[1])
    m = distill_metrics(old, old, mask, adv, d)
    assert float(m["teacher/kl"]) == 0.0 and float(m["teacher/adv_share"]) == 0.0


def test_metrics_are_the_mean_kl_and_the_share_of_the_advantage_magnitude():
    old, teacher, mask, adv = _arrays()
    d = distill_advantages(old, teacher, mask, W)
    m = jax.device_get(distill_metrics(old, teacher, mask, adv, d))
    ln2 = math.log(2.0)
    np.testing.assert_allclose(m["teacher/kl"], (ln2 + 0 - ln2 + ln2 - ln2) / 5, atol=1e-7)
    term = 4 * W * ln2  # |D| over the five tokens: w ln2 on all but one
    np.testing.assert_allclose(m["teacher/adv_share"], term / (term + 5.0), rtol=1e-6)


def test_sequence_objectives_refuse_the_per_token_term():
    old, teacher, mask, adv = _arrays()
    d = distill_advantages(old, teacher, mask, W)
    with pytest.raises(ValueError, match="per-token objective"):
        losses.grpo_loss(old, old, adv, mask, GRPOConfig(G=2, reduction="gspo"), distill_adv_NxT=d)


@pytest.mark.parametrize(
    "overrides, says",
    [
        ({"teacher.path": 3}, "config key 'teacher.path' = 3 must be a string"),
        ({"teacher.path": "reference", "teacher.weight": -1.0}, "'teacher.weight' = -1.0"),
        ({"teacher.path": "reference", "teacher.weight": float("nan")}, "'teacher.weight'"),
        ({"teacher.path": "reference", "teacher.kl": "forward"}, "teacher.kl"),
        (
            {"teacher.path": "reference", "teacher.kl": "full", "train.packing": "on"},
            "'teacher.kl' = 'full' does not combine with train.packing",
        ),
        ({"teacher.path": "reference", "grpo.reduction": "gspo"}, "per-token objective"),
        ({"teacher.pth": "reference"}, "teacher.pth"),
    ],
)
def test_bad_teacher_values_are_one_clear_line(overrides, says):
    with pytest.raises(ConfigError) as e:
        parse_config(smoke_config(plain=True, **{"teacher.path": "", **overrides}))
    assert says in str(e.value) and "\n" not in str(e.value)


def test_the_section_parses_and_is_off_by_default():
    assert not parse_config(smoke_config()).teacher.enabled
    run = parse_config(smoke_config(**{"teacher.path": "reference", "teacher.weight": 0.5}))
    assert run.teacher == TeacherConfig(path="reference", weight=0.5, kl="sampled")
    assert run.teacher.is_reference
    assert not TeacherConfig(path="reference", weight=0.0).enabled  # weight 0: off


def test_full_kl_and_its_gradient_match_the_hand_computation():
    """KL(p || q) = sum_v p_v (log p_v - log q_v), and d KL / d z_v = p_v (log p_v - log q_v
    - KL) for p = softmax(z) (tau = 1); the teacher's logits get no gradient. The teacher's
    fourth row (a padded vocabulary) is normalised over but not summed."""
    zs = jnp.asarray([[[1.0, 0.0, -1.0]]])
    zt = jnp.asarray([[[0.0, 0.5, 0.0, 2.0]]])
    p = np.exp([1.0, 0.0, -1.0]) / np.exp([1.0, 0.0, -1.0]).sum()
    q = np.exp([0.0, 0.5, 0.0]) / np.exp([0.0, 0.5, 0.0, 2.0]).sum()
    kl = (p * (np.log(p) - np.log(q))).sum()
    np.testing.assert_allclose(float(full_reverse_kl(zs, zt, 1.0)[0, 0]), kl, rtol=1e-6)
    g_s, g_t = jax.grad(lambda a, b: full_reverse_kl(a, b, 1.0).sum(), argnums=(0, 1))(zs, zt)
    np.testing.assert_allclose(np.asarray(g_s)[0, 0], p * (np.log(p) - np.log(q) - kl), atol=1e-6)
    assert not np.asarray(g_t).any()
    # The temperature divides both models' logits.
    np.testing.assert_allclose(full_reverse_kl(zs, zt, 2.0), full_reverse_kl(zs / 2, zt / 2, 1.0))


def test_full_kl_of_a_model_against_itself_is_zero_with_zero_gradient():
    z = jnp.asarray(np.random.default_rng(0).normal(size=(2, 3, 7)), jnp.float32)
    assert float(jnp.abs(full_reverse_kl(z, z, 0.7)).max()) < 1e-6
    g = jax.grad(lambda a: full_reverse_kl(a, z, 0.7).sum())(z)
    assert float(jnp.abs(g).max()) < 1e-6


def test_a_penalty_enters_the_loss_beside_the_policy_term():
    """L = -(1/N) sum_i (1/|o_i|) sum_t (A_i - pen_it) at rho = 1 ("grpo" reduction)."""
    old, teacher, mask, adv = _arrays()
    pen = jnp.asarray(np.arange(6).reshape(2, 3) / 10.0, jnp.float32)
    loss = losses.grpo_loss(old, old, adv, mask, GRPOConfig(G=2), penalty_NxT=pen)[0]
    row0 = (1.0 - 0.0) + (1.0 - 0.1) + (1.0 - 0.2)  # A = +1, three tokens
    row1 = (-1.0 - 0.3) + (-1.0 - 0.4)  # A = -1, two tokens (the padding's 0.5 is left out)
    want = -(row0 / 3 + row1 / 2) / 2
    np.testing.assert_allclose(float(loss), want, rtol=1e-6)
