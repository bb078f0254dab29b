"""LoRA: trainable low-rank adapters on a frozen base model (Hu et al. 2021).

    y = x W + s (x A) B,     A [in, r], B [r, out], s = alpha / r

    graphdef, params, base_graphdef = attach_params(graphdef, params, cfg, key)
    base, adapters = split(params)            # the frozen base and the trainable part
    nnx.merge(graphdef, join(base, adapters)) # the policy: base + adapters
    nnx.merge(base_graphdef, base)            # the reference: the base, adapters off

The adapters are float32 ``nnx.Param``s beside their projection, added by :func:`add`, with
no merged copy of any weight (docs/lora.md). A mixture of experts' weights [E, in, out], when
named, get one adapter per expert, A [E, in, r] and B [E, r, out], run inside the experts'
dispatch (:func:`expert_adapters`, ``grpo_jax.models.moe.ExpertLoRA``).
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import json
import math
import pathlib
import stat
import threading
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import grpo_jax.models.moe as moe
from grpo_jax.models.config import ADAPTABLE, EXPERT_PROJECTIONS, LORA_PROJECTIONS, LoRAConfig
from grpo_jax.models.hf_weights import weight_table
from grpo_jax.models.partitioning import logical_sharding
from grpo_jax.models.stacking import unstack_layers

SUFFIX_A, SUFFIX_B = "_lora_a", "_lora_b"
# Input dimensions of each projection's weight (the rest are its outputs), after the leading
# axes that batch it: a scanned model's "layers" and a mixture's "experts".
_IN_DIMS = {p: 2 if p == "o_proj" else 1 for p in ADAPTABLE}
_BATCH_AXES = ("layers", "experts")


def is_adapter(path) -> bool:
    """Whether a parameter path (tuple of keys) names an adapter."""
    last = str(path[-1])
    return last.endswith(SUFFIX_A) or last.endswith(SUFFIX_B)


# ---------------------------------------------------------------------------
# The forward hook.


class _DropoutState(threading.local):
    """The dropout in force, per thread: JAX traces a function on one thread, and the
    trainer traces the update on one thread (compiled ahead) while it traces the sampler on
    another. A process-wide setting let the sampler's trace read the update's traced key
    (an UnexpectedTracerError, or dropout while sampling)."""

    key = None
    rate = 0.0


_dropout = _DropoutState()


@contextlib.contextmanager
def dropout(key, rate: float):
    """Dropout on the adapters' input inside this block (the update's forward only).

    ``key`` (a PRNG key) is folded with each projection's name and layer, so
    each adapter of each layer draws its own mask. Without this block (sampling,
    pi_old, the reference, evaluation) there is no dropout. The block holds for
    the thread that enters it, not for others.
    """
    saved = (_dropout.key, _dropout.rate)
    _dropout.key, _dropout.rate = (key if rate > 0 else None), rate
    try:
        yield
    finally:
        _dropout.key, _dropout.rate = saved


def add(module, name: str, x_MxI: jax.Array, y_MxO: jax.Array) -> jax.Array:
    """``y + s (x A) B`` when ``module`` has adapters for projection ``name``, else ``y``.

    x [M, in] and y [M, out] are the projection's 2-D input and output (in and
    out flattened); A and B are cast to x's compute dtype.
    """
    a = getattr(module, name + SUFFIX_A, None)
    if a is None:
        return y_MxO
    b = getattr(module, name + SUFFIX_B)
    dt = x_MxI.dtype
    a_IxR = a[...].reshape(-1, a.shape[-1]).astype(dt)
    b_RxO = b[...].reshape(b.shape[0], -1).astype(dt)
    x_MxI = _drop(module, name, x_MxI)
    scale = jnp.asarray(module.lora_scale, dt)
    return y_MxO + ((x_MxI @ a_IxR) @ b_RxO) * scale


def _drop(module, name: str, x: jax.Array) -> jax.Array:
    """``x`` with the dropout in force (:func:`dropout`) applied, its mask drawn for this
    projection and layer; ``x`` itself outside the block."""
    if _dropout.key is None:
        return x
    dt = x.dtype
    layer = getattr(module, "lora_layer", None)
    key = jax.random.fold_in(_dropout.key, ADAPTABLE.index(name))
    if layer is not None:  # this layer's own mask (a scanned model's index is traced)
        key = jax.random.fold_in(key, layer[...])
    keep = 1.0 - _dropout.rate
    mask = jax.random.bernoulli(key, keep, x.shape)
    return jnp.where(mask, x / jnp.asarray(keep, dt), jnp.zeros((), dt))


def expert_adapters(module) -> moe.ExpertLoRA | None:
    """The adapters of a mixture-of-experts block's weights (``layers.MoE``), for the experts'
    dispatch (``grpo_jax.models.moe``), or None when it has none. Each sorted row of the
    dispatch draws its own dropout mask (a (token, expert) pair, not a token)."""
    pairs = {
        name: (getattr(module, name + SUFFIX_A)[...], getattr(module, name + SUFFIX_B)[...])
        for name in EXPERT_PROJECTIONS
        if getattr(module, name + SUFFIX_A, None) is not None
    }
    if not pairs:
        return None
    drop = None if _dropout.key is None else (lambda name, x: _drop(module, name, x))
    return moe.ExpertLoRA(pairs, float(module.lora_scale), drop)


# ---------------------------------------------------------------------------
# Attaching adapters, and the two halves of the parameters.


class LoRAIndex(nnx.Variable):
    """A layer's index (int32), for per-layer dropout masks; never trained."""


