"""Multi-turn rollouts: the model and an environment take turns, continuing from the KV cache.

Shapes: B prompts, G episodes per prompt, N = B*G rows (grouped contiguously), P padded
prompt length, T transcript slots per episode (``MultiTurnConfig.max_tokens``), S = P + T
cache slots, O the most observation tokens appended at once (``max_obs_tokens``), V
vocabulary. An episode is one row: the model's turns and the environment's observations,
with ``mask_NxT`` 1 on the model's tokens only. docs/multiturn.md has the transcript and its
loss, how the sampler continues, the observations' encoding, the budgets and the errors.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import time
from collections.abc import Callable, Mapping, Sequence

import jax
import jax.numpy as jnp
import numpy as np

from grpo_jax import envs as envs_lib
from grpo_jax.core import distributed
from grpo_jax.core import problems as problems_lib
from grpo_jax.core.batch import HostRollout, RolloutBatch
from grpo_jax.objective import advantages as adv_lib
from grpo_jax.rewards.scoring import limit_rewards
from grpo_jax.rollout.stats import duplicate_flags, rollout_metrics
from grpo_jax.sampling import static_turns
from grpo_jax.sampling.engines import STATIC, get_engine
from grpo_jax.sampling.static import SamplingConfig, pad_prompts, problem_keys
from grpo_jax.sampling.static_turns import MultiTurnConfig

# ---------------------------------------------------------------------------
# Observations as tokens.


class ObservationEncoder:
    """Turns an observation (text or chat messages) into the tokens appended after a turn.

    Without a chat template (``chat=False``) an observation's text is tokenized as it
    is (no special tokens), and messages are joined by their content. With one, the
    observation is rendered as the template renders those messages after an assistant
    turn, with the generation prompt of the next assistant turn: the template's own
    turn markers (``<|im_end|>``, ``<|im_start|>user``, its tool format for
    ``role: "tool"``). A text observation is a user message. When the model's turn
    ended with an EOS that is the template's end-of-turn marker, that marker is not
    repeated.
    """

    _SENTINEL = "\x00TURN\x00"

    def __init__(self, tokenizer, *, chat: bool, eos_ids: Sequence[int] = ()):
        self.tokenizer = tokenizer
        self.chat = chat
        self.eos_texts = [tokenizer.decode([int(i)]) for i in eos_ids]

    def text(self, observation, *, ended_with_eos: bool) -> str:
        if not self.chat:
            if isinstance(observation, str):
                return observation
            return "".join(m["content"] for m in observation)
        messages = (
            [{"role": "user", "content": observation}]
            if isinstance(observation, str)
            else list(observation)
        )
        base = [
            {"role": "user", "content": "q"},
            {"role": "assistant", "content": self._SENTINEL},
        ]
        render = functools.partial(self.tokenizer.apply_chat_template, tokenize=False)
        before = render(base)
        after = render(base + messages, add_generation_prompt=True)
        if not after.startswith(before[: before.index(self._SENTINEL)]):
            raise ValueError("the chat template renders earlier turns differently later on")
        tail = after[after.index(self._SENTINEL) + len(self._SENTINEL) :]
        if ended_with_eos:
            for eos in self.eos_texts:
                if eos and tail.startswith(eos):
                    return tail[len(eos) :]
        return tail

    def __call__(self, observation, *, ended_with_eos: bool) -> list[int]:
        text = self.text(observation, ended_with_eos=ended_with_eos)
        return list(self.tokenizer(text, add_special_tokens=False)["input_ids"])


# ---------------------------------------------------------------------------
# Episodes: the host drives the environments between phases.


@dataclasses.dataclass
class Episodes:
    """Finished episodes, row b*G + g being episode g of prompt b (numpy arrays).

    ``tokens_NxT`` is each transcript (pad after ``lengths_N``), ``mask_NxT`` marks
    the model's tokens, ``logps_NxT`` / ``behavior_logps_NxT`` their recorded
    log-probs (0 elsewhere). ``rewards_N`` sums each episode's step rewards (NaN
    after an environment error). ``truncated_N``: ended by a budget (turns, tokens,
    an observation too long). ``turn_texts``: each row's model turns as text.
    ``routes_NxSxRxK``: with routing replay (``sampling.record_routes`` on a mixture of
    experts), the experts of every position of [prompt | transcript] as the sampler fed it,
    model and environment tokens alike, [N, P + T, R, K] (-1 where nothing was fed); None
    otherwise.
    """

    prompt_tokens_NxP: np.ndarray
    prompt_mask_NxP: np.ndarray
    tokens_NxT: np.ndarray
    mask_NxT: np.ndarray
    logps_NxT: np.ndarray
    behavior_logps_NxT: np.ndarray
    lengths_N: np.ndarray
    rewards_N: np.ndarray
    success_N: np.ndarray
    errors_N: np.ndarray
    truncated_N: np.ndarray
    turns_N: np.ndarray
    turn_texts: list[list[str]]
    error_messages: list[str]
    phases: int = 0
    routes_NxSxRxK: np.ndarray | None = None


def run_episodes(
    graphdef,
    params,
    environments: Sequence,
    prompt_tokens_BxP,
    prompt_mask_BxP,
    key: jax.Array,
    *,
    sampling: SamplingConfig,
    cfg: MultiTurnConfig,
    encode_observation: Callable[..., list[int]],
    decode: Callable[[list[int]], str],
    num_samples: int = 1,
) -> Episodes:
    """Plays N = B * ``num_samples`` episodes to the end (see the module docstring).

    Args:
      graphdef, params: the policy (``nnx.split``); its log-probs are recorded.
      environments: N environments, already reset (row b*G + g plays prompt b).
      prompt_tokens_BxP, prompt_mask_BxP: the first prompts, left-padded.
      key: PRNG key; the same key (and environments) give the same episodes.
      sampling: temperature, filters, EOS ids and stop sequences (which end a
        turn; a stop sequence's tokens stay in the turn) and pad id;
        ``max_new_tokens`` is unused (``cfg.max_tokens`` is the transcript length).
      cfg: the episode budgets.
      encode_observation: ``(observation, ended_with_eos=bool) -> token ids``
        (:class:`ObservationEncoder`).
      decode: token ids -> text (a model turn, special tokens dropped).
      num_samples: G, episodes per prompt.
    """
    if not jax.dtypes.issubdtype(jnp.asarray(key).dtype, jax.dtypes.prng_key):
        key = jax.random.wrap_key_data(key)
    b = np.shape(prompt_tokens_BxP)[0]
    n = b * num_samples
    if len(environments) != n:
        raise ValueError(f"{len(environments)} environments for {n} rows")
    # The engine's own episodes (the paged pool's), or the static kernel's.
    eng = get_engine(sampling.engine).turns(
        graphdef, params, prompt_tokens_BxP, prompt_mask_BxP, key, sampling, cfg, num_samples
    )
    book = _Book.empty(n)
    while True:
        eng.phase()
        book.phases += 1
        queued = {}
        for i in range(n):
            if book.done[i] or eng.active_N[i]:
                continue  # finished earlier, or still in its turn (the cache filled up)
            length = int(eng.len_N[i])
            span = slice(int(book.turn_start[i]), length)
            ids = [int(x) for x, m in zip(eng.tokens_NxT[i, span], eng.mask_NxT[i, span]) if m]
            ids = book.end_turn(
                i, decode(ids), environments[i], eng.reason_N[i], bool(eng.last_eos_N[i]),
                length, cfg=cfg, encode_observation=encode_observation,
            )  # fmt: skip
            if ids is None:
                eng.finish(i)
            else:  # the observation opens the row's next turn
                queued[i] = ids
        if not (queued or eng.active_N.any()):
            break
        eng.start_turns(queued)
    tokens, mask, logps, behavior, length = eng.transcripts()
    # Episodes of an engine's own without routes() record none (docs/engine.md, records_routes).
    routes = eng.routes() if hasattr(eng, "routes") else None
    return Episodes(
        prompt_tokens_NxP=np.repeat(np.asarray(prompt_tokens_BxP), num_samples, axis=0),
        prompt_mask_NxP=np.repeat(np.asarray(prompt_mask_BxP, bool), num_samples, axis=0),
        tokens_NxT=np.array(tokens),
        mask_NxT=np.array(mask),
        logps_NxT=np.array(logps),
        behavior_logps_NxT=np.array(behavior),
        lengths_N=np.array(length),
        rewards_N=book.rewards,
        success_N=book.success,
        errors_N=book.errors,
        truncated_N=book.truncated,
        turns_N=book.turns,
        turn_texts=book.turn_texts,
        error_messages=book.messages,
        phases=book.phases,
        routes_NxSxRxK=None if routes is None else np.array(routes),
    )


@dataclasses.dataclass
class _Book:
    """The host's record of N episodes while they play (numpy arrays, one entry a row)."""

    rewards: np.ndarray
    success: np.ndarray
    errors: np.ndarray
    truncated: np.ndarray
    done: np.ndarray
    turns: np.ndarray
    turn_start: np.ndarray  # transcript index where the current turn began
    turn_texts: list[list[str]]
    messages: list[str]
    phases: int = 0

    @classmethod
    def empty(cls, n: int) -> _Book:
        return cls(
            rewards=np.zeros(n, np.float64),
            success=np.zeros(n, bool),
            errors=np.zeros(n, bool),
            truncated=np.zeros(n, bool),
            done=np.zeros(n, bool),
            turns=np.ones(n, np.int32),
            turn_start=np.zeros(n, np.int64),
            turn_texts=[[] for _ in range(n)],
            messages=[],
        )

    def _fail(self, i: int, message: str) -> None:
        self.done[i], self.errors[i], self.rewards[i] = True, True, math.nan
        self.messages.append(f"row {i}: {message}")

    def end_turn(
        self, i, text, env, reason, ended_with_eos, length, *, cfg, encode_observation
    ) -> list[int] | None:
        """Row ``i``'s turn ended with ``text``: steps its environment and returns the
        observation's tokens to queue, or None when the episode ends (done, a budget,
        an error: reward NaN, counted)."""
        self.turn_texts[i].append(text)
        if reason == static_turns.BUDGET:
            self.done[i] = self.truncated[i] = True
            return None
        if env is None:  # broken before the episode (reported by play)
            self._fail(i, "no environment: it failed to start")
            return None
        out = envs_lib.safe_step(env, text, cfg.env_timeout_s)
        if out.error is not None:
            self._fail(i, out.error)
            return None
        self.rewards[i] += out.reward
        self.success[i] = bool(out.info.get("success", self.success[i]))
        if out.done:
            self.done[i] = True
            return None
        if self.turns[i] >= cfg.max_turns:
            self.done[i] = self.truncated[i] = True
            return None
        try:
            ids = encode_observation(out.observation, ended_with_eos=ended_with_eos)
        except Exception as e:  # noqa: BLE001 - a template that cannot render it
            self._fail(i, f"observation: {type(e).__name__}: {e}")
            return None
        if not ids or len(ids) > cfg.max_obs_tokens or length + len(ids) >= cfg.max_tokens:
            self.done[i] = self.truncated[i] = True
            return None
        self.turns[i] += 1
        self.turn_start[i] = length + len(ids)
        return ids


def reset_all(
    spec: str, examples: Sequence[Mapping], num_samples: int, timeout_s: float
) -> tuple[list, list, list[str]]:
    """Makes and resets ``num_samples`` environments per example.

    Returns (environments N, first observations B (None: the usual prompt),
    error messages, one per broken episode). An environment whose constructor or
    ``reset`` fails is broken (None): its episode ends at its first turn with
    reward NaN. The G episodes of an example share one prompt, so their first
    observations must be equal; where they differ, all G are broken. A group
    without a working environment gets the example's usual prompt.
    """
    environments, first, messages = [], [], []
    for b, ex in enumerate(examples):
        envs_g, good = [], []  # good: the first observations of the working ones
        for _ in range(num_samples):
            env, error = envs_lib.safe_make(spec, timeout_s)
            if env is not None:
                r = envs_lib.safe_reset(env, ex, timeout_s)
                if r.error is None:
                    good.append(r.observation)
                else:
                    env, error = None, r.error
            if error is not None:
                messages.append(f"example {b}: {error}")
            envs_g.append(env)
        if any(o != good[0] for o in good[1:]):
            why = (
                f"example {b}: reset: the {len(good)} episodes' first observations differ; "
                "they must share one prompt"
            )
            messages += [why] * len(good)
            envs_g, good = [None] * num_samples, []
        environments += envs_g
        first.append(good[0] if good else None)
    return environments, first, messages


# ---------------------------------------------------------------------------
# The trainer's collect and evaluation for runs with an environment.


def _first_prompt_tokens(encoder, examples, first_obs) -> tuple[list[list[int]], list[str]]:
    """Token ids of each example's first prompt: the environment's first observation,
    or the config's usual prompt where the environment gives None."""
    usual = encoder.texts(examples)
    texts = []
    for text, obs in zip(usual, first_obs, strict=True):
        if obs is None:
            texts.append(text)
            continue
        if not encoder.chat:
            texts.append(obs if isinstance(obs, str) else "".join(m["content"] for m in obs))
            continue
        messages = [{"role": "user", "content": obs}] if isinstance(obs, str) else list(obs)
        if encoder.system and messages[0].get("role") != "system":
            messages = [{"role": "system", "content": encoder.system}, *messages]
        texts.append(
            encoder.tokenizer.apply_chat_template(
                messages, tokenize=False, add_generation_prompt=True
            )
        )
    return encoder.token_lists(texts), texts


def play(r, env, params, examples, key, *, num_samples: int, greedy=False, graphdef=None):
    """Resets the run's environments on ``examples`` and plays ``num_samples`` episodes each.

    ``r``: the run's ``rounds.Rollouts``; ``env``: its ``env`` section;
    ``graphdef``: the graph ``params`` go with (None: the policy's).

    -> (Episodes, prompt texts B, reset error messages).
    """
    cfg = mt_config(env)
    environments, first, reset_errors = reset_all(
        env.name, examples, num_samples, cfg.env_timeout_s
    )
    token_lists, texts = _first_prompt_tokens(r.encoder, examples, first)
    # A first observation that no prompt bucket holds breaks its group, as a failed
    # reset does: the example's usual prompt stands in.
    longest = max(r.encoder.buckets)
    too_long = [
        b for b, ids in enumerate(token_lists) if first[b] is not None and len(ids) > longest
    ]
    for b in too_long:
        why = (
            f"example {b}: reset: a first prompt of {len(token_lists[b])} tokens, more than "
            f"the largest prompt bucket ({longest}, sampling.prompt_buckets)"
        )
        reset_errors += [why] * num_samples
        environments[b * num_samples : (b + 1) * num_samples] = [None] * num_samples
        first[b] = None
    if too_long:
        token_lists, texts = _first_prompt_tokens(r.encoder, examples, first)
    tokens_BxP, mask_BxP = pad_prompts(
        token_lists, pad_id=r.encoder.pad_id, buckets=r.encoder.buckets
    )
    sampling = dataclasses.replace(r.sampling, greedy=greedy)
    tok = r.policy.tokenizer
    encode_obs = ObservationEncoder(tok, chat=r.encoder.chat, eos_ids=sampling.eos_ids)
    episodes = run_episodes(
        r.policy.graphdef if graphdef is None else graphdef,
        params,
        environments,
        tokens_BxP,
        mask_BxP,
        key,
        sampling=sampling,
        cfg=cfg,
        encode_observation=encode_obs,
        decode=lambda ids: tok.decode(ids, skip_special_tokens=True),
        num_samples=num_samples,
    )
    return episodes, texts, reset_errors


def mt_config(e) -> MultiTurnConfig:
    """The episode limits of the run's ``env`` section."""
    return MultiTurnConfig(
        max_tokens=e.max_tokens,
        max_turns=e.max_turns,
        max_turn_tokens=e.max_turn_tokens,
        max_obs_tokens=e.max_obs_tokens,
        env_timeout_s=e.timeout_s,
    )


def _check_single_process():
    if jax.process_count() > 1:
        raise NotImplementedError("multi-turn rollouts run in one process (one host) for now")


def collect(r, env, params, examples: list[dict], key: jax.Array):
    """Episodes for one step's examples -> (RolloutBatch, HostRollout), as a single-turn round.

    Each example's G episodes are played to the end; an episode's reward is the sum
    of its environment's step rewards, normalised within its group into advantages.
    """
    _check_single_process()
    G, B = r.grpo.G, r.batch_size
    N = B * G
    graphdef, params = r.sampler_policy(params)  # the copy in sampling.param_dtype, if any
    jax.block_until_ready(params)
    t0 = time.perf_counter()
    ep, prompts, reset_errors = play(
        r, env, params, examples, key, num_samples=G, graphdef=graphdef
    )
    t1 = time.perf_counter()
    tok = r.policy.tokenizer
    completions = [
        tok.decode([int(x) for x in row[:n]], skip_special_tokens=False)
        for row, n in zip(ep.tokens_NxT, ep.lengths_N, strict=True)
    ]
    total_N, n_infinite, n_clipped = limit_rewards("env", ep.rewards_N, 0)
    total_N = total_N.astype(np.float64)
    advantages_N = np.asarray(
        adv_lib.compute_advantages(
            jnp.asarray(total_N.reshape(-1, G), jnp.float32),
            estimator=r.grpo.advantage_estimator,
            eps=r.grpo.advantage_eps,
            passk_k=r.grpo.passk_k,
        )
    ).reshape(-1)
    model_tokens_N = ep.mask_NxT.sum(axis=1)
    n_errors = int(ep.errors_N.sum()) + n_infinite
    metrics = rollout_metrics(
        total_N=total_N,
        per_reward={"env": total_N},
        errors={"env": n_errors},
        clipped={"env": n_clipped},
        correct_N=ep.success_N,
        lengths_N=model_tokens_N,
        truncated_N=ep.truncated_N,
        duplicate_N=duplicate_flags(completions, G),
        G=G,
    )
    metrics.update(
        {
            "env/turns_mean": float(ep.turns_N.mean()),
            "env/transcript_length_mean": float(ep.lengths_N.mean()),
            "env/errors": float(n_errors),
            "env/reset_errors": float(len(reset_errors)),
            "env/phases": float(ep.phases),
            "perf/time_sample_s": t1 - t0,
            "perf/time_reward_s": 0.0,
            "perf/sample_tokens_per_s": float(ep.lengths_N.sum()) / max(t1 - t0, 1e-9),
        }
    )
    for msg in (reset_errors + ep.error_messages)[:3]:
        r.message(f"environment error (episode ends, reward NaN): {msg}")
    put = lambda x: distributed.global_batch(x, r.mesh, N)
    batch = RolloutBatch(
        prompt_tokens_NxP=put(ep.prompt_tokens_NxP.astype(np.int32)),
        prompt_mask_NxP=put(ep.prompt_mask_NxP),
        tokens_NxT=put(ep.tokens_NxT.astype(np.int32)),
        mask_NxT=put(ep.mask_NxT),
        old_logps_NxT=put(ep.logps_NxT.astype(np.float32)),
        behavior_logps_NxT=put(ep.behavior_logps_NxT.astype(np.float32)),
        rewards_N=put(total_N.astype(np.float32)),
        advantages_N=put(advantages_N.astype(np.float32)),
        weights_N=put(np.ones((N,), np.float32)),
        group_ids_N=put(np.repeat(np.arange(B, dtype=np.int32), G)),
        routes_NxSxRxK=None if ep.routes_NxSxRxK is None else put(ep.routes_NxSxRxK),
    )
    host = HostRollout(
        examples=list(examples),
        prompts_n=[p for p in prompts for _ in range(G)],
        completions=completions,
        total_n=total_N,
        metrics=metrics,
        completion_tokens=int(model_tokens_N.sum()),
        sampled_tokens=int(model_tokens_N.sum()),
        prompt_tokens=int(ep.prompt_mask_NxP.sum()),
        t_params_ready=t0,
    )
    return batch, host


def evaluate_problems(r, env, params, examples, key, *, cfg):
    """Held-out episodes problem by problem -> (``core.problems.Problems``, episode figures).

    A problem is correct when its episode succeeds; its length is the model's
    tokens over all turns. Greedy episodes play ``cfg.batch_size`` problems a
    call; with ``cfg.num_samples`` = n > 0, seed s of ``cfg.seeds`` plays n
    sampled episodes of problem i from ``fold_in(fold_in(key, 1 + s), i)`` alone
    (row keys, ``grpo_jax.sampling.static_turns``), so neither depends on
    ``eval.batch_size``. Episode figures: ``reward_mean``, ``turns_mean`` and
    ``env_errors`` of the greedy episodes.
    """
    _check_single_process()
    if not examples:
        raise ValueError("evaluate got no examples")
    per_call = max(1, int(cfg.batch_size))
    greedy = _play_chunks(r, env, params, examples, per_call, key, num_samples=1, greedy=True)
    reward = greedy["rewards"]
    episodes = {
        "reward_mean": float(np.nanmean(reward)) if np.isfinite(reward).any() else 0.0,
        "turns_mean": float(greedy["turns"].mean()),
        "env_errors": float(greedy["errors"].sum()),
    }
    kw = {}
    if cfg.num_samples:
        n, P = int(cfg.num_samples), len(examples)
        per = max(1, per_call // n)
        correct, length = [], []
        for seed in cfg.seeds:
            seed_key = jax.random.fold_in(key, 1 + seed)
            got = _play_chunks(
                r, env, params, examples, per, seed_key, num_samples=n, row_keys=True
            )
            correct.append(got["success"].reshape(P, n))
            length.append(got["lengths"].reshape(P, n))
        kw = dict(
            seeds=tuple(cfg.seeds),
            sampled_correct=np.stack(correct),
            sampled_length=np.stack(length),
        )
    prob = problems_lib.Problems(
        ids=tuple(problems_lib.problem_id(e) for e in examples),
        greedy_correct=greedy["success"],
        greedy_length=greedy["lengths"],
        greedy_truncated=greedy["truncated"],
        **kw,
    )
    return prob, episodes


def _play_chunks(
    r, env, params, examples, per_call: int, key, *, num_samples: int, greedy=False, row_keys=False
):
    """Episodes of every example in calls of ``per_call`` (the last padded: one shape), call c
    from ``fold_in(key, c)``, or with ``row_keys`` example i from ``fold_in(key, i)`` ->
    per-episode arrays (example-major, ``num_samples`` each). Evaluation plays on the static
    kernel whatever ``sampling.engine`` says: its row keys keep each episode independent of
    the other rows of its call (the paged engine draws per decode call)."""
    # Routes train, they do not score: evaluation records none (as the single-turn's).
    sampling = dataclasses.replace(r.sampling, engine=STATIC, record_routes=False)
    r = dataclasses.replace(r, sampling=sampling)
    parts = []
    for c, i in enumerate(range(0, len(examples), per_call)):
        chunk = list(examples[i : i + per_call])
        real = len(chunk)
        chunk += [chunk[0]] * (per_call - real)
        if row_keys:
            call_key = problem_keys(key, i, real, per_call)
        else:
            call_key = jax.random.fold_in(key, c)
        ep, _, _ = play(r, env, params, chunk, call_key, num_samples=num_samples, greedy=greedy)
        parts.append((ep, real * num_samples))
    cat = lambda f: np.concatenate([np.asarray(f(ep))[:rows] for ep, rows in parts])
    return {
        "success": cat(lambda e: e.success_N).astype(bool),
        "rewards": cat(lambda e: e.rewards_N),
        "turns": cat(lambda e: e.turns_N),
        "lengths": cat(lambda e: e.mask_NxT.sum(axis=1)).astype(np.int64),
        "truncated": cat(lambda e: e.truncated_N).astype(bool),
        "errors": cat(lambda e: e.errors_N),
    }
