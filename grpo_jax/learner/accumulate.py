"""A minibatch's loss, metrics and gradient, accumulated over its micro-batches.

Padded: ``optim.grad_accum`` equal parts of rows (:func:`accumulate`). Packed: the
packing plan's micro-batches (:func:`packed_accumulate`), with two passes for the policy
terms that rank the whole minibatch's tokens. Either way the step's loss is the same
function of the batch (docs/packing.md).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from grpo_jax.learner.rows import combine, loss_mask, split_rows
from grpo_jax.learner.step import StepPlan, packed_minibatch_logps, with_dropout
from grpo_jax.objective import losses
from grpo_jax.objective.logprobs import packed_logps_and_entropy


def accumulate(plan: StepPlan, grad_fn, trained, frozen, mb, k_update):
    """A minibatch's loss, metrics and gradient, accumulated over A = ``plan.grad_accum`` parts.

        grad = sum_a w_a grad L_a,   w_a = tokens_a / sum_a' tokens_a'  ("token_mean")
                                     w_a = 1 / A                         (otherwise)

    Each micro-batch's share of the minibatch: its rows (1 / A) for the
    per-sequence reductions, its tokens for "token_mean", whose loss is a mean
    over all the minibatch's tokens. The loss is sum_a w_a L_a; token means in
    the metrics (KL, entropy, clip fractions) are weighted by tokens either way
    (:func:`combine`). Micro-batch a's dropout key is ``k_update`` folded with a.
    """
    grad_accum = plan.grad_accum
    if grad_accum == 1:
        (loss, aux), grads = grad_fn(trained, frozen, mb, k_update)
        return loss, aux, grads
    micro = jax.tree.map(lambda x: split_rows(x, grad_accum, plan.batch_shards), mb)
    tokens_A = loss_mask(micro[0]).astype(jnp.float32).sum(axis=(1, 2))
    if plan.objective.reduction == "token_mean":
        w_A = tokens_A / jnp.maximum(tokens_A.sum(), 1.0)
    else:
        w_A = jnp.full((grad_accum,), 1.0 / grad_accum)

    def acc(carry, xs):
        mbi, w, a = xs
        k = jax.random.fold_in(k_update, a)
        (l_i, aux_i), g_i = grad_fn(trained, frozen, mbi, k)
        return jax.tree.map(lambda c, g: c + w * g, carry, g_i), (l_i, aux_i)

    zeros = jax.tree.map(jnp.zeros_like, trained)
    index_A = jnp.arange(grad_accum, dtype=jnp.int32)
    grads, (loss_A, aux_A) = jax.lax.scan(acc, zeros, (micro, w_A, index_A))
    return (loss_A * w_A).sum(), combine(aux_A, tokens_A), grads


# Policy terms whose per-token values depend on every token of the minibatch together
# (their picks rank its tokens): packed, a minibatch of several micro-batches takes its
# gradient in two passes (:func:`_packed_two_pass`).
_WHOLE_MINIBATCH_TERMS = ("clip_cov", "kl_cov")


def packed_accumulate(plan: StepPlan, grad_fn, trained, frozen, mb, packs_K, k_update):
    """A minibatch's loss, metrics and gradient from its packed micro-batches.

        L = sum_k L_k,   grad = sum_k grad L_k

    where L_k (:func:`grpo_jax.learner.terms.packed_loss`) is the minibatch's loss
    restricted to micro-batch k's tokens and divided by the minibatch's counts, so that L
    is the loss of the whole minibatch for every reduction. An empty micro-batch (the plan
    rounds their count up) is skipped. The policy terms that rank the whole minibatch's
    tokens take :func:`_packed_two_pass` instead.
    """
    b = mb[0]
    k = packs_K.count.shape[0]
    if plan.objective.policy_loss in _WHOLE_MINIBATCH_TERMS and k > 1:
        return _packed_two_pass(plan, trained, frozen, mb, packs_K, k_update)
    mask_NxT = loss_mask(b).astype(jnp.float32)
    whole = losses.Whole(mask_NxT.sum(), (mask_NxT.sum(axis=1) > 0).sum().astype(jnp.float32))

    def acc(carry, xs):
        pack, a = xs
        key = jax.random.fold_in(k_update, a)
        run = lambda _: grad_fn(trained, frozen, (*mb, pack, whole), key)
        empty = jax.tree.map(lambda x: jnp.zeros(x.shape, x.dtype), jax.eval_shape(run, None))
        (l_k, aux_k), g_k = jax.lax.cond(pack.count > 0, run, lambda _: empty, None)
        return jax.tree.map(jnp.add, carry, g_k), (l_k, aux_k)

    zeros = jax.tree.map(jnp.zeros_like, trained)
    index_K = jnp.arange(k, dtype=jnp.int32)
    grads, (loss_K, aux_K) = jax.lax.scan(acc, zeros, (packs_K, index_K))
    return loss_K.sum(), combine(aux_K, packs_K.count.astype(jnp.float32)), grads


def _packed_two_pass(plan: StepPlan, trained, frozen, mb, packs_K, k_update):
    """:func:`packed_accumulate` for a loss that is no sum over micro-batches.

    A forward pass over the micro-batches scores the minibatch's tokens l; the loss of
    the whole minibatch, the padded update's, gives g = dL/dl; a second pass takes
    each micro-batch's vector-Jacobian product with g, whose sum is dL/dtheta. One
    forward pass more than :func:`packed_accumulate`.
    """
    b, ref_NxT, w_NxT, d_NxT = mb
    params = plan.join(frozen, trained)
    logps_NxT, entropy_NxT = packed_minibatch_logps(plan, params, b, packs_K, key=k_update)

    def loss_of(l_NxT):
        return losses.grpo_loss(
            l_NxT,
            b.old_logps_NxT,
            b.advantages_N,
            loss_mask(b),
            plan.objective,
            ref_logps_NxT=ref_NxT,
            entropy_NxT=entropy_NxT,
            behavior_weights_NxT=w_NxT,
            distill_adv_NxT=d_NxT,
        )

    (loss, aux), g_NxT = jax.value_and_grad(loss_of, has_aux=True)(jax.lax.stop_gradient(logps_NxT))

    def back(carry, xs):
        pack, a = xs

        def vjp(_):
            def f(tr):
                return with_dropout(
                    plan,
                    jax.random.fold_in(k_update, a),
                    lambda: packed_logps_and_entropy(
                        plan.graphdef,
                        plan.join(frozen, tr),
                        b.prompt_tokens_NxP,
                        b.tokens_NxT,
                        pack,
                        plan.objective.temperature,
                        chunk_size=plan.logits_chunk,
                    )[0],
                )

            return jax.vjp(f, trained)[1](g_NxT)[0]

        g_k = jax.lax.cond(
            pack.count > 0, vjp, lambda _: jax.tree.map(jnp.zeros_like, trained), None
        )
        return jax.tree.map(jnp.add, carry, g_k), None

    index_K = jnp.arange(packs_K.count.shape[0], dtype=jnp.int32)
    zeros = jax.tree.map(jnp.zeros_like, trained)
    grads, _ = jax.lax.scan(back, zeros, (packs_K, index_K))
    return loss, aux, grads