def _targets(model):
    """(module, projection name, weight Param) of every projection of ``model``."""
    for _, node in nnx.iter_graph(model):
        if isinstance(node, nnx.Module):
            for name in ADAPTABLE:
                w = getattr(node, name, None)
                if isinstance(w, nnx.Param):
                    yield node, name, w


def attach(model, cfg: LoRAConfig, key: jax.Array, *, mesh=None, layout: str = "fsdp") -> None:
    """Adds adapters of rank ``cfg.rank`` to ``cfg``'s target projections of ``model`` in place.

    With a ``mesh`` each adapter is placed in the sharding its logical axes
    give under ``layout`` (the rank axis, "lora", is never split).
    """
    if not cfg.enabled:
        raise ValueError("lora.attach: rank 0 means no adapters")
    r, targets = cfg.rank, set(cfg.projections)
    found = list(_targets(model))
    if not found:
        raise ValueError("lora.attach: the model has no projections to adapt")
    for i, (module, name, w) in enumerate(found):
        axes = tuple(w.get_metadata().get("logical_axes") or (None,) * w.ndim)
        lead = _lead(axes)
        n_in = lead + _IN_DIMS[name]
        in_shape, out_shape = w.shape[lead:n_in], w.shape[n_in:]
        a_shape = (*w.shape[:lead], *in_shape, r)
        b_shape = (*w.shape[:lead], r, *out_shape)
        a_axes = (*axes[:lead], *axes[lead:n_in], "lora")
        b_axes = (*axes[:lead], "lora", *axes[n_in:])
        bound = 1.0 / math.sqrt(math.prod(in_shape))

        def make(shape, names, draw):
            fn = jax.jit(draw)
            if mesh is not None:
                fn = jax.jit(draw, out_shardings=logical_sharding(names, shape, mesh, layout))
            return nnx.Param(fn(), logical_axes=names)

        if name not in targets:
            continue
        k = jax.random.fold_in(key, i)
        a = make(
            a_shape,
            a_axes,
            lambda k=k, s=a_shape: jax.random.uniform(k, s, jnp.float32, -bound, bound),
        )
        b = make(b_shape, b_axes, lambda s=b_shape: jnp.zeros(s, jnp.float32))
        setattr(module, name + SUFFIX_A, a)
        setattr(module, name + SUFFIX_B, b)
        module.lora_scale = float(cfg.scale)
    if cfg.dropout > 0:
        _attach_layer_indices(model, mesh)


def _lead(axes) -> int:
    """How many leading axes batch a weight: a scanned model's "layers", then a mixture's
    "experts" (each expert its own adapter)."""
    lead = 0
    for name in _BATCH_AXES:
        if lead < len(axes) and axes[lead] == name:
            lead += 1
    return lead


