"""A sequence-classification model: the decoder with a ``score`` head in place of the LM head.

    model = load_reward_model("/path/to/LlamaForSequenceClassification", mesh=mesh)
    scores_BxC = model.scores(tokens_BxT, mask_BxT)            # float32, C = num_labels

As transformers' ``*ForSequenceClassification`` computes it, at each row's last real token
(the last one the mask marks); built with tied embeddings, so it holds no LM head
(docs/learned_rewards.md, "Reward models").
"""

from __future__ import annotations

import math
import os
import pathlib

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from grpo_jax.core import integrity
from grpo_jax.core.sharding import MESH_AXES, logical_to_spec
from grpo_jax.models import CheckpointError, ModelConfig, Transformer
from grpo_jax.models.hf import check_unused, load_into, open_checkpoint
from grpo_jax.models.hf_weights import Entry, weight_table
from grpo_jax.models.layers import param
from grpo_jax.models.partitioning import fit_spec

SCORE = "score.weight"  # transformers' name of the head: nn.Linear(D, C, bias=False)


class RewardModel(Transformer):
    """The decoder (no LM head) and a ``score`` head [D, C]; ``scores`` is its forward pass."""

    def __init__(self, cfg: ModelConfig, num_labels: int, *, rngs: nnx.Rngs, layout="fsdp"):
        super().__init__(cfg.replace(tie_embeddings=True), rngs=rngs, layout=layout)
        self.num_labels = int(num_labels)
        shape = (cfg.hidden_size, self.num_labels)
        self.score = param(shape, ("embed", None), cfg.params_dtype)
        self.score[...] = 0.02 * jax.random.normal(rngs.params(), shape, cfg.params_dtype)

    def scores(self, tokens_BxT: jax.Array, mask_BxT: jax.Array) -> jax.Array:
        """float32 [B, C]: the head on each row's last real token (``mask_BxT`` True)."""
        T = tokens_BxT.shape[1]
        x_BxTxD = self.features(tokens_BxT, mask_BxT=mask_BxT)
        last_B = T - 1 - jnp.argmax(mask_BxT[:, ::-1].astype(jnp.int32), axis=1)
        x_BxD = jnp.take_along_axis(x_BxTxD, last_B[:, None, None], axis=1)[:, 0]
        h_BxD = self.final_norm(x_BxD)
        w_DxC = self.score[...].astype(h_BxD.dtype)
        return jnp.einsum("bd,dc->bc", h_BxD, w_DxC, preferred_element_type=jnp.float32)

    def packed_scores(self, tokens_RxL: jax.Array, segments, last_Q: jax.Array) -> jax.Array:
        """float32 [Q, C]: :meth:`scores` of packed rows, several sequences a row
        (``segments``, ``grpo_jax.models.attention.Segments``: each attends to itself, its
        positions from 0); ``last_Q``: each sequence's last slot in the rows laid end to end.
        """
        x_RxLxD = self.features(tokens_RxL, segments=segments)
        x_QxD = x_RxLxD.reshape(-1, x_RxLxD.shape[-1])[last_Q]
        h_QxD = self.final_norm(x_QxD)
        w_DxC = self.score[...].astype(h_QxD.dtype)
        return jnp.einsum("qd,dc->qc", h_QxD, w_DxC, preferred_element_type=jnp.float32)


def score_entry(hidden_size: int, num_labels: int) -> Entry:
    """The head's checkpoint tensor: [C, D] in the checkpoint, [D, C] here."""
    t = lambda x: x.T
    return Entry(SCORE, ("score",), (num_labels, hidden_size), t, t)


def reward_table(cfg: ModelConfig, num_labels: int, prefix: str = "model.") -> list[Entry]:
    """Every checkpoint tensor of a reward model: the backbone's (no LM head) and the head."""
    backbone = weight_table(cfg.replace(tie_embeddings=True), prefix)
    return [*backbone, score_entry(cfg.hidden_size, num_labels)]


def _num_labels(hf: dict, ckpt, directory) -> int:
    if SCORE not in ckpt:
        raise CheckpointError(
            f"{directory}: no tensor {SCORE!r}: not a *ForSequenceClassification checkpoint "
            f"(config.json architectures: {hf.get('architectures')})"
        )
    shape = ckpt.shape(SCORE)
    labels = hf.get("id2label")
    if len(shape) != 2 or (isinstance(labels, dict) and len(labels) != shape[0]):
        raise CheckpointError(
            f"{ckpt.file_of(SCORE)}: tensor {SCORE!r} has shape {shape}, but config.json "
            f"names {len(labels) if isinstance(labels, dict) else '?'} labels (id2label)"
        )
    return int(shape[0])


