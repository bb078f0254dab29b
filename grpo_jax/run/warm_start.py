"""Supervised warm start (cold-start SFT): next-token loss on worked solutions.

Each example contributes [prompt | solution <eos>] in the GRPO batch's layout, scored by the
same log-prob code, and only the solution and EOS tokens carry loss (:func:`sft_loss`); its
optimizer steps are the GRPO update's, guarded. It stops when pass@1 on held-back training
problems reaches ``warm_start.target_pass_at_1``, not after a step count, and its result is
cached in ``<workdir>/warm_start`` under a fingerprint of what it depends on.
docs/recipes.md, "The supervised warm start", says why.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import pathlib
import time
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax.core import distributed, integrity, sharding
from grpo_jax.core.errors import CheckpointError, IntegrityError
from grpo_jax.data import DataIterator
from grpo_jax.learner import optimizer
from grpo_jax.objective.logprobs import completion_logits
from grpo_jax.objective.losses import per_token_logps
from grpo_jax.run.config import ConfigError, WarmStartConfig

log = logging.getLogger(__name__)


# ---------------------------------------------------------------------------
# Batches and the loss.


def sft_batch(
    examples: Sequence[Mapping], encoder, max_new_tokens: int, target: str = "solution"
) -> dict[str, np.ndarray]:
    """[prompt | target <eos>] in the GRPO layout (``target``: "solution" or "answer").

    Returns prompt_tokens / prompt_mask [B, P] (left-padded) and tokens / mask
    [B, T] (right-padded, T = ``max_new_tokens``).
    """
    missing = [i for i, ex in enumerate(examples) if ex.get(target) in (None, "")]
    if missing:
        raise ConfigError(
            f"warm_start.target = {target!r} needs a {target!r} field in every training "
            f"example; example {missing[0]} ({examples[missing[0]].get('prompt')!r}) has none"
        )
    _, prompt_BxP, prompt_mask_BxP = encoder.encode(examples, max_new_tokens=max_new_tokens)
    tok = encoder.tokenizer
    eos = int(tok.eos_token_id)
    sols = tok([str(ex[target]) for ex in examples], add_special_tokens=False)["input_ids"]
    b, t = len(examples), max_new_tokens
    tokens_BxT = np.full((b, t), encoder.pad_id, np.int32)
    mask_BxT = np.zeros((b, t), np.bool_)
    for i, ids in enumerate(sols):
        ids = list(ids) + [eos]
        if len(ids) > t:
            raise ConfigError(
                f"the {target} of example {i} ({str(examples[i][target])[:40]!r}...) has "
                f"{len(ids)} tokens with EOS, more than sampling.max_new_tokens = {t}"
            )
        tokens_BxT[i, : len(ids)] = ids
        mask_BxT[i, : len(ids)] = True
    return {
        "prompt_tokens": prompt_BxP,
        "prompt_mask": prompt_mask_BxP,
        "tokens": tokens_BxT,
        "mask": mask_BxT,
    }


def sft_loss(params, batch, *, graphdef):
    """Token-mean negative log-likelihood of the completion tokens:

        L = -(1 / sum_i |s_i|) sum_i sum_t log pi(s_it | prompt_i, s_i,<t)

    over the batch's targets s_i (solution and EOS tokens), at temperature 1.
    """
    logits_BxTxV = completion_logits(
        graphdef,
        params,
        batch["prompt_tokens"],
        batch["prompt_mask"],
        batch["tokens"],
        batch["mask"],
    )
    logps_BxT = per_token_logps(logits_BxTxV, batch["tokens"])
    mask_BxT = batch["mask"].astype(jnp.float32)
    n = jnp.maximum(mask_BxT.sum(), 1.0)
    loss = -(logps_BxT * mask_BxT).sum() / n
    # Teacher-forced token accuracy: a cheap progress signal between validations.
    hit_BxT = (jnp.argmax(logits_BxTxV, -1) == batch["tokens"]).astype(jnp.float32)
    return loss, {"token_accuracy": (hit_BxT * mask_BxT).sum() / n}


def sft_step(state, batch, *, graphdef, tx, schedule):
    """One guarded optimizer step on the SFT loss (``optimizer.apply_guarded``)."""
    (loss, aux), grads = jax.value_and_grad(
        functools.partial(sft_loss, graphdef=graphdef), has_aux=True
    )(state.params, batch)
    state, grad_norm, _ = optimizer.apply_guarded(state, grads, loss, tx)
    state = state.replace(step=state.step + 1)
    metrics = {
        "sft/loss": loss,
        "sft/grad_norm": grad_norm,
        "sft/lr": schedule(state.updates),
        **{f"sft/{k}": v for k, v in aux.items()},
    }
    return state, metrics


def jit_sft_step(graphdef, tx, schedule, state_shardings, mesh):
    """:func:`sft_step` jitted with the state's shardings and rows over the batch axes,
    traced and called under the mesh (``sharding.OnMesh``: rows stay split through the
    model, not its width)."""
    rows = {
        k: sharding.batch_sharding(mesh, 2)
        for k in ("prompt_tokens", "prompt_mask", "tokens", "mask")
    }
    jitted = jax.jit(
        functools.partial(sft_step, graphdef=graphdef, tx=tx, schedule=schedule),
        in_shardings=(state_shardings, rows),
        out_shardings=(state_shardings, sharding.replicated(mesh)),
        donate_argnames=("state",),
    )
    return sharding.OnMesh(jitted, mesh)


# ---------------------------------------------------------------------------
# The phase, with its cache.


def fingerprint(parts: Mapping) -> str:
    """A stable hash of everything the warm-started parameters depend on."""
    text = json.dumps(parts, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def _cache_paths(workdir) -> tuple[pathlib.Path, pathlib.Path]:
    d = pathlib.Path(workdir).absolute() / "warm_start"
    return d / "params", d / "info.json"


def load_cached(
    workdir, params_like, fp: str | tuple[str, ...], *, say: Callable[[str], None] | None = None
):
    """(params, info) from the cache when its fingerprint is ``fp`` (or one of them), else None.

    The parameters and info.json are verified against the checksums saved with them:
    a cache that differs or does not read raises CheckpointError (``IntegrityError``
    for a checksum), which the warm start answers by :func:`set_cache_aside` and
    training again. A cache saved without checksums loads, ``say`` telling so.
    """
    params_dir, info_path = _cache_paths(workdir)
    if not info_path.exists() or not params_dir.exists():
        return None
    info, record = _read_info(info_path)
    fps = (fp,) if isinstance(fp, str) else tuple(fp)
    if info.get("fingerprint") not in fps:
        log.warning(
            "warm start cache in %s was made with a different config (fingerprint %s, now %s); "
            "training the warm start again",
            info_path.parent,
            info.get("fingerprint"),
            fps[0],
        )
        return None
    params = _restore_params(params_dir, params_like, record)
    if record is None:
        (say or log.warning)(
            f"the warm start cache in {info_path.parent} was saved without checksums (by an "
            "earlier version of grpo_jax): loaded unverified"
        )
    return params, info


def _read_info(info_path: pathlib.Path) -> tuple[dict, dict | None]:
    """(info.json without its checksums, the checksums or None), verified."""
    where = f"the warm start cache in {info_path.parent}"
    try:
        info = json.loads(info_path.read_text())
    except (ValueError, UnicodeDecodeError) as e:
        raise IntegrityError(where, f"info.json is not JSON ({e})") from None
    if not isinstance(info, dict):
        raise IntegrityError(where, "info.json does not hold an object")
    record = info.pop("integrity", None)
    if record is not None and (
        not isinstance(record, dict) or record.get("info") != integrity.json_digest(info)
    ):
        raise IntegrityError(
            where, "info.json differs from the checksum saved with it (damaged on disk)"
        )
    return info, record


def _restore_params(params_dir: pathlib.Path, params_like, record: dict | None):
    """The cached parameters into ``params_like``'s layout, verified against ``record``."""
    import orbax.checkpoint as ocp

    where = f"the warm start cache in {params_dir.parent}"
    try:
        with integrity.reading(), ocp.StandardCheckpointer() as ck:
            params = ck.restore(params_dir, sharding.abstract_like(params_like))
    except Exception as e:  # Orbax / TensorStore raise many types for a damaged directory
        raise CheckpointError(f"{where} could not be restored ({integrity.describe(e)})") from e
    if record is not None:
        integrity.check_tree(params, record.get("params") or {}, where, "params")
    return params