def _attach_layer_indices(model, mesh) -> None:
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    layers = model.layers
    put = (lambda x: x) if mesh is None else (lambda x: jax.device_put(x, NamedSharding(mesh, P())))
    blocks = [layers] if isinstance(layers, nnx.Module) and not isinstance(layers, nnx.List) else []
    if blocks:  # scanned: one stacked index [L], sliced by the scan
        index = put(jnp.arange(model.config.num_layers, dtype=jnp.int32))
        for sub in (layers.attn, layers.mlp):
            sub.lora_layer = LoRAIndex(index)
        return
    for i, block in enumerate(layers):
        for sub in (block.attn, block.mlp):
            sub.lora_layer = LoRAIndex(put(jnp.int32(i)))


def attach_params(graphdef, params, cfg: LoRAConfig, key, *, mesh=None, layout: str = "fsdp"):
    """(graphdef, params, base_graphdef) of the model ``(graphdef, params)`` with adapters.

    ``base_graphdef`` is ``graphdef`` itself: the model without adapters, which
    reads the base half of the new ``params`` (:func:`split`).
    """
    model = nnx.merge(graphdef, params)
    attach(model, cfg, key, mesh=mesh, layout=layout)
    new_graphdef, new_params = nnx.split(model)
    return new_graphdef, new_params, graphdef


def _flat(params) -> dict:
    return dict(nnx.to_flat_state(params))


def split(params):
    """(base, adapters) of a parameter pytree with adapters: two disjoint States."""
    base, adapters = {}, {}
    for path, v in _flat(params).items():
        if isinstance(v, LoRAIndex) or is_adapter(path):
            adapters[path] = v
        else:
            base[path] = v
    return nnx.from_flat_state(base), nnx.from_flat_state(adapters)


def trainable(params):
    """The adapters (A and B) of ``params``: what the optimizer sees."""
    return nnx.from_flat_state({p: v for p, v in _flat(params).items() if is_adapter(p)})


def join(base, adapters):
    """The union of two disjoint parameter pytrees (no array is touched)."""
    flat = _flat(base)
    for path, v in _flat(adapters).items():
        if path in flat:
            raise ValueError(f"lora.join: {'.'.join(map(str, path))} is in both halves")
        flat[path] = v
    return nnx.from_flat_state(flat)


def with_trainable(params, new_trainable):
    """``params`` with its adapters replaced by ``new_trainable`` (same paths)."""
    flat = _flat(params)
    for path, v in _flat(new_trainable).items():
        if path not in flat:
            raise ValueError(f"lora.with_trainable: {'.'.join(map(str, path))} is not in params")
        flat[path] = v
    return nnx.from_flat_state(flat)


def merged(params, scale: float):
    """The base parameters with every adapter folded in: W + s A B, in W's dtype.

    The product is taken in float32. ``nnx.merge(base_graphdef, merged(...))``
    is a plain model computing (up to rounding) what the adapted one computes.
    """
    flat = _flat(params)
    out = {}
    for path, v in flat.items():
        if isinstance(v, LoRAIndex) or is_adapter(path):
            continue
        a = flat.get((*path[:-1], f"{path[-1]}{SUFFIX_A}"))
        if a is None:
            out[path] = v
            continue
        b = flat[(*path[:-1], f"{path[-1]}{SUFFIX_B}")]
        w = v.get_value()
        out[path] = v.replace(_fold(w, a.get_value(), b.get_value(), scale))
    return nnx.from_flat_state(out)


def _fold(w, a, b, scale):
    lead = a.ndim + b.ndim - 2 - w.ndim  # the batching axes: stacked layers, experts
    r = a.shape[-1]
    in_shape = a.shape[lead:-1]
    out_shape = b.shape[lead + 1 :]
    a2 = a.reshape(*a.shape[:lead], -1, r).astype(jnp.float32)
    b2 = b.reshape(*b.shape[: lead + 1], -1).astype(jnp.float32)
    delta = jnp.matmul(a2, b2) * jnp.float32(scale)
    delta = delta.reshape(*w.shape[:lead], *in_shape, *out_shape)
    return (w.astype(jnp.float32) + delta).astype(w.dtype)


