"""Host-side glue between examples, tokens and rewards, shared by training and evaluation.

:class:`PromptEncoder` turns examples into left-padded prompt tokens, :func:`decode`
completion tokens into texts; :func:`dispatch_round`, :func:`finish_round` and
:func:`batch_from_round` are one round of rollouts (sample, decode, score, normalise ->
``RolloutBatch``), and :func:`collect_dynamic` is DAPO's dynamic sampling. Shapes: B prompts,
G completions per prompt, N = B*G rows, P padded prompt length, T completion slots; lower-case
b, n: this host's rows, the only ones it encodes, decodes and scores (docs/architecture.md).
"""

from __future__ import annotations

import dataclasses
import functools
import time
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import data
from grpo_jax.core import distributed
from grpo_jax.core import sharding as sharding_lib
from grpo_jax.core.batch import HostRollout, RolloutBatch
from grpo_jax.objective import advantages as adv_lib
from grpo_jax.reward_models import learned_metrics
from grpo_jax.rollout.scorer import Scorer
from grpo_jax.rollout.stats import duplicate_flags, rollout_metrics
from grpo_jax.sampling.engines import get_engine
from grpo_jax.sampling.static import pad_prompts
from grpo_jax.sampling.weights import SamplerWeights


@dataclasses.dataclass(frozen=True)
class PromptEncoder:
    """Formats examples as prompts (``grpo_jax.data.format_prompt``) and tokenizes them.

    Prompts are encoded with ``add_special_tokens=True`` (the tokenizer's BOS,
    when it adds one) and left-padded to the smallest of ``buckets``.
    """

    tokenizer: object
    template: str | None
    chat: bool
    system: str | None
    buckets: tuple[int, ...]

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(pad if pad is not None else self.tokenizer.eos_token_id)

    def texts(self, examples: Sequence[Mapping]) -> list[str]:
        return [
            data.format_prompt(
                ex,
                template=self.template,
                tokenizer=self.tokenizer,
                chat=self.chat,
                system=self.system,
            )
            for ex in examples
        ]

    def token_lists(self, texts: Sequence[str]) -> list[list[int]]:
        # A chat template already holds the special tokens it wants.
        return [
            list(ids)
            for ids in self.tokenizer(list(texts), add_special_tokens=not self.chat)["input_ids"]
        ]

    def encode(self, examples: Sequence[Mapping], *, max_new_tokens: int = 0):
        """-> (prompt texts, tokens_BxP int32, mask_BxP bool)."""
        texts = self.texts(examples)
        tokens_BxP, mask_BxP = pad_prompts(
            self.token_lists(texts),
            pad_id=self.pad_id,
            buckets=self.buckets,
            max_new_tokens=max_new_tokens,
        )
        return texts, tokens_BxP, mask_BxP


def decode(tokenizer, tokens_NxT: np.ndarray, lengths_N: np.ndarray) -> list[str]:
    """Completion texts: each row's first ``length`` tokens, special tokens (EOS) dropped."""
    rows = [list(map(int, t[: int(n)])) for t, n in zip(tokens_NxT, lengths_N, strict=True)]
    return tokenizer.batch_decode(rows, skip_special_tokens=True)


def host_prompts(encoder: PromptEncoder, examples, *, mesh, num_rows: int, max_new_tokens: int):
    """Encodes this host's examples; -> (texts, global tokens_BxP, global mask_BxP, real tokens).

    The last is the number of real (unpadded) tokens in this host's prompts.

    Every host pads to the widest bucket any host needs (one compiled shape),
    then contributes its rows to the global arrays split over the batch axes.
    """
    texts, tokens_bxP, mask_bxP = encoder.encode(examples, max_new_tokens=max_new_tokens)
    width = distributed.max_over_hosts(tokens_bxP.shape[1])
    if width > tokens_bxP.shape[1]:  # Left padding keeps every prompt's end in column P-1.
        extra = width - tokens_bxP.shape[1]
        tokens_bxP = np.pad(tokens_bxP, ((0, 0), (extra, 0)), constant_values=encoder.pad_id)
        mask_bxP = np.pad(mask_bxP, ((0, 0), (extra, 0)))
    tokens_BxP, mask_BxP = distributed.global_batch((tokens_bxP, mask_bxP), mesh, num_rows)
    return texts, tokens_BxP, mask_BxP, int(mask_bxP.sum())