def restore_cache(workdir, params_like):
    """The parameters cached in ``<workdir>/warm_start``, whatever config made them (the
    caller checks the fingerprint when it matters), verified; FileNotFoundError when
    there are none, CheckpointError when they are damaged."""
    params_dir, info_path = _cache_paths(workdir)
    if not info_path.exists() or not params_dir.exists():
        raise FileNotFoundError(f"{info_path.parent} holds no complete warm start")
    _, record = _read_info(info_path)
    return _restore_params(params_dir, params_like, record)


def set_cache_aside(workdir) -> pathlib.Path:
    """Moves a damaged ``<workdir>/warm_start`` to ``warm_start.unrestorable`` (``.1``,
    ``.2``, ... when taken): kept, and the warm start trains again into a fresh one."""
    import shutil

    from jax.experimental import multihost_utils

    d = _cache_paths(workdir)[0].parent
    aside, k = d.with_name(f"{d.name}.unrestorable"), 0
    while aside.exists():
        k += 1
        aside = d.with_name(f"{d.name}.unrestorable.{k}")
    multihost_utils.sync_global_devices("grpo_jax warm start cache read")
    if jax.process_index() == 0:
        shutil.move(str(d), aside)
    multihost_utils.sync_global_devices("grpo_jax warm start cache set aside")
    return aside


