"""MXFP4 expert weights (GPT-OSS's ``*_blocks`` / ``*_scales``), dequantised as they are read.

Format (the OCP microscaling FP4 layout as GPT-OSS checkpoints store it): ``blocks`` [..., R,
G, 16] uint8 hold 32 FP4 (E2M1) codes per group of a row, two per byte, the low nibble first;
``scales`` [..., R, G] uint8 hold each group's power of two, biased by 127. Row r of the
dequantised [..., R, G * 32] is code value * 2^(scale - 127); the stored matrix is its
transpose in the last two axes, [..., G * 32, R] (``gate_up_proj`` [E, D, 2F] of blocks
[E, 2F, D / 32, 16]). The values are exact in float32 and bfloat16.
"""

from __future__ import annotations

import numpy as np

# The 16 FP4 (E2M1) code values: sign bit 3, then 0, 0.5, 1, 1.5, 2, 3, 4, 6.
FP4_VALUES = np.asarray(
    [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0],
    np.float32,
)
BLOCKS, SCALES = "_blocks", "_scales"


def dequantize(blocks: np.ndarray, scales: np.ndarray) -> np.ndarray:
    """float32 [..., G * 32, R] of ``blocks`` [..., R, G, 16] and ``scales`` [..., R, G]."""
    blocks = np.asarray(blocks, np.uint8)
    if blocks.shape[:-1] != scales.shape:
        raise ValueError(f"MXFP4 blocks {blocks.shape} do not match scales {scales.shape}")
    *lead, R, G, B = blocks.shape
    values = np.empty((*lead, R, G, 2 * B), np.float32)
    values[..., 0::2] = FP4_VALUES[blocks & 0x0F]
    values[..., 1::2] = FP4_VALUES[blocks >> 4]
    exponent = np.asarray(scales, np.int32) - 127
    values = np.ldexp(values, exponent[..., None])
    return np.swapaxes(values.reshape(*lead, R, G * 2 * B), -1, -2)


class _Dequantized:
    """A lazy dequantised tensor: indexing dequantises only the leading-axis slice asked for
    (one device's experts), not the whole tensor."""

    def __init__(self, blocks, scales):
        self.blocks, self.scales = blocks, scales
        *lead, R, G, B = blocks.shape
        self.shape = (*lead, G * 2 * B, R)
        self.dtype = np.dtype(np.float32)
        self.ndim = len(self.shape)

    def __getitem__(self, index):
        index = index if isinstance(index, tuple) else (index,)
        head, rest = (index[0], index[1:]) if index else (slice(None), ())
        if isinstance(head, (int, np.integer)):
            return dequantize(self.blocks[head], self.scales[head])[rest]
        return dequantize(self.blocks[head], self.scales[head])[(slice(None), *rest)]

    def __array__(self, dtype=None, copy=None):
        out = self[...]
        return out if dtype is None else out.astype(dtype)


class Mxfp4Checkpoint:
    """A checkpoint (``SafetensorsCheckpoint``'s interface) whose ``<name>_blocks`` and
    ``<name>_scales`` pairs read as one float32 tensor ``<name>``; the rest pass through."""

    def __init__(self, ckpt):
        self.ckpt = ckpt
        self.packed = {
            k[: -len(BLOCKS)]
            for k in ckpt.keys()
            if k.endswith(BLOCKS) and k[: -len(BLOCKS)] + SCALES in ckpt
        }

    def __contains__(self, name: str) -> bool:
        return name in self.packed or name in self.ckpt

    def keys(self) -> list[str]:
        hidden = {n + s for n in self.packed for s in (BLOCKS, SCALES)}
        return [k for k in self.ckpt.keys() if k not in hidden] + sorted(self.packed)

    def shape(self, name: str) -> tuple[int, ...]:
        if name in self.packed:
            *lead, R, G, B = self.ckpt.shape(name + BLOCKS)
            return (*lead, G * 2 * B, R)
        return self.ckpt.shape(name)

    def __getitem__(self, name: str):
        if name in self.packed:
            return _Dequantized(self.ckpt[name + BLOCKS], self.ckpt[name + SCALES])
        return self.ckpt[name]

    def file_of(self, name: str):
        return self.ckpt.file_of(name + BLOCKS if name in self.packed else name)


def with_mxfp4(ckpt):
    """``ckpt`` itself, or an :class:`Mxfp4Checkpoint` over it when it holds MXFP4 pairs."""
    wrapped = Mxfp4Checkpoint(ckpt)
    return wrapped if wrapped.packed else ckpt