def prompt_width(encoder: PromptEncoder, examples, *, max_new_tokens: int) -> int:
    """P, the padded prompt width :func:`host_prompts` gives these examples (every host)."""
    _, tokens_bxP, _ = encoder.encode(examples, max_new_tokens=max_new_tokens)
    return distributed.max_over_hosts(tokens_bxP.shape[1])


@dataclasses.dataclass(frozen=True)
class Policy:
    """The policy a run trains, as code and text (its parameters live in the train state).

    Attributes:
      graphdef: the model's ``nnx`` graph definition.
      tokenizer: its tokenizer.
      lora: with ``model.lora.rank`` > 0, the base's graphdef and identity
        (``grpo_jax.models.lora``), else None.
    """

    graphdef: object
    tokenizer: object
    lora: object = None


@dataclasses.dataclass(frozen=True)
class Rollouts:
    """What sampling, scoring and normalising a step's batch needs; built once per run.

    Attributes:
      policy: the policy's graphdef and tokenizer.
      encoder: examples -> prompt tokens.
      scorer: completions -> rewards.
      sampling: the sampler's settings (T = ``sampling.max_new_tokens``).
      grpo: the run's ``grpo`` section (G and the advantage estimator).
      batch_size: B, prompts per step.
      placement: where the batch lives (``grpo_jax.core.sharding.Placement``).
      message: prints one line on the run's console.
      sampler_weights: with ``sampling.param_dtype``, the sampler's copy of
        the policy in that dtype (``grpo_jax.sampling.weights``), else None:
        the sampler reads the trained parameters.
    """

    policy: Policy
    encoder: PromptEncoder
    scorer: Scorer
    sampling: object
    grpo: object
    batch_size: int
    placement: sharding_lib.Placement
    message: Callable[[str], None] = print
    sampler_weights: SamplerWeights | None = None

    @property
    def mesh(self):
        return self.placement.mesh

    def sampler_policy(self, params):
        """(graphdef, params) the sampler decodes with: the copy in ``sampling.param_dtype``
        (cast from ``params`` unless they already are it), else the policy itself."""
        if self.sampler_weights is None:
            return self.policy.graphdef, params
        return self.sampler_weights.graphdef, self.sampler_weights(params)

    @property
    def rows_N(self) -> slice:
        return self.placement.rows_N


@dataclasses.dataclass
class _Round:
    """One sampling round: B prompts x G completions, sampled, decoded and scored."""

    out: object  # SampleOutput: global device arrays, N rows
    rows: dict  # per-row host values of all hosts, in process order (distributed.gather_rows)
    order: np.ndarray  # rows' permutation from process order to the batch's row order
    total_N: np.ndarray  # weighted total rewards in the batch's row order
    examples: list[dict]  # this host's prompts' examples
    prompts_n: list[str]
    completions: list[str]
    total_n: np.ndarray
    names: list[str]
    t_sample: float
    t_reward: float
    t_params_ready: float
    engine: object = None  # the engine's statistics (the paged engine's EngineStats)


@dataclasses.dataclass
class Dispatched:
    """A sampling round whose generation is dispatched (the device may still run it)."""

    out: object  # SampleOutput: global device arrays, N rows
    examples: list[dict]
    prompts: list[str]
    prompt_tokens: int
    t_params_ready: float
    engine: object = None  # the engine's statistics (None on the static engine)


def dispatch_round(
    r: Rollouts, params, examples: list[dict], key: jax.Array, *, mesh=None, wait_params=True
) -> Dispatched:
    """Encodes this host's prompts and dispatches the generation; returns without waiting.

    ``mesh``: where to sample (``r.mesh`` when None). ``wait_params``: first
    wait until ``params`` are computed (the on-policy loop does, to time the
    sampler alone).
    """
    G = r.grpo.G
    mesh = r.mesh if mesh is None else mesh
    prompts, tokens_BxP, mask_BxP, prompt_tokens = host_prompts(
        r.encoder,
        examples,
        mesh=mesh,
        num_rows=r.batch_size,
        max_new_tokens=r.sampling.max_new_tokens,
    )
    graphdef, params = r.sampler_policy(params)
    if wait_params:
        # The previous update must finish before sampling anyway; waiting here times each part.
        jax.block_until_ready(params)
    t0 = time.perf_counter()
    out, stats = get_engine(r.sampling.engine).generate(
        graphdef, params, tokens_BxP, mask_BxP, key, r.sampling, num_samples=G, mesh=mesh
    )
    return Dispatched(out, list(examples), prompts, prompt_tokens, t0, stats)