# ---------------------------------------------------------------------------
# The base's identity, for checkpoints.


def fingerprint(base, samples: int = 64) -> str:
    """A short hex digest of the base parameters: paths, shapes, dtypes and sampled values.

    ``samples`` elements of each tensor, at positions drawn from a hash of its
    path, are read exactly (a gather, no reduction whose order could depend on
    the mesh), so the digest is the same on any mesh and changes when the
    weights do.
    """
    h = hashlib.sha256()
    for path, v in sorted(_flat(base).items(), key=lambda kv: tuple(map(str, kv[0]))):
        x = v.get_value()
        name = ".".join(map(str, path))
        h.update(f"{name}:{tuple(x.shape)}:{x.dtype}".encode())
        n = math.prod(x.shape)
        seed = int.from_bytes(hashlib.sha256(name.encode()).digest()[:4], "little")
        idx = np.random.default_rng(seed).integers(0, n, size=min(samples, n))
        vals = _gather(x, jnp.asarray(idx, jnp.int32))
        h.update(np.asarray(jax.device_get(vals)).astype(np.float32).tobytes())
    return h.hexdigest()[:32]


@jax.jit
def _gather(x, idx):
    return x.reshape(-1)[idx]


# ---------------------------------------------------------------------------
# Hugging Face PEFT export.


def _unstacked(params, model_cfg):
    if not model_cfg.scan_layers:
        return params
    return unstack_layers(params, model_cfg.num_layers)


def peft_tensors(params, model_cfg, prefix: str = "model.") -> dict[str, np.ndarray]:
    """The adapters under PEFT's names: ``base_model.model.<module>.lora_A.weight`` [r, in]
    and ``...lora_B.weight`` [out, r], in Hugging Face's flattening of heads."""
    flat = _flat(_unstacked(trainable(params), model_cfg))
    out = {}
    for entry in weight_table(model_cfg, prefix):
        if entry.path[-1] not in LORA_PROJECTIONS:
            continue
        a = flat.get((*entry.path[:-1], f"{entry.path[-1]}{SUFFIX_A}"))
        if a is None:
            continue
        b = flat[(*entry.path[:-1], f"{entry.path[-1]}{SUFFIX_B}")]
        module = entry.hf_name[: -len(".weight")]
        a_np = np.asarray(jax.device_get(a.get_value()), np.float32)
        b_np = np.asarray(jax.device_get(b.get_value()), np.float32)
        _check_flattening(entry, a_np.shape[:-1], b_np.shape[1:])
        a_hf = a_np.reshape(-1, a_np.shape[-1]).T  # [r, in]
        b_hf = b_np.reshape(b_np.shape[0], -1).T  # [out, r]
        out[f"base_model.model.{module}.lora_A.weight"] = a_hf
        out[f"base_model.model.{module}.lora_B.weight"] = b_hf
    return out


def check_peft(params) -> None:
    """A one-line ValueError when ``params`` hold adapters of a mixture's experts: PEFT's
    adapter format names a module's ``lora_A``/``lora_B`` of one Linear weight, and a
    mixture's stacked (GPT-OSS: fused, interleaved) expert weights have no such module in
    the checkpoint's names. Their merged weights export as usual."""
    names = sorted(
        {str(path[-1])[: -len(SUFFIX_A)] for path in _flat(trainable(params))}
        & set(EXPERT_PROJECTIONS)
    )
    if names:
        raise ValueError(
            f"config key 'model.lora.targets' adapts the experts' weights {names}, which "
            "PEFT's adapter format cannot name: export the merged weights (--format=merged)"
        )


def _check_flattening(entry, in_shape, out_shape) -> None:
    """Hugging Face's [out, in] weight must be our [*in, *out] weight flattened and transposed
    (true of every projection in ``hf_weights``), so that A and B map the same way."""
    n_in, n_out = math.prod(in_shape), math.prod(out_shape)
    probe = np.arange(n_in * n_out, dtype=np.float32).reshape(*in_shape, *out_shape)
    if not np.array_equal(np.asarray(entry.to_hf(probe)), probe.reshape(n_in, n_out).T):
        raise AssertionError(f"{entry.hf_name}: the weight is not a plain flattening")


