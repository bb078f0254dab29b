"""On-policy distillation: a frozen teacher's per-token signal on the student's own samples.

The ``teacher`` section (:class:`TeacherConfig`); for ``kl = "sampled"`` the per-token
advantage term

    D_it = -weight * (log pi_old(o_it) - log pi_teacher(o_it))

(the negative reverse KL on the sampled token, no gradient), added to the row's advantage
A_i by the loss; for ``kl = "full"`` the full-vocabulary reverse KL at each position,
``weight * KL(pi_theta || pi_teacher)``, a penalty the loss differentiates
(:func:`full_reverse_kl`). Shapes: N rows, T completion tokens, C a chunk of them, V the
vocabulary. docs/objective.md, section 13.
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp

from grpo_jax.core.checks import check_choice
from grpo_jax.core.errors import ConfigError

REFERENCE = "reference"  # teacher.path: the run's reference policy
# "sampled": the reverse KL on the sampled tokens; "full": over the whole vocabulary.
TEACHER_KL = ("sampled", "full")


@dataclasses.dataclass(frozen=True)
class TeacherConfig:
    """The run config's ``teacher`` section.

    Attributes:
      path: "" (no teacher), "reference" (the run's reference policy) or a checkpoint
        the project loads as ``model.path`` accepts (a Hugging Face directory or a
        ``.gguf`` file); its tokenizer must be the student's.
      weight: the weight of the distillation term in the per-token advantage (>= 0;
        0 switches the teacher off: it is neither loaded nor scored).
      kl: "sampled" (per-token reverse KL on the sampled tokens, an advantage term) or
        "full" (the full-vocabulary reverse KL at each position, a differentiated penalty).
    """

    path: str = ""
    weight: float = 1.0
    kl: str = "sampled"

    def __post_init__(self):
        if not isinstance(self.path, str):
            raise ConfigError(f"config key 'teacher.path' = {self.path!r} must be a string")
        w = self.weight
        if isinstance(w, bool) or not isinstance(w, (int, float)) or not math.isfinite(w) or w < 0:
            raise ConfigError(f"config key 'teacher.weight' = {w!r} must be a finite number >= 0")
        check_choice("teacher.kl", self.kl, TEACHER_KL)

    @property
    def enabled(self) -> bool:
        return bool(self.path) and self.weight > 0

    @property
    def is_reference(self) -> bool:
        return self.path == REFERENCE


def distill_advantages(old_logps_NxT, teacher_logps_NxT, mask_NxT, weight: float):
    """D_it = -weight (log pi_old - log pi_teacher) on the loss mask's tokens, 0 elsewhere.

    A constant of the loss (no gradient): the sampled reverse KL as a per-token
    advantage, as on-policy distillation uses it.
    """
    diff_NxT = old_logps_NxT.astype(jnp.float32) - teacher_logps_NxT.astype(jnp.float32)
    term_NxT = jnp.where(mask_NxT > 0, -weight * diff_NxT, 0.0)
    return jax.lax.stop_gradient(term_NxT)


def distill_metrics(old_logps_NxT, teacher_logps_NxT, mask_NxT, advantages_N, term_NxT):
    """``teacher/kl``: the mean over the loss mask's tokens of log pi_old - log pi_teacher
    (the sampled estimate of the per-token reverse KL); ``teacher/adv_share``: the
    distillation term's share of the advantage magnitude,
    sum |D_it| / sum (|A_i| + |D_it|) over those tokens (0 when both are 0)."""
    mask_NxT = mask_NxT.astype(jnp.float32)
    diff_NxT = old_logps_NxT.astype(jnp.float32) - teacher_logps_NxT.astype(jnp.float32)
    tokens = mask_NxT.sum()
    kl = jnp.where(tokens > 0, (diff_NxT * mask_NxT).sum() / jnp.maximum(tokens, 1.0), jnp.nan)
    term = (jnp.abs(term_NxT) * mask_NxT).sum()
    row = (jnp.abs(advantages_N.astype(jnp.float32))[:, None] * mask_NxT).sum()
    share = jnp.where(term + row > 0, term / jnp.maximum(term + row, 1e-30), 0.0)
    return {"teacher/kl": jax.lax.stop_gradient(kl), "teacher/adv_share": share}


def full_reverse_kl(student_logits_NxCxV, teacher_logits_NxCxW, temperature: float):
    """KL(pi_theta || pi_teacher) [N, C] at each position, over the student's V tokens:

        sum_v p_v (log p_v - log q_v),   p = softmax(z_s / tau),  q = softmax(z_t / tau)

    in float32, differentiable in the student's logits (the teacher's carry no gradient).
    The teacher's vocabulary W >= V is normalised over all of it, then read at the
    student's V ids (a padded vocabulary's extra rows are mass the student cannot put).
    """
    v = student_logits_NxCxV.shape[-1]
    log_p = jax.nn.log_softmax(student_logits_NxCxV.astype(jnp.float32) / temperature, axis=-1)
    teacher = jax.lax.stop_gradient(teacher_logits_NxCxW.astype(jnp.float32) / temperature)
    log_q = jax.nn.log_softmax(teacher, axis=-1)[..., :v]
    return (jnp.exp(log_p) * (log_p - log_q)).sum(-1)