def _sample_round(r: Rollouts, params, examples: list[dict], key: jax.Array) -> _Round:
    return finish_round(r, dispatch_round(r, params, examples, key))


def finish_round(r: Rollouts, d: Dispatched) -> _Round:
    """Waits for a dispatched round's samples, then decodes and scores this host's rows."""
    G = r.grpo.G
    out, examples, prompts, prompt_tokens, t0 = (
        d.out,
        d.examples,
        d.prompts,
        d.prompt_tokens,
        d.t_params_ready,
    )
    jax.block_until_ready(out.lengths)
    t1 = time.perf_counter()
    tokens_nxT, lengths_n, trunc_n, pmask_nxP = distributed.local_rows(
        (out.tokens, out.lengths, out.truncated, out.prompt_mask), r.rows_N
    )
    completions = decode(r.policy.tokenizer, tokens_nxT, lengths_n)
    prompts_n = [p for p in prompts for _ in range(G)]
    result, correct_n, invalid_n = r.scorer.score(
        prompts_n, completions, examples, repeat=G, lengths_N=lengths_n
    )
    names = list(result.per_reward)
    rows = distributed.gather_rows(
        {
            "total": result.total,
            "row": np.arange(r.rows_N.start, r.rows_N.stop),
            "per_reward": {k: result.per_reward[k] for k in names},
            "errors": np.array([[result.errors.get(k, 0) for k in names]], np.int32),
            "clipped": np.array([[result.clipped.get(k, 0) for k in names]], np.int32),
            "prompt_tokens": np.array([prompt_tokens * G]),  # each prompt heads G rows
            "prompt_lengths": pmask_nxP.sum(axis=1),
            "correct": correct_n,
            "lengths": lengths_n,
            "truncated": trunc_n,
            "invalid": invalid_n,
            "duplicate": duplicate_flags(completions, G),
        }
    )
    # Hosts' blocks come in process order; the groups need the batch's row order.
    order = np.argsort(rows["row"], kind="stable")
    return _Round(
        out=out,
        rows=rows,
        order=order,
        total_N=rows["total"][order],
        examples=list(examples),
        prompts_n=prompts_n,
        completions=completions,
        total_n=result.total,
        names=names,
        t_sample=t1 - t0,
        t_reward=time.perf_counter() - t1,
        t_params_ready=t0,
        engine=d.engine,
    )


def _advantages(r: Rollouts, total_KxG: np.ndarray) -> np.ndarray:
    return np.asarray(
        adv_lib.compute_advantages(
            jnp.asarray(total_KxG),
            estimator=r.grpo.advantage_estimator,
            eps=r.grpo.advantage_eps,
            passk_k=r.grpo.passk_k,
        )
    ).reshape(-1)


def _metrics(r: Rollouts, rounds: list[_Round]) -> dict[str, float]:
    """The rollout statistics over every row sampled this step (all rounds)."""
    # Every per-row array in the batch's row order, round after round, so groups stay whole.
    cat = lambda key: np.concatenate([x.rows[key][x.order] for x in rounds])
    names = rounds[0].names
    errors = sum(x.rows["errors"].sum(axis=0) for x in rounds)
    clipped = sum(x.rows["clipped"].sum(axis=0) for x in rounds)
    per_reward = {
        r.scorer.display[k]: np.concatenate([x.rows["per_reward"][k][x.order] for x in rounds])
        for k in names
    }
    metrics = rollout_metrics(
        total_N=np.concatenate([x.total_N for x in rounds]),
        per_reward=per_reward,
        errors={r.scorer.display[k]: int(e) for k, e in zip(names, errors, strict=True)},
        clipped={r.scorer.display[k]: int(c) for k, c in zip(names, clipped, strict=True)},
        correct_N=cat("correct"),
        lengths_N=cat("lengths"),
        truncated_N=cat("truncated"),
        duplicate_N=cat("duplicate"),
        G=r.grpo.G,
        invalid_N=cat("invalid"),
    )
    for name, _, _ in r.scorer.learned:
        metrics.update(learned_metrics(name, per_reward[name], cat("correct"), r.grpo.G))
    t_sample = sum(x.t_sample for x in rounds)
    sampled_tokens = int(cat("lengths").sum())
    metrics.update(
        {
            "perf/time_sample_s": t_sample,
            "perf/time_reward_s": sum(x.t_reward for x in rounds),
            "perf/sample_tokens_per_s": sampled_tokens / max(t_sample, 1e-9),
        }
    )
    stats = [x.engine for x in rounds if x.engine is not None]
    if stats:  # an engine that reports statistics (the paged engine's: docs/engine.md)
        metrics.update(get_engine(r.sampling.engine).metrics(stats))
    return metrics