def save_cache(workdir, params, info: Mapping) -> None:
    """Saves the warm-started ``params`` and ``info`` (info.json, written last: it marks a
    complete cache), with the checksums of both."""
    import shutil

    import orbax.checkpoint as ocp
    from jax.experimental import multihost_utils

    params_dir, info_path = _cache_paths(workdir)
    info = dict(info)
    record = {  # every process computes the digests: they are collectives
        "version": integrity.VERSION,
        "params": integrity.tree_digests(params),
        "info": integrity.json_digest(info),
    }
    # Every process takes part in orbax's (multi-host) save; process 0 alone edits files.
    primary = jax.process_index() == 0
    if primary:
        if info_path.exists():
            info_path.unlink()  # The info file marks a complete cache: it goes last.
        if params_dir.exists():
            shutil.rmtree(params_dir)
        params_dir.parent.mkdir(parents=True, exist_ok=True)
    multihost_utils.sync_global_devices("grpo_jax warm start cache cleared")
    with ocp.StandardCheckpointer() as ck:
        ck.save(params_dir, params)
        ck.wait_until_finished()
    if primary:
        text = json.dumps(dict(info, integrity=record), indent=2, sort_keys=True) + "\n"
        info_path.write_text(text)


def warm_start(
    graphdef,
    params,
    train_examples: Sequence[Mapping],
    val_examples: Sequence[Mapping],
    *,
    cfg: WarmStartConfig,
    encoder,
    max_new_tokens: int,
    validate: Callable[[object], Mapping[str, float]],
    seed: int,
    mesh,
    param_shardings,
    log_fn: Callable[[int, dict], None] | None = None,
    should_stop: Callable[[], bool] = lambda: False,
):
    """Trains ``params`` on the solutions until ``validate(params)`` >= the target.

    Args:
      graphdef, params: the policy (params are not donated: the caller's copy
        stays valid).
      train_examples: examples with "solution"; ``val_examples`` are held out.
      validate: params -> {"greedy": pass@1, "sampled": pass@1 of samples (when
        ``cfg.metric`` is "sampled")} on ``val_examples``; ``cfg.metric``
        picks the one compared with the target.
      log_fn: called with (step, metrics) at every validation.
      should_stop: polled every step (SIGTERM): the phase ends early, uncached.

    Returns:
      (params, info) with info: steps, val_pass_at_1, reached_target, seconds,
      history [(step, val_pass_at_1)], interrupted.
    """
    del val_examples  # validate() closes over them.
    t0 = time.perf_counter()
    tx, schedule = optimizer.make_optimizer(cfg.optim(), cfg.max_steps)
    state = optimizer.init_state(jax.tree.map(jnp.copy, params), tx, mesh)
    state_sh = jax.tree.map(lambda x: x.sharding, state)
    rows = {
        k: sharding.batch_sharding(mesh, 2)
        for k in ("prompt_tokens", "prompt_mask", "tokens", "mask")
    }
    step_fn = jit_sft_step(graphdef, tx, schedule, state_sh, mesh)
    it = DataIterator(train_examples, cfg.batch_size, seed=seed + 7919)
    history: list[tuple[int, float]] = []
    val = float("nan")
    reached, interrupted = False, False
    step = 0
    metrics = {}
    while step < cfg.max_steps:
        batch = distributed.put(sft_batch(it.next(), encoder, max_new_tokens, cfg.target), rows)
        state, metrics = step_fn(state, batch)
        step += 1
        if should_stop():
            interrupted = True
            break
        if step % cfg.eval_every == 0 or step == cfg.max_steps:
            val, m = _validation(validate, state.params, metrics, cfg.metric, t0)
            history.append((step, val))
            if log_fn is not None:
                log_fn(step, m)
            if val >= cfg.target_pass_at_1 and step >= cfg.min_steps:
                reached = True
                break
    info = {
        "steps": step,
        "val_pass_at_1": val,
        "reached_target": reached,
        "target_pass_at_1": cfg.target_pass_at_1,
        "seconds": time.perf_counter() - t0,
        "history": history,
        "interrupted": interrupted,
        "skipped_updates": int(jax.device_get(state.skipped)),
    }
    if not reached and not interrupted:
        log.warning(
            "warm start hit max_steps=%d at validation pass@1 %.3f, below the target %.3f: "
            "GRPO may find too few groups with a correct sample to learn from",
            cfg.max_steps,
            val,
            cfg.target_pass_at_1,
        )
    out = jax.device_put(state.params, param_shardings)
    return out, info


def _validation(validate, params, metrics, metric: str, t0: float):
    """(the validation pass@1 the warm start stops on, the metrics line of this step)."""
    vals = {k: float(v) for k, v in validate(params).items()}
    m = {k: float(v) for k, v in jax.device_get(metrics).items()}
    m["sft/val_pass_at_1"] = vals[metric]
    m.update({f"sft/val_{k}_pass_at_1": v for k, v in vals.items()})
    m["sft/seconds"] = time.perf_counter() - t0
    return vals[metric], m