def load_reward_model(
    path: str | os.PathLike, *, dtype=jnp.float32, mesh=None, layout: str = "fsdp"
) -> RewardModel:
    """The reward model of a local ``*ForSequenceClassification`` checkpoint directory.

    Each parameter goes straight into its ``layout`` sharding over ``mesh``
    (``grpo_jax.models.hf.load_into``). Raises CheckpointError naming the file
    and the problem: those of ``from_pretrained``, a missing ``score.weight``
    (a causal-LM checkpoint), or a head whose shape config.json contradicts; and
    IntegrityError for a file that differs from its checksum in the directory's
    SHA256SUMS (which ``save_reward_model`` writes; a directory without one loads as is).
    """
    if pathlib.Path(path).is_dir():
        integrity.check_sums(path)
    directory, hf, cfg, ckpt, prefix, _ = open_checkpoint(path, dtype=dtype, param_dtype=dtype)
    num_labels = _num_labels(hf, ckpt, directory)
    table = reward_table(cfg, num_labels, prefix)
    check_unused(ckpt, {e.hf_name for e in table}, prefix, True, directory)
    abstract = nnx.eval_shape(lambda: RewardModel(cfg, num_labels, rngs=nnx.Rngs(0), layout=layout))
    return load_into(abstract, ckpt, table, directory, mesh=mesh, layout=layout)


def reward_model_bytes(model: RewardModel) -> int:
    """Bytes of the reward model's parameters."""
    state = nnx.state(model, nnx.Param)
    return int(sum(np.prod(x.shape) * x.dtype.itemsize for x in jax.tree.leaves(state)))


def abstract_checkpoint_model(path, layout: str = "fsdp", *, classifier: bool):
    """The model of the checkpoint at ``path`` as ``nnx.eval_shape`` makes it (shapes and
    logical axes, no weight), in float32 as :func:`load_reward_model` and the judge's
    ``from_pretrained`` load it: a reward model (``classifier``) or a causal LM (a judge).
    Reads config.json and the safetensors headers only."""
    f32 = jnp.float32
    directory, hf, cfg, ckpt, _, _ = open_checkpoint(path, dtype=f32, param_dtype=f32)
    if classifier:
        n = _num_labels(hf, ckpt, directory)
        return nnx.eval_shape(lambda: RewardModel(cfg, n, rngs=nnx.Rngs(0), layout=layout))
    return nnx.eval_shape(lambda: Transformer(cfg, rngs=nnx.Rngs(0), layout=layout))


def checkpoint_bytes(path, mesh_shape, layout: str = "fsdp", *, classifier: bool) -> int:
    """Per-device bytes of the weights of the checkpoint at ``path`` once placed in ``layout``
    over a mesh of ``mesh_shape``: a reward model (``classifier``) or a causal LM (a judge).
    Reads config.json and the safetensors headers only."""
    model = abstract_checkpoint_model(path, layout, classifier=classifier)
    mesh_shape = {a: int(dict(mesh_shape).get(a, 1)) for a in MESH_AXES}  # missing: size 1
    total = 0
    for v in jax.tree.leaves(nnx.state(model, nnx.Param), is_leaf=_is_var):
        spec = fit_spec(
            logical_to_spec(v.get_metadata().get("logical_axes"), layout), v.shape, mesh_shape
        )
        axes = [a for s in spec if s for a in ((s,) if isinstance(s, str) else s)]
        ways = math.prod(mesh_shape[a] for a in axes)
        total += -(-math.prod(v.shape) // ways) * jnp.dtype(v.dtype).itemsize
    return int(total)


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


def learned_bytes(reward_model_path: str, judge_path: str, mesh_shape, layout="fsdp") -> int:
    """Per-device bytes of a run's reward model and judge (the reference as judge: 0, as
    its weights are the reference's, already counted)."""
    total = 0
    if reward_model_path:
        total += checkpoint_bytes(reward_model_path, mesh_shape, layout, classifier=True)
    if judge_path and judge_path != "reference":
        total += checkpoint_bytes(judge_path, mesh_shape, layout, classifier=False)
    return total
