"""Dequantisation of GGUF tensors to float32 with numpy.

A quantised tensor is a row-major sequence of fixed-size blocks, each holding ``block_size``
values of a row as small integers and one or two float16 factors. :func:`dequantize` handles
Q4_0, Q4_1, Q5_0, Q5_1, Q8_0, Q4_K, Q5_K, Q6_K, F32, F16 and BF16 in ggml's order of float32
operations, so the values equal ggml's bit for bit; other types go to
``gguf.quants.dequantize`` when that package knows them. The block layouts and the value
each encodes: docs/gguf.md, "The file and its quantised blocks".
"""

from __future__ import annotations

import numpy as np

# ggml type id -> (name, values per block, bytes per block).
TYPES = {
    0: ("F32", 1, 4),
    1: ("F16", 1, 2),
    2: ("Q4_0", 32, 18),
    3: ("Q4_1", 32, 20),
    6: ("Q5_0", 32, 22),
    7: ("Q5_1", 32, 24),
    8: ("Q8_0", 32, 34),
    12: ("Q4_K", 256, 144),
    13: ("Q5_K", 256, 176),
    14: ("Q6_K", 256, 210),
    30: ("BF16", 1, 2),
}


def _f16(blocks_NxB: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte ``start`` of each block, as float32 [N, 1]."""
    return blocks_NxB[:, start : start + 2].copy().view(np.float16).astype(np.float32)


def _nibbles(qs_NxQ: np.ndarray) -> np.ndarray:
    """[N, 16] bytes -> [N, 32] codes: low nibbles (values 0..15), then high (16..31)."""
    return np.concatenate([qs_NxQ & 0x0F, qs_NxQ >> 4], axis=-1)


def _high_bits(qh_Nx4: np.ndarray) -> np.ndarray:
    """[N, 4] little-endian uint32 bytes -> [N, 32] bits, bit j for value j."""
    word_N = qh_Nx4.copy().view("<u4")[:, 0]
    return ((word_N[:, None] >> np.arange(32, dtype=np.uint32)) & 1).astype(np.uint8)


def _q4_0(b):
    return _f16(b, 0) * (_nibbles(b[:, 2:18]).astype(np.float32) - 8)


def _q4_1(b):
    return _f16(b, 0) * _nibbles(b[:, 4:20]).astype(np.float32) + _f16(b, 2)


def _q5_0(b):
    q = _nibbles(b[:, 6:22]) | (_high_bits(b[:, 2:6]) << 4)
    return _f16(b, 0) * (q.astype(np.float32) - 16)


def _q5_1(b):
    q = _nibbles(b[:, 8:24]) | (_high_bits(b[:, 4:8]) << 4)
    return _f16(b, 0) * q.astype(np.float32) + _f16(b, 2)


def _q8_0(b):
    return _f16(b, 0) * b[:, 2:34].copy().view(np.int8).astype(np.float32)


def _k_scales(s_Nx12: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """12 bytes -> 8 six-bit scales and 8 six-bit mins (ggml's get_scale_min_k4).

    Groups 0-3: low 6 bits of bytes 0-3 (scales) and 4-7 (mins). Groups 4-7:
    the nibbles of bytes 8-11 (scale low, min high) with the top two bits of
    bytes 0-3 (scales) and 4-7 (mins) as their bits 4-5.
    """
    lo, hi, mix = s_Nx12[:, 0:4], s_Nx12[:, 4:8], s_Nx12[:, 8:12]
    scale = np.concatenate([lo & 63, (mix & 0x0F) | ((lo >> 6) << 4)], axis=-1)
    mins = np.concatenate([hi & 63, (mix >> 4) | ((hi >> 6) << 4)], axis=-1)
    return scale.astype(np.float32), mins.astype(np.float32)


def _k_codes(qs_Nx128: np.ndarray) -> np.ndarray:
    """[N, 128] bytes -> [N, 8, 32] 4-bit codes: per run of 64 values, low nibbles then high."""
    n = qs_Nx128.shape[0]
    runs = qs_Nx128.reshape(n, 4, 1, 32)
    return np.concatenate([runs & 0x0F, runs >> 4], axis=2).reshape(n, 8, 32)


def _q4_k(b):
    n = b.shape[0]
    scale, mins = _k_scales(b[:, 4:16])
    d_Nx8 = _f16(b, 0) * scale
    m_Nx8 = _f16(b, 2) * mins
    q = _k_codes(b[:, 16:144]).astype(np.float32)
    return (d_Nx8[..., None] * q - m_Nx8[..., None]).reshape(n, 256)


def _q5_k(b):
    n = b.shape[0]
    scale, mins = _k_scales(b[:, 4:16])
    d_Nx8 = _f16(b, 0) * scale
    m_Nx8 = _f16(b, 2) * mins
    qh_Nx32 = b[:, 16:48]
    fifth = (
        qh_Nx32[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]
    ) & 1  # Group g: bit g.
    q = (_k_codes(b[:, 48:176]) | (fifth << 4)).astype(np.float32)
    return (d_Nx8[..., None] * q - m_Nx8[..., None]).reshape(n, 256)


def _q6_k(b):
    """Two halves of 128 values; in each, value 32 * k + l (k < 4, l < 32) takes
    the low or high nibble of ql[l + 32 * (k % 2)] (high for k >= 2) and bits
    2k..2k+1 of qh[l]; the scale of values 16 s .. 16 s + 15 is scales[s]."""
    n = b.shape[0]
    ql = b[:, 0:128].reshape(n, 2, 2, 32)  # [half, k % 2, l]
    qh = b[:, 128:192].reshape(n, 2, 1, 32)  # [half, -, l]
    low = np.concatenate([ql & 0x0F, ql >> 4], axis=2)  # [half, k, l]
    high = (qh >> (2 * np.arange(4, dtype=np.uint8)).reshape(1, 1, 4, 1)) & 3
    q = ((low | (high << 4)).astype(np.float32) - 32).reshape(n, 16, 16)
    scale = b[:, 192:208].copy().view(np.int8).astype(np.float32)
    d_Nx16 = _f16(b, 208) * scale
    return (d_Nx16[..., None] * q).reshape(n, 256)


_BLOCK_FNS = {
    2: _q4_0,
    3: _q4_1,
    6: _q5_0,
    7: _q5_1,
    8: _q8_0,
    12: _q4_k,
    13: _q5_k,
    14: _q6_k,
}


def dequantize(data: np.ndarray, ggml_type: int, shape: tuple[int, ...]) -> np.ndarray:
    """The float32 array of ``shape`` (numpy order) that GGUF tensor ``data`` encodes.

    ``data`` is the tensor's bytes (any shape, uint8) for quantised types, or
    its values for F32/F16/BF16. Unknown types raise ValueError naming them.
    """
    ggml_type = int(ggml_type)
    count = int(np.prod(shape, dtype=np.int64))
    if ggml_type == 0:
        return np.asarray(data).view(np.float32).reshape(shape)
    if ggml_type == 1:
        return np.asarray(data).view(np.float16).reshape(shape).astype(np.float32)
    if ggml_type == 30:  # bfloat16: the top half of a float32.
        raw = np.asarray(data).view(np.uint16).reshape(shape)
        return (raw.astype(np.uint32) << 16).view(np.float32)
    if ggml_type in _BLOCK_FNS:
        _, size, nbytes = TYPES[ggml_type]
        if count % size:
            raise ValueError(f"{count} values are not whole blocks of {size}")
        blocks = np.ascontiguousarray(data).view(np.uint8).reshape(count // size, nbytes)
        out = np.empty((count // size, size), np.float32)
        step = 1 << 14  # Blocks per chunk: bounds the temporaries' memory.
        for i in range(0, blocks.shape[0], step):
            out[i : i + step] = _BLOCK_FNS[ggml_type](blocks[i : i + step])
        return out.reshape(shape)
    try:
        import gguf

        qtype = gguf.GGMLQuantizationType(ggml_type)
        rows = np.asarray(data).reshape(count // shape[-1], -1)
        return gguf.quants.dequantize(rows, qtype).astype(np.float32).reshape(shape)
    except (ImportError, ValueError, NotImplementedError) as e:
        raise ValueError(
            f"GGUF tensor type {ggml_type} cannot be dequantised ({e}); supported: "
            f"{sorted(name for name, _, _ in TYPES.values())}"
        ) from e