def save_peft(
    params, model_cfg, cfg: LoRAConfig, out, *, base_model: str = "", prefix: str = "model."
) -> pathlib.Path:
    """Writes ``adapter_config.json`` and ``adapter_model.safetensors`` (PEFT's LoRA format).

    ``peft.PeftModel.from_pretrained(base, out)`` on the base model then computes
    what the adapted model computes. ``prefix`` is where the text model's tensors
    live in the base checkpoint ("model." for Llama and Qwen causal LMs).
    """
    from safetensors.numpy import save_file

    check_peft(params)
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    tensors = peft_tensors(params, model_cfg, prefix)
    if not tensors:
        raise ValueError("lora.save_peft: the parameters hold no adapters")
    config = {
        "peft_type": "LORA",
        "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model or None,
        "r": cfg.rank,
        "lora_alpha": cfg.alpha,
        "lora_dropout": cfg.dropout,
        "target_modules": sorted(cfg.projections),
        "bias": "none",
        "fan_in_fan_out": False,
        "use_rslora": False,
        "use_dora": False,
        "init_lora_weights": True,
        "modules_to_save": None,
        "inference_mode": True,
    }
    (out / "adapter_config.json").write_text(json.dumps(config, indent=2) + "\n")
    path = out / "adapter_model.safetensors"
    save_file(
        {k: np.ascontiguousarray(v) for k, v in tensors.items()},
        str(path),
        metadata={"format": "pt"},
    )
    # safetensors writes 0600; give it the mode of the files written as usual (the umask's).
    path.chmod(stat.S_IMODE((out / "adapter_config.json").stat().st_mode))
    return out


# ---------------------------------------------------------------------------
# A run's adapters.


class BaseMismatchError(ValueError):
    """A checkpoint's adapters were trained on another base than the one loaded."""


@dataclasses.dataclass(frozen=True)
class LoRARun:
    """What a LoRA run keeps about its adapters and its base.

    Attributes:
      cfg: the run's ``model.lora``.
      base_graphdef: the model without adapters (the reference: adapters off).
      base_path: ``model.path`` of the base ("" for the built-in tiny model).
    """

    cfg: LoRAConfig
    base_graphdef: Any
    base_path: str

    def identity(self, base, warm_start: str | None = None) -> dict:
        """The base's identity, as checkpoints record it: its path, the fingerprint of
        its weights and, when it was warm-started, the warm-start cache's fingerprint."""
        return {"path": self.base_path, "fingerprint": fingerprint(base), "warm_start": warm_start}


def check_base(saved: dict | None, expected: dict, where: str) -> None:
    """Raises :class:`BaseMismatchError` unless the base ``saved`` (a checkpoint's record)
    is the ``expected`` one (:meth:`LoRARun.identity`)."""
    if saved is None:
        raise BaseMismatchError(
            f"{where} holds no LoRA adapters (it was saved by a run without model.lora); "
            "it cannot continue as a LoRA run"
        )
    if saved.get("fingerprint") != expected["fingerprint"]:
        raise BaseMismatchError(
            f"{where} holds adapters trained on the base {saved.get('path')!r} "
            f"(fingerprint {saved.get('fingerprint')}), but the base loaded now, "
            f"{expected['path']!r}, has fingerprint {expected['fingerprint']}: its weights "
            "differ, so the adapters would not fit it. Load the same base"
        )


def setup_params(
    graphdef, params, cfg: LoRAConfig, key, *, base_path: str, mesh=None, layout="fsdp"
):
    """(graphdef, params, :class:`LoRARun`) for the base model ``(graphdef, params)``."""
    graphdef, params, base_graphdef = attach_params(
        graphdef, params, cfg, key, mesh=mesh, layout=layout
    )
    return graphdef, params, LoRARun(cfg, base_graphdef, base_path)