def _host(rounds: list[_Round], metrics, completion_tokens: int, prompt_tokens: int):
    sampled = int(sum(x.rows["lengths"].sum() for x in rounds))
    return HostRollout(
        examples=[ex for x in rounds for ex in x.examples],
        prompts_n=[p for x in rounds for p in x.prompts_n],
        completions=[c for x in rounds for c in x.completions],
        total_n=np.concatenate([x.total_n for x in rounds]),
        metrics=metrics,
        completion_tokens=completion_tokens,
        sampled_tokens=sampled,
        prompt_tokens=prompt_tokens,
        t_params_ready=rounds[0].t_params_ready,
    )


def batch_from_round(r: Rollouts, rd: _Round):
    """One round's rollouts -> (RolloutBatch, HostRollout): group advantages over the batch."""
    G, B = r.grpo.G, r.batch_size
    N = B * G
    advantages_N = _advantages(r, rd.total_N.reshape(-1, G))
    metrics = _metrics(r, [rd])
    out = rd.out
    host_rows_N = lambda x_N: distributed.global_batch(x_N[r.rows_N], r.mesh, N)
    batch = RolloutBatch(
        prompt_tokens_NxP=out.prompt_tokens,
        prompt_mask_NxP=out.prompt_mask,
        tokens_NxT=out.tokens,
        mask_NxT=out.mask,
        old_logps_NxT=out.logps,
        behavior_logps_NxT=out.behavior_logps,
        rewards_N=host_rows_N(rd.total_N.astype(np.float32)),
        advantages_N=host_rows_N(advantages_N),
        weights_N=host_rows_N(np.ones((N,), np.float32)),
        group_ids_N=host_rows_N(np.repeat(np.arange(B, dtype=np.int32), G)),
        routes_NxSxRxK=out.routes,
    )
    completion_tokens = int(rd.rows["lengths"].sum())
    prompt_tokens = int(rd.rows["prompt_tokens"].sum())
    return batch, _host([rd], metrics, completion_tokens, prompt_tokens)


# ---------------------------------------------------------------------------
# Dynamic sampling (DAPO, Yu et al. 2025).


def group_has_signal(rewards_G: np.ndarray) -> bool:
    """True when the group's finite rewards are not all equal (an exact comparison).

    Such a group is the only kind with a nonzero advantage: equal rewards give
    every estimator's advantage exactly 0, whatever float noise the
    normalisation would add.
    """
    finite = np.asarray(rewards_G)[np.isfinite(rewards_G)]
    return finite.size > 1 and bool(np.any(finite != finite[0]))


def select_groups(totals_RxBxG: list[np.ndarray], batch_size: int):
    """Which groups of the rounds drawn so far make the batch -> (kept, fillers).

    ``kept``: (round, group) of the first ``batch_size`` groups with signal,
    in draw order; ``fillers``: the groups that pad the batch to its static
    size with weight 0 (groups without signal first, then surplus ones).
    """
    signal, rest = [], []
    for r, total_BxG in enumerate(totals_RxBxG):
        for b, rewards_G in enumerate(total_BxG):
            (signal if group_has_signal(rewards_G) else rest).append((r, b))
    kept = signal[:batch_size]
    fillers = (rest + signal[batch_size:])[: batch_size - len(kept)]
    return kept, fillers


@functools.partial(jax.jit, static_argnames=("group_size", "pad_id", "mesh"))
def _assemble(outs, groups_B, *, group_size, pad_id, mesh):
    """Rows of the chosen groups, taken from the rounds' concatenated sampler outputs."""
    width = max(o[0].shape[1] for o in outs)
    # Left padding keeps every prompt's end in the same column.
    widen = lambda o, i, fill: jnp.pad(
        o[i],
        ((0, 0), (width - o[0].shape[1], 0), *[(0, 0)] * (o[i].ndim - 2)),
        constant_values=fill,
    )
    cat = lambda i, fill=None: jnp.concatenate(
        [o[i] if fill is None else widen(o, i, fill) for o in outs]
    )
    rows_N = (groups_B[:, None] * group_size + jnp.arange(group_size)[None, :]).reshape(-1)
    fields = (cat(0, pad_id), cat(1, False), *(cat(i) for i in range(2, 6)))
    if len(outs[0]) > 6:  # the routes [N, P + T, R, K]: the prompt's part is widened too
        fields = (*fields, cat(6, -1))
    return tuple(
        jax.lax.with_sharding_constraint(
            jnp.take(x, rows_N, axis=0), sharding_lib.batch_sharding(mesh, x.ndim)
        )
        for x in fields
    )


