"""An LLM judge: a frozen causal LM's expected score over a rubric prompt's score tokens.

    judge = Judge.load(section, mesh)          # section: rewards.JudgeSection
    values_N = judge(prompts, completions, questions, group_size=G)   # float32[N]

Each completion's rubric runs through the model once, no sampling, and the reward is the
expected score over the score tokens (:func:`expected_score`). The reference policy as judge
is bound to the run's reference parameters once they exist (:meth:`Judge.bind`), no copy.
With ``packing`` (``train.packing = "on"``, one process) the rubrics are packed several to a
row (``scorer.score_packed``). docs/learned_rewards.md, "LLM judges".
"""

from __future__ import annotations

import dataclasses
import pathlib
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_jax.core import integrity
from grpo_jax.core.errors import ConfigError
from grpo_jax.core.sharding import batch_shards, on_mesh
from grpo_jax.models import from_pretrained, load_tokenizer
from grpo_jax.models.attention import Segments
from grpo_jax.models.hf import open_checkpoint
from grpo_jax.reward_models.model import SCORE
from grpo_jax.reward_models.scorer import score_in_batches, score_packed
from grpo_jax.rewards.section import JudgeSection

REFERENCE = "reference"
JUDGE = "judge"  # the judge's name among a RewardResult's rewards


def expected_score(logits_BxV: jax.Array, ids_K: jax.Array, values_K: jax.Array) -> jax.Array:
    """[B]: sum_k softmax(logits[:, ids])_k values_k (the softmax over the K ids alone).

    With l_k the next-token logit of score token k after the rubric prompt and v_k its
    value, the judge's reward is E[score] = sum_k softmax(l)_k v_k: the score tokens'
    probabilities renormalised among themselves.
    """
    p_BxK = jax.nn.softmax(logits_BxV[:, ids_K].astype(jnp.float32), axis=-1)
    return p_BxK @ values_K


def _judge_fn(graphdef, params, tokens_BxT, mask_BxT, ids_K, values_K):
    model = nnx.merge(graphdef, params)
    x_BxTxD = model.features(tokens_BxT, mask_BxT=mask_BxT)
    logits_BxV = model.logits(x_BxTxD[:, -1:])[:, 0]  # left padding: the next token's logits
    return expected_score(logits_BxV, ids_K, values_K)


def _packed_judge_fn(graphdef, params, tokens_RxL, id_RxL, pos_RxL, last_Q, ids_K, values_K):
    """[Q]: :func:`_judge_fn` of packed rows, each rubric attending to itself alone;
    ``last_Q``: each rubric's last slot in the rows laid end to end."""
    model = nnx.merge(graphdef, params)
    x_RxLxD = model.features(tokens_RxL, segments=Segments(id_RxL, pos_RxL))
    x_QxD = x_RxLxD.reshape(-1, x_RxLxD.shape[-1])[last_Q]
    logits_QxV = model.logits(x_QxD[:, None])[:, 0]
    return expected_score(logits_QxV, ids_K, values_K)


def _refuse_reward_model(path: str) -> None:
    """ConfigError when ``path`` is a ``*ForSequenceClassification`` checkpoint (its ``score``
    head, or its config.json's architecture, says so): from_pretrained would load its decoder
    as a causal LM whose logits come through the tied embedding, its head ignored."""
    directory, hf, _, ckpt, _, _ = open_checkpoint(path)
    archs = [a for a in hf.get("architectures") or () if isinstance(a, str)]
    classifier = [a for a in archs if a.endswith("ForSequenceClassification")]
    if SCORE in ckpt or classifier:
        what = f"architecture {classifier[0]}" if classifier else f"tensor {SCORE!r}"
        raise ConfigError(
            f"config key 'judge.path' = {str(directory)!r} is a reward-model checkpoint ({what}), "
            "not a causal language model whose next-token logits a judge reads: give it as "
            "reward_model.path (weight: reward_model.weight), or set judge.path to a causal-LM "
            "checkpoint or to 'reference'"
        )


