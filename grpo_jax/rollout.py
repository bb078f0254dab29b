"""Host-side glue between examples, tokens and rewards, shared by training and evaluation.

  PromptEncoder   examples -> prompt texts -> left-padded prompt tokens
  decode          completion tokens -> texts (up to each row's length, EOS dropped)
  Scorer          texts -> weighted rewards, correctness, format validity
  host_prompts    this host's examples -> its rows of the global prompt arrays
  score_host_rows this host's rows of a sampled batch -> rewards, advantages, metrics

Shapes: B prompts, G completions per prompt, N = B*G rows (grouped
contiguously), P padded prompt length, T completion slots. Lower-case b, n:
the rows of one host (all of them in a one-process run).

In a multi-host run every host encodes, decodes and scores only its own block
of rows (the rows its devices hold), so the reward functions, the slowest
host code, run in parallel on all hosts; the groups of G never straddle hosts,
so the group advantages are exact per host. Only per-row numbers cross hosts,
for the batch's statistics.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping, Sequence

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import advantages as adv_lib
from grpo_jax import data, distributed, rewards
from grpo_jax.metrics import duplicate_flags, rollout_metrics
from grpo_jax.sampling import pad_prompts

CORRECT_THRESHOLD = 1.0 - 1e-6  # Correctness rewards return 1.0 / 0.0.


@flax.struct.dataclass
class RolloutBatch:
    """One step's rollouts as the update consumes them: global arrays split over the batch axes.

    Rows come in aligned groups of G completions of one prompt (rows b*G ..
    b*G+G-1 share prompt b and group id b), as the sampler writes them.

    Attributes:
      prompt_tokens_NxP, prompt_mask_NxP: each row's left-padded prompt.
      tokens_NxT, mask_NxT: the completion, right-padded; the mask covers the
        sampled tokens up to and including EOS.
      behavior_logps_NxT: log-probs of the completion tokens under the policy
        that sampled them (pi_old), as the sampler recorded them; 0 where masked.
      rewards_N: each row's weighted total reward.
      advantages_N: each row's group-normalised advantage.
      weights_N: per-row weight of the row's tokens in the loss (1.0 for a
        real row, 0.0 for a row that only pads the batch to its static shape).
      group_ids_N: the global index of each row's prompt in the batch.
    """

    prompt_tokens_NxP: jax.Array
    prompt_mask_NxP: jax.Array
    tokens_NxT: jax.Array
    mask_NxT: jax.Array
    behavior_logps_NxT: jax.Array
    rewards_N: jax.Array
    advantages_N: jax.Array
    weights_N: jax.Array
    group_ids_N: jax.Array

    @property
    def num_rows(self) -> int:
        return self.tokens_NxT.shape[0]


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


def parse_specs(specs: Sequence) -> tuple[rewards.RewardSpec, ...]:
    return tuple(rewards.RewardSpec(s.name, s.weight) for s in specs)


class Scorer:
    """Scores completions with the training rewards and judges correctness.

    Args:
      specs: the weighted training rewards (``rewards.RewardSpec``).
      correct_reward: the reward whose value 1.0 means "correct" (pass rate,
        pass@k); scored separately when it is not among ``specs``.
      timeout_s: per-reward time budget (``rewards.score``).

    A completion has an invalid format when a reward named "format..." is among
    the specs and gives it 0, else when no final answer can be extracted from it.
    """

    def __init__(
        self, specs: Sequence[rewards.RewardSpec], *, correct_reward: str, timeout_s: float
    ):
        self.specs = tuple(specs)
        self.correct_reward = correct_reward
        self.timeout_s = timeout_s
        for s in self.specs:
            rewards.get(s.name)  # Unknown names fail now, naming the choices.
        rewards.get(correct_reward)
        names = [s.name for s in self.specs]
        # Metric names: "format(pattern='[0-9]+')" logs as "format" when unambiguous.
        short = [n.split("(")[0] for n in names]
        self.display = {
            n: (b if short.count(b) == 1 else n) for n, b in zip(names, short, strict=True)
        }
        self._format_name = next((n for n in names if n.split("(")[0] == "format"), None)
        self._extra = () if correct_reward in names else (rewards.RewardSpec(correct_reward, 0.0),)

    def fields(self, examples: Sequence[Mapping], repeat: int) -> dict[str, list]:
        return rewards.fields_from_examples(examples, repeat, exclude=("prompt", "solution"))

    def score(
        self,
        prompts: Sequence[str],
        completions: Sequence[str],
        examples: Sequence[Mapping],
        *,
        repeat: int,
        lengths_N=None,
    ):
        """-> (RewardResult of the training rewards, correct_N bool, invalid_N bool)."""
        fields = self.fields(examples, repeat)
        result = rewards.score(
            self.specs + self._extra,
            prompts,
            completions,
            fields,
            timeout_s=self.timeout_s,
            completion_lengths=None if lengths_N is None else [int(x) for x in lengths_N],
        )
        correct_N = np.nan_to_num(result.per_reward[self.correct_reward]) >= CORRECT_THRESHOLD
        if self._format_name is not None:
            invalid_N = np.nan_to_num(result.per_reward[self._format_name]) <= 0
        else:
            invalid_N = np.array([rewards.extract_answer(c) is None for c in completions])
        for extra in self._extra:  # Weight 0: the total is unchanged; keep the logs clean.
            result.per_reward.pop(extra.name, None)
            result.errors.pop(extra.name, None)
        return result, correct_N, invalid_N

    def correct(
        self,
        completions: Sequence[str],
        examples: Sequence[Mapping],
        *,
        repeat: int = 1,
        lengths_N=None,
    ) -> np.ndarray:
        """bool[N]: the correctness reward alone (evaluation)."""
        fields = self.fields(examples, repeat)
        result = rewards.score(
            (rewards.RewardSpec(self.correct_reward, 1.0),),
            [""] * len(completions),
            completions,
            fields,
            timeout_s=self.timeout_s,
            completion_lengths=None if lengths_N is None else [int(x) for x in lengths_N],
        )
        return np.nan_to_num(result.per_reward[self.correct_reward]) >= CORRECT_THRESHOLD


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


@dataclasses.dataclass
class HostRollout:
    """One step's scored rollout: this host's rows, the global advantages and statistics."""

    prompts_n: list[str]
    completions: list[str]
    total_n: np.ndarray
    advantages_N: object  # global jax.Array split over the batch axes
    metrics: dict[str, float]
    completion_tokens: int  # all N rows, all hosts
    prompt_tokens: int  # real (unpadded) prompt tokens of all N rows, all hosts


def score_host_rows(
    out,
    examples,
    prompts,
    *,
    prompt_tokens: int,
    rows_n: slice,
    tokenizer,
    scorer: Scorer,
    G: int,
    grpo,
    mesh,
) -> HostRollout:
    """Decodes, scores and normalises this host's rows ``rows_n`` of the sampler's ``out``.

    ``prompt_tokens``: real tokens in this host's prompts (``host_prompts``).
    """
    N = out.tokens.shape[0]
    tokens_nxT, lengths_n, trunc_n = distributed.local_rows(
        (out.tokens, out.lengths, out.truncated), rows_n
    )
    completions = decode(tokenizer, tokens_nxT, lengths_n)
    prompts_n = [p for p in prompts for _ in range(G)]
    result, correct_n, invalid_n = scorer.score(
        prompts_n, completions, examples, repeat=G, lengths_N=lengths_n
    )
    advantages_n = np.asarray(
        adv_lib.compute_advantages(
            jnp.asarray(result.total.reshape(-1, G)),
            estimator=grpo.advantage_estimator,
            eps=grpo.advantage_eps,
        )
    ).reshape(-1)
    names = list(result.per_reward)
    rows = distributed.gather_rows(
        {
            "total": result.total,
            "per_reward": {k: result.per_reward[k] for k in names},
            "errors": np.array([[result.errors.get(k, 0) for k in names]], np.int32),
            "prompt_tokens": np.array([prompt_tokens * G]),  # each prompt heads G rows
            "correct": correct_n,
            "lengths": lengths_n,
            "truncated": trunc_n,
            "invalid": invalid_n,
            "duplicate": duplicate_flags(completions, G),
        }
    )
    errors = rows["errors"].sum(axis=0)
    metrics = rollout_metrics(
        total_N=rows["total"],
        per_reward={scorer.display[k]: rows["per_reward"][k] for k in names},
        errors={scorer.display[k]: int(e) for k, e in zip(names, errors, strict=True)},
        correct_N=rows["correct"],
        lengths_N=rows["lengths"],
        truncated_N=rows["truncated"],
        duplicate_N=rows["duplicate"],
        G=G,
        invalid_N=rows["invalid"],
    )
    return HostRollout(
        prompts_n=prompts_n,
        completions=completions,
        total_n=result.total,
        advantages_N=distributed.global_batch(advantages_n, mesh, N),
        metrics=metrics,
        completion_tokens=int(rows["lengths"].sum()),
        prompt_tokens=int(rows["prompt_tokens"].sum()),
    )