def collect_dynamic(
    r: Rollouts, params, draw: Callable[[], list[dict]], key: jax.Array, *, max_rounds: int
):
    """DAPO's dynamic sampling: rounds of B prompts until B groups have reward signal.

    Round r draws this host's next prompts with ``draw()`` (the data
    iterator, which so advances by what is consumed) and samples them with
    ``fold_in(key, r)`` (round 0: ``key``). Groups whose rewards are all equal
    (:func:`group_has_signal`) are dropped; after ``max_rounds``
    (``train.max_sampling_rounds``) rounds whatever is still short is padded
    with weight-0 groups, so the batch keeps its static shape. Advantages are
    computed over the kept groups. Metrics: the rollout statistics over every
    row sampled, and ``dynamic/*``: rounds, groups drawn, with signal,
    dropped, kept, padded, and the completion tokens sampled.
    """
    G, B = r.grpo.G, r.batch_size
    N = B * G
    rounds: list[_Round] = []
    for i in range(max_rounds):
        rounds.append(
            _sample_round(r, params, draw(), key if i == 0 else jax.random.fold_in(key, i))
        )
        kept, fillers = select_groups([x.total_N.reshape(B, G) for x in rounds], B)
        if len(kept) == B:
            break
    chosen = kept + fillers
    groups_B = np.array([r * B + b for r, b in chosen], np.int32)
    total_R = np.concatenate([x.total_N for x in rounds])
    rows_N = (groups_B[:, None] * G + np.arange(G)[None, :]).reshape(-1)
    advantages_N = np.zeros((N,), np.float32)
    k = len(kept)
    if k:
        advantages_N[: k * G] = _advantages(r, total_R[rows_N[: k * G]].reshape(k, G))
    weights_N = np.repeat((np.arange(B) < k).astype(np.float32), G)
    fields = [
        (o.prompt_tokens, o.prompt_mask, o.tokens, o.mask, o.logps, o.behavior_logps)
        + (() if o.routes is None else (o.routes,))
        for o in (x.out for x in rounds)
    ]
    with jax.set_mesh(r.mesh):
        taken = _assemble(
            fields,
            distributed.put(groups_B, sharding_lib.replicated(r.mesh)),
            group_size=G,
            pad_id=r.sampling.pad_id,
            mesh=r.mesh,
        )
    host_rows_N = lambda x_N: distributed.global_batch(x_N[r.rows_N], r.mesh, N)
    batch = RolloutBatch(
        *taken[:6],
        rewards_N=host_rows_N(total_R[rows_N].astype(np.float32)),
        advantages_N=host_rows_N(advantages_N),
        weights_N=host_rows_N(weights_N),
        group_ids_N=host_rows_N(np.repeat(np.arange(B, dtype=np.int32), G)),
        routes_NxSxRxK=taken[6] if len(taken) > 6 else None,
    )
    metrics = _metrics(r, rounds)
    # Per-row lengths in the batch's row order, round after round.
    lengths_R = np.concatenate([x.rows["lengths"][x.order] for x in rounds])
    plens_R = np.concatenate([x.rows["prompt_lengths"][x.order] for x in rounds])
    with_signal = sum(group_has_signal(g) for g in total_R.reshape(-1, G))
    metrics.update(
        {
            "dynamic/rounds": float(len(rounds)),
            "dynamic/groups_drawn": float(len(rounds) * B),
            "dynamic/groups_with_signal": float(with_signal),
            "dynamic/groups_dropped": float(len(rounds) * B - with_signal),
            "dynamic/groups_kept": float(k),
            "dynamic/groups_padded": float(B - k),
            "dynamic/sampled_tokens": float(lengths_R.sum()),
        }
    )
    return batch, _host(rounds, metrics, int(lengths_R[rows_N].sum()), int(plens_R[rows_N].sum()))