@dataclasses.dataclass
class Judge:
    """A frozen causal LM (graphdef, params), its tokenizer and the rubric settings.

    ``params`` is None until :meth:`bind` for the reference policy's judge. ``packing``:
    score packed rows where one process runs.
    """

    section: JudgeSection
    graphdef: object = None
    params: object = None
    tokenizer: object = None
    mesh: jax.sharding.Mesh | None = None
    packing: bool = False

    def __post_init__(self):
        shards = 1 if self.mesh is None else batch_shards(self.mesh)
        if self.section.batch_size % shards:
            raise ConfigError(
                f"config key 'judge.batch_size' = {self.section.batch_size} must be a multiple "
                f"of the mesh's {shards} batch shards"
            )
        # Under the mesh (``OnMesh``): the rows split over the batch axes, not every row on
        # every device (as the update's passes, docs/pods.md).
        self._jit = on_mesh(jax.jit(_judge_fn, static_argnums=0), self.mesh)
        self._packed_jit = on_mesh(jax.jit(_packed_judge_fn, static_argnums=0), self.mesh)
        if self.tokenizer is not None:
            self._ids = jnp.asarray(self.score_ids(), jnp.int32)
        self._values = jnp.asarray(self.section.values, jnp.float32)

    @classmethod
    def load(
        cls, section: JudgeSection, mesh=None, layout: str = "fsdp", packing: bool = False
    ) -> Judge:
        """The judge of ``section.path`` (unbound for "reference"). A directory's SHA256SUMS,
        when it has one, is verified first, as ``load_reward_model`` does (IntegrityError)."""
        if section.path == REFERENCE:
            return cls(section=section, mesh=mesh, packing=packing)
        if pathlib.Path(section.path).is_dir():
            integrity.check_sums(section.path)
        _refuse_reward_model(section.path)
        graphdef, params = nnx.split(from_pretrained(section.path, mesh=mesh, layout=layout))
        tokenizer = load_tokenizer(section.tokenizer or section.path)
        return cls(section, graphdef, params, tokenizer, mesh, packing)

    def bind(self, graphdef, params, tokenizer) -> None:
        """Judges with these (the reference policy's) arrays from now on, not a copy."""
        self.graphdef, self.params = graphdef, params
        if self.tokenizer is None:
            self.tokenizer = tokenizer
        self._ids = jnp.asarray(self.score_ids(), jnp.int32)

    def score_ids(self) -> list[int]:
        """Each score token's id; ConfigError unless each is exactly one token."""
        out, text_of = [], {}
        for text in self.section.score_tokens:
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(ids) != 1:
                raise ConfigError(
                    f"config key 'judge.score_tokens': {text!r} is {len(ids)} tokens of the "
                    f"judge's tokenizer ({ids}); each score token must be exactly one"
                )
            if int(ids[0]) in text_of:
                raise ConfigError(
                    f"config key 'judge.score_tokens': {text_of[int(ids[0])]!r} and {text!r} are "
                    f"both token {ids[0]} of the judge's tokenizer; each score token must be "
                    "another token (one would count twice)"
                )
            text_of[int(ids[0])] = text
            out.append(int(ids[0]))
        return out

    @property
    def pad_id(self) -> int:
        pad = self.tokenizer.pad_token_id
        return int(pad if pad is not None else self.tokenizer.eos_token_id)

    def prompts(self, questions: Sequence[str], completions: Sequence[str]) -> list[str]:
        texts = [
            self.section.rubric.format(question=q, completion=c)
            for q, c in zip(questions, completions, strict=True)
        ]
        if not self.section.chat:
            return texts
        return [
            self.tokenizer.apply_chat_template(
                [{"role": "user", "content": t}], tokenize=False, add_generation_prompt=True
            )
            for t in texts
        ]

    def __call__(self, prompts, completions, questions, *, group_size: int) -> np.ndarray:
        """float32[N]: each completion's expected score; NaN: too long or not finite."""
        del prompts, group_size  # the rubric holds the question; no normalisation
        if self.params is None:
            raise RuntimeError("the reference policy's judge is used before Judge.bind")
        s = self.section
        texts = self.prompts(questions, completions)
        ids = self.tokenizer(texts, add_special_tokens=not s.chat)["input_ids"]

        def padded(tokens, mask):
            return self._jit(self.graphdef, self.params, tokens, mask, self._ids, self._values)

        def packed(tokens, ids, pos, last):
            args = (tokens, ids, pos, last, self._ids, self._values)
            return self._packed_jit(self.graphdef, self.params, *args)

        score, fn = score_in_batches, padded
        if self.packing and jax.process_count() == 1:
            score, fn = score_packed, packed
        return score(
            fn,
            [list(x) or [self.pad_id] for x in ids],
            pad_id=self.pad_id,
            buckets=s.buckets,
            batch_size=s.batch_size,
            mesh=self.mesh,
            what=JUDGE,
        )
