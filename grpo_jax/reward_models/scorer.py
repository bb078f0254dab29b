"""Scoring completions with a reward model: text in, one float per completion out.

    learned = LearnedReward.load(section, mesh)    # section: rewards.RewardModelSection
    values_N = learned(prompts, completions, questions, group_size=G)   # float32[N]

Texts are tokenized and scored ``batch_size`` at a time in bucketed shapes, split over the
mesh's batch axes; with several processes each host scores its own rows. A text longer than
the largest bucket, or a score that is not finite, is NaN (unscored, counted). With
``packing`` (``train.packing = "on"``, one process) the texts are packed several to a row
instead (:func:`score_packed`, docs/packing.md).
docs/learned_rewards.md ("In a run", "Containment", "Several processes") has the rest.
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Sequence

import jax
import numpy as np
from flax import nnx

from grpo_jax.core import distributed
from grpo_jax.core.errors import ConfigError
from grpo_jax.core.packing import first_fit_decreasing, next_power_of_two, round_up
from grpo_jax.core.sharding import batch_sharding, batch_shards, on_mesh
from grpo_jax.models import CheckpointError, load_tokenizer
from grpo_jax.models.attention import Segments
from grpo_jax.reward_models.model import RewardModel, load_reward_model
from grpo_jax.rewards.section import RewardModelSection
from grpo_jax.sampling.static import pad_prompts

log = logging.getLogger(__name__)

LEARNED = "reward_model"  # the learned reward's name among a RewardResult's rewards


def _scores_fn(graphdef, params, tokens_BxT, mask_BxT):
    return nnx.merge(graphdef, params).scores(tokens_BxT, mask_BxT)


def _packed_scores_fn(graphdef, params, tokens_RxL, id_RxL, pos_RxL, last_Q):
    model = nnx.merge(graphdef, params)
    return model.packed_scores(tokens_RxL, Segments(id_RxL, pos_RxL), last_Q)


@dataclasses.dataclass
class RunningMoments:
    """Mean and variance of every value added so far (Chan et al.'s parallel update)."""

    count: int = 0
    mean: float = 0.0
    m2: float = 0.0

    def add(self, values: np.ndarray) -> None:
        v = np.asarray(values, np.float64)
        v = v[np.isfinite(v)]
        if not v.size:
            return
        n, mean = v.size, float(v.mean())
        delta, total = mean - self.mean, self.count + n
        self.m2 += float(((v - mean) ** 2).sum()) + delta**2 * self.count * n / total
        self.mean += delta * n / total
        self.count = total

    @property
    def std(self) -> float:
        return math.sqrt(self.m2 / self.count) if self.count else 0.0

    def state(self) -> dict:
        """JSON-ready (a float's repr reads back as the same float): what a checkpoint saves."""
        return {"count": self.count, "mean": self.mean, "m2": self.m2}

    def restore(self, state: dict) -> None:
        self.count, self.mean, self.m2 = (
            int(state["count"]),
            float(state["mean"]),
            float(state["m2"]),
        )


def standardize(values_N: np.ndarray, mean, std, eps: float = 1e-6) -> np.ndarray:
    return ((values_N - mean) / (std + eps)).astype(np.float32)


def group_standardize(values_N: np.ndarray, group_size: int) -> np.ndarray:
    """Each group of ``group_size`` consecutive rows standardised by its finite values."""
    v_GxK = values_N.reshape(-1, group_size).astype(np.float64)
    finite = np.isfinite(v_GxK)
    n = np.maximum(finite.sum(axis=1, keepdims=True), 1)
    mean = np.where(finite, v_GxK, 0.0).sum(axis=1, keepdims=True) / n
    var = np.where(finite, (v_GxK - mean) ** 2, 0.0).sum(axis=1, keepdims=True) / n
    return standardize(v_GxK, mean, np.sqrt(var)).reshape(-1)


def score_in_batches(
    fn, token_lists, *, pad_id: int, buckets, batch_size: int, mesh=None, what: str = ""
) -> np.ndarray:
    """float32[N]: ``fn(tokens_BxP, mask_BxP) -> [B]`` over the rows, ``batch_size`` at a time.

    Each batch is left-padded to the smallest of ``buckets`` holding its longest row,
    the last one filled with empty rows (one compiled shape per bucket), and split over
    ``mesh``'s batch axes. A row longer than the largest bucket, or a value that is not
    finite, is NaN (and the first counted in a warning naming ``what``'s buckets).
    With several processes ``token_lists`` are this host's rows and every host calls
    this together (module doc).
    """
    out, fits = _unscored_and_fitting(token_lists, buckets, what)
    if mesh is not None and jax.process_count() > 1:
        _score_across_hosts(fn, token_lists, fits, out, pad_id, buckets, batch_size, mesh)
    else:
        for start in range(0, len(fits), batch_size):
            rows = fits[start : start + batch_size]
            tokens, mask = _padded(token_lists, rows, batch_size, pad_id, buckets)
            if mesh is not None:
                tokens, mask = jax.device_put((tokens, mask), batch_sharding(mesh))
            out[rows] = np.asarray(fn(tokens, mask))[: len(rows)]
    out[~np.isfinite(out)] = np.nan
    return out


def _unscored_and_fitting(token_lists, buckets, what: str):
    """(NaN scores for every text, the indices of the texts the largest bucket holds); the
    texts left out are counted in one warning naming ``what``'s buckets."""
    n = len(token_lists)
    fits = [i for i, t in enumerate(token_lists) if len(t) <= buckets[-1]]
    if len(fits) < n:
        log.warning(
            "%s: %d of %d texts exceed %s.buckets' largest (%d tokens) and are not scored",
            what,
            n - len(fits),
            n,
            what,
            buckets[-1],
        )
    return np.full(n, np.nan, np.float32), fits


def score_packed(
    fn, token_lists, *, pad_id: int, buckets, batch_size: int, mesh=None, what: str = ""
) -> np.ndarray:
    """:func:`score_in_batches` with the rows packed: ``fn(tokens_RxL, id_RxL, pos_RxL,
    last_Q) -> [Q]`` scores the sequences of R packed rows of L slots.

    L is the smallest of ``buckets`` holding the longest text; the texts go into rows of L
    by first fit decreasing, ``batch_size`` rows a call (a padded call's rows, each now
    holding several texts). The compiled shapes stay few: R is a power of two (a multiple
    of the mesh's batch shards, at most ``batch_size``) and Q, the texts a call, one too.
    One process only (several: :func:`score_in_batches`).
    """
    out, fits = _unscored_and_fitting(token_lists, buckets, what)
    if not fits:
        return out
    lengths = [len(token_lists[i]) for i in fits]
    L = next(b for b in buckets if b >= max(lengths))
    rows = first_fit_decreasing(lengths, L)
    shards = 1 if mesh is None else batch_shards(mesh)
    for start in range(0, len(rows), batch_size):
        call = rows[start : start + batch_size]
        R = min(batch_size, round_up(next_power_of_two(len(call)), shards))
        Q = next_power_of_two(sum(len(r) for r in call))
        tokens = np.full((R, L), pad_id, np.int32)
        ids = np.zeros((R, L), np.int32)
        pos = np.zeros((R, L), np.int32)
        last = np.zeros(Q, np.int32)
        who = []
        for r, row in enumerate(call):
            slot = 0
            for j, k in enumerate(row):
                t = token_lists[fits[k]]
                sl = slice(slot, slot + len(t))
                tokens[r, sl], ids[r, sl], pos[r, sl] = t, j + 1, np.arange(len(t))
                slot += len(t)
                last[len(who)] = r * L + slot - 1
                who.append(fits[k])
        arrays = (tokens, ids, pos)
        if mesh is not None:
            arrays = jax.device_put(arrays, batch_sharding(mesh))
        out[who] = np.asarray(fn(*arrays, last))[: len(who)]
    out[~np.isfinite(out)] = np.nan
    return out


def _padded(token_lists, rows, size: int, pad_id: int, buckets):
    """(tokens, mask) of ``rows`` of ``token_lists``, left-padded to the smallest of ``buckets``
    holding the longest, filled to ``size`` rows with empty ones (one compiled shape a bucket)."""
    batch = [token_lists[i] for i in rows] + [[pad_id]] * (size - len(rows))
    tokens, mask = pad_prompts(batch, pad_id=pad_id, buckets=buckets)
    mask[len(rows) :] = False  # the filler rows hold no token
    return tokens, mask


def _score_across_hosts(fn, token_lists, fits, out, pad_id, buckets, batch_size, mesh) -> None:
    """:func:`score_in_batches`' calls with several processes: this host's rows ``fits``
    (indices of ``token_lists``) into its block of each global batch; scores into ``out``."""
    block = distributed.host_rows(mesh, batch_size)
    per = block.stop - block.start  # this host's rows of each call
    calls = distributed.max_over_hosts(math.ceil(len(fits) / per))
    for c in range(calls):
        rows = fits[c * per : (c + 1) * per]
        longest = distributed.max_over_hosts(max([len(token_lists[i]) for i in rows] + [1]))
        bucket = next(b for b in buckets if b >= longest)  # every host's rows fit it
        tokens, mask = _padded(token_lists, rows, per, pad_id, (bucket,))
        tokens, mask = distributed.global_batch((tokens, mask), mesh, batch_size)
        mine = distributed.local_rows(fn(tokens, mask), block)
        out[rows] = np.asarray(mine)[: len(rows)]


@dataclasses.dataclass
class LearnedReward:
    """A reward model, its tokenizer and settings; ``__call__`` scores a batch of texts.

    Attributes:
      model: the :class:`RewardModel` (parameters placed on ``mesh``).
      tokenizer: its Hugging Face tokenizer.
      section: the ``reward_model`` settings.
      mesh: where it runs (the trainer's mesh); None: the default device.
      packing: score packed rows (:func:`score_packed`) where one process runs.
    """

    model: RewardModel
    tokenizer: object
    section: RewardModelSection
    mesh: jax.sharding.Mesh | None = None
    packing: bool = False
    moments: RunningMoments = dataclasses.field(default_factory=RunningMoments)
    warned_nonfinite: bool = False

    def __post_init__(self):
        s = self.section
        if s.label >= self.model.num_labels:
            raise ConfigError(
                f"config key 'reward_model.label' = {s.label} is not a class of the reward "
                f"model at {s.path!r}, which has {self.model.num_labels} label(s)"
            )
        shards = 1 if self.mesh is None else batch_shards(self.mesh)
        if s.batch_size % shards:
            raise ConfigError(
                f"config key 'reward_model.batch_size' = {s.batch_size} must be a multiple of "
                f"the mesh's {shards} batch shards"
            )
        self._graphdef, self._params = nnx.split(self.model)
        # Under the mesh (``OnMesh``): the rows split over the batch axes, not every row on
        # every device (as the update's passes, docs/pods.md).
        self._jit = on_mesh(jax.jit(_scores_fn, static_argnums=0), self.mesh)
        self._packed_jit = on_mesh(jax.jit(_packed_scores_fn, static_argnums=0), self.mesh)

    @classmethod
    def load(
        cls, section: RewardModelSection, mesh=None, layout: str = "fsdp", packing: bool = False
    ):
        """The reward model of ``section.path`` on ``mesh``; CheckpointError when it cannot load."""
        model = load_reward_model(section.path, mesh=mesh, layout=layout)
        tok_dir = section.tokenizer or section.path
        tokenizer = load_tokenizer(tok_dir)
        if section.chat and not getattr(tokenizer, "chat_template", None):
            raise CheckpointError(
                f"{tok_dir}: reward_model.chat = True, but the tokenizer has no chat template"
            )
        return cls(model=model, tokenizer=tokenizer, section=section, mesh=mesh, packing=packing)

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(pad if pad is not None else self.tokenizer.eos_token_id)

    def texts(self, prompts, completions, questions) -> list[str]:
        if not self.section.chat:
            return [p + c for p, c in zip(prompts, completions, strict=True)]
        return [
            self.tokenizer.apply_chat_template(
                [{"role": "user", "content": q}, {"role": "assistant", "content": c}],
                tokenize=False,
            )
            for q, c in zip(questions, completions, strict=True)
        ]

    def token_lists(self, texts: Sequence[str]) -> list[list[int]]:
        # A chat template already holds the special tokens it wants.
        ids = self.tokenizer(list(texts), add_special_tokens=not self.section.chat)
        return [list(x) or [self.pad_id] for x in ids["input_ids"]]

    def score_tokens(self, token_lists: Sequence[Sequence[int]]) -> np.ndarray:
        """float32[N] raw scores (``section.label``'s logit); NaN: too long or not finite."""
        s = self.section

        def padded(tokens, mask):
            return self._jit(self._graphdef, self._params, tokens, mask)[:, s.label]

        def packed(tokens, ids, pos, last):
            out_QxC = self._packed_jit(self._graphdef, self._params, tokens, ids, pos, last)
            return out_QxC[:, s.label]

        score, fn = score_in_batches, padded
        if self.packing and jax.process_count() == 1:
            score, fn = score_packed, packed
        out = score(
            fn,
            token_lists,
            pad_id=self.pad_id,
            buckets=s.buckets,
            batch_size=s.batch_size,
            mesh=self.mesh,
            what="reward_model",
        )
        fits = np.array([len(t) <= s.buckets[-1] for t in token_lists], bool)
        bad = int((fits & np.isnan(out)).sum())
        if bad and not self.warned_nonfinite:
            self.warned_nonfinite = True
            log.warning(
                "reward_model: %d of %d scores are not finite (NaN or inf), so those "
                "completions are unscored (advantage 0): the reward model at %r gives no "
                "number for them, its weights damaged or diverged; rewards/reward_model/errors "
                "counts them each step (warned once)",
                bad,
                int(fits.sum()),
                s.path,
            )
        return out

    def __call__(self, prompts, completions, questions, *, group_size: int) -> np.ndarray:
        """float32[N]: each completion's reward, normalised as ``section.normalize`` says."""
        raw = self.score_tokens(self.token_lists(self.texts(prompts, completions, questions)))
        if self.section.normalize == "group":
            return group_standardize(raw, group_size)
        if self.section.normalize == "running":
            # Every host's scores, so that the moments are the same on all hosts.
            self.moments.add(distributed.gather_rows(raw) if jax.process_count() > 1 else raw)
            return standardize(raw, self.moments.mean, self.moments.std)
        return raw


def add_learned(result, name: str, values_N: np.ndarray, weight: float) -> None:
    """A learned reward into ``result`` (a ``rewards.RewardResult``), in place: its own
    entry ``name``, its non-finite values counted as errors, and ``weight`` x it in the
    total (NaN there too: unscored, advantage 0); weight 0 leaves the total alone."""
    result.per_reward[name] = np.asarray(values_N, np.float32)
    result.errors[name] = int((~np.isfinite(values_N)).sum())
    if weight:
        result.total = (result.total + weight * values_N).astype(np.float32)


def run_learned(name: str, learned, prompts, completions, questions, *, group_size: int):
    """float32[N]: ``learned``'s values, contained: one that raises, or returns something
    other than N numbers, costs this batch's learned reward (all NaN: unscored, counted as
    errors) with a warning naming it and the error, and the run goes on."""
    n = len(completions)
    try:
        values = np.asarray(learned(prompts, completions, questions, group_size=group_size))
        if values.shape != (n,):
            raise ValueError(f"returned shape {values.shape}, not ({n},)")
        return values.astype(np.float32)
    except Exception as e:  # noqa: BLE001 - any failure of a learned reward is contained
        log.warning("%s failed on %d completions, which are unscored: %r", name, n, e)
        return np.full(n, np.nan, np.float32)


def learned_metrics(name: str, values_N, correct_N, group_size: int) -> dict[str, float]:
    """A learned reward's score distribution and its agreement with the verifiable check.

    ``rewards/<name>/std``, ``min``, ``max`` over the finite values, and
    ``rewards/<name>/agreement``: over the pairs of one group whose correctness
    differs (both scored), the share in which the correct completion scores higher
    (a tie counts one half), the within-group AUC; absent when there is no such pair.
    """
    v = np.asarray(values_N, np.float64)
    finite = np.isfinite(v)
    out = {}
    if finite.any():
        out.update(
            {
                f"rewards/{name}/std": float(v[finite].std()),
                f"rewards/{name}/min": float(v[finite].min()),
                f"rewards/{name}/max": float(v[finite].max()),
            }
        )
    wins = pairs = 0.0
    ok_GxK = np.asarray(correct_N, bool).reshape(-1, group_size)
    for v_K, ok_K, f_K in zip(v.reshape(-1, group_size), ok_GxK, finite.reshape(-1, group_size)):
        good, bad = v_K[ok_K & f_K], v_K[~ok_K & f_K]
        if good.size and bad.size:
            diff = good[:, None] - bad[None, :]
            wins += float((diff > 0).sum() + 0.5 * (diff == 0).sum())
            pairs += diff.size
    if pairs:
        out[f"rewards/{name}/agreement"] = wins / pairs
    return out


__all__ = [
    "LEARNED",
    "LearnedReward",
    "RunningMoments",
    "add_learned",
    "group_standardize",
    "learned_metrics",
    "run_learned",
    "score_in_batches",
    "standardize",
]
