"""FLOPs and collective bytes of one whole run of a compiled program, from its HLO text.

XLA's ``cost_analysis()`` counts the body of a while loop once: a decode loop of 512
steps, or a scan over 24 layers, weighs as one step or one layer. :func:`analyse` reads the
optimized HLO (``compiled.as_text()``) and counts each loop body times its trip count
(:func:`trip_count`), each matmul as XLA's HloCostAnalysis does, and the bytes each
collective writes: what one chip moves over the interconnect (docs/pods.md, "What it prints").
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections import Counter

DTYPE_BYTES = {
    "pred": 1, "s4": 0.5, "u4": 0.5, "s8": 1, "u8": 1, "s16": 2, "u16": 2, "s32": 4,
    "u32": 4, "s64": 8, "u64": 8, "f16": 2, "bf16": 2, "f32": 4, "f64": 8, "c64": 8,
    "c128": 16, "f8e4m3fn": 1, "f8e5m2": 1,
}  # fmt: skip
_SHAPE = re.compile(r"\b(" + "|".join(DTYPE_BYTES) + r")\[([\d,]*)\]")
_HEADER = re.compile(r"^(ENTRY\s+)?%?([\w.\-]+)\s*\((.*)\)\s*->\s*(.*)\{\s*$")
_INSTR = re.compile(r"^\s*(ROOT\s+)?%?([\w.\-]+)\s*=\s*(.*?)\s+([\w\-]+)\((.*)$")
_CONSTANT = re.compile(r"^[su]\d+\[\]\S*\s*$")
COLLECTIVES = ("all-gather", "all-reduce", "reduce-scatter", "all-to-all", "collective-permute")


@dataclasses.dataclass
class Instr:
    name: str
    shape: str
    op: str
    operands: list[str]
    attrs: str
    root: bool
    value: int | None = None  # an integer scalar constant's value; a parameter's number


def shapes_in(text: str) -> list[tuple[str, list[int]]]:
    """(dtype, dims) of every array shape written in ``text``."""
    return [(m[1], [int(d) for d in m[2].split(",") if d]) for m in _SHAPE.finditer(text)]


def nbytes(shape_text: str) -> float:
    return sum(DTYPE_BYTES[dt] * math.prod(dims) for dt, dims in shapes_in(shape_text))


def parse(hlo: str) -> tuple[dict[str, list[Instr]], str | None]:
    """({computation: its instructions}, the entry computation's name)."""
    comps: dict[str, list[Instr]] = {}
    entry, cur = None, None
    for line in hlo.splitlines():
        h = _HEADER.match(line)
        if h:
            cur = h.group(2)
            comps[cur] = []
            entry = cur if h.group(1) else entry
            continue
        if cur is None:
            continue
        if line.strip() == "}":
            cur = None
            continue
        m = _INSTR.match(line)
        if m:
            comps[cur].append(_instr(m))
    return comps, entry


def _instr(m) -> Instr:
    rest = m.group(5)
    depth, i = 1, 0  # the operands: the names inside the first balanced parentheses
    while i < len(rest) and depth:
        depth += {"(": 1, ")": -1}.get(rest[i], 0)
        i += 1
    inside, attrs = rest[: i - 1], rest[i:]
    ins = Instr(m.group(2), m.group(3), m.group(4), re.findall(r"%([\w.\-]+)", inside), attrs,
                bool(m.group(1)))  # fmt: skip
    if ins.op == "constant" and _CONSTANT.match(ins.shape) and re.fullmatch(r"-?\d+", inside):
        ins.value = int(inside)
    if ins.op == "parameter" and inside.isdigit():  # its number
        ins.value = int(inside)
    if not ins.operands and ins.op not in ("constant", "parameter"):  # unprefixed names
        ins.operands = [
            t.strip() for t in inside.split(",") if re.fullmatch(r"[\w.\-]+", t.strip())
        ]
    return ins


def _called(ins: Instr) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for key in ("calls", "to_apply", "condition", "body", "true_computation", "false_computation"):
        m = re.search(key + r"=%?([\w.\-]+)", ins.attrs)
        if m:
            out[key] = [m.group(1)]
    for key in ("branch_computations", "calls"):
        m = re.search(key + r"=\{([^}]*)\}", ins.attrs)
        if m:
            out[key] = re.findall(r"%?([\w.\-]+)", m.group(1))
    return out


def _leaves(ins: Instr, comps, op: str, table: dict[str, Instr], root_only: bool):
    """[(an ``op`` instruction, its operands resolved)] computed by ``ins``: itself, or (the
    CPU compiler fuses a loop's compare and its counter's add) a fusion's root, or with
    ``root_only`` False any such instruction inside it. An operand resolves to ("value", v)
    for an integer constant, ("index", i) for element i of the loop's state, else None;
    ``table`` holds the instructions beside ``ins``."""

    def outer(name: str):
        x = table.get(name)
        if x is None:
            return None
        if x.value is not None and x.op == "constant":
            return ("value", x.value)
        m = re.search(r"index=(\d+)", x.attrs) if x.op == "get-tuple-element" else None
        return ("index", int(m.group(1))) if m else None

    if ins.op == op:
        return [(ins, [outer(o) for o in ins.operands])]
    if ins.op != "fusion":
        return []
    callee = comps.get(_called(ins).get("calls", [""])[0], [])
    inner = {i.name: i for i in callee}

    def resolve(name: str):
        x = inner.get(name)
        if x is None:
            return None
        if x.op == "parameter" and x.value is not None and x.value < len(ins.operands):
            return outer(ins.operands[x.value])
        return ("value", x.value) if x.op == "constant" and x.value is not None else None

    found = [i for i in callee if i.root] if root_only else callee
    return [(i, [resolve(o) for o in i.operands]) for i in found if i.op == op]


def trip_count(comps, ins: Instr) -> tuple[int | None, bool]:
    """(trips, exact) of the while loop ``ins``: XLA's own count when it wrote one
    (``known_trip_count``), else from its condition and body: the constant the condition
    compares the counter with (one more for ``LE``) divided by the counter's step (the TPU
    compiler's windowed einsums step by 2). Exact when known or when the condition makes one
    comparison (a scan's counter < n); otherwise (a loop that also stops on data, the
    sampler's "every row done") the bound, the most it can run."""
    known = re.search(r'"known_trip_count":\{"n":"(\d+)"\}', ins.attrs)
    if known:
        return int(known.group(1)), True
    called = _called(ins)
    cond = comps.get(called["condition"][0], [])
    body = comps.get(called["body"][0], [])
    ctable = {i.name: i for i in cond}
    best, index = None, None
    compares = [c for i in cond for c in _leaves(i, comps, "compare", ctable, root_only=False)]
    for cmp, operands in compares:
        values = [o[1] for o in operands if o and o[0] == "value"]
        indices = [o[1] for o in operands if o and o[0] == "index"]
        if len(values) != 1 or len(indices) != 1:
            continue
        v = values[0] + (1 if "direction=LE" in cmp.attrs else 0)
        if best is None or v > best:
            best, index = v, indices[0]
    step = 1
    if best is not None:
        btable = {i.name: i for i in body}
        root = next((i for i in body if i.root and i.op == "tuple"), None)
        update = btable.get(root.operands[index]) if root and index < len(root.operands) else None
        adds = _leaves(update, comps, "add", btable, root_only=True) if update else []
        if adds:
            steps = [o[1] for o in adds[0][1] if o and o[0] == "value"]
            step = next((v for v in steps if v), 1)
    if best is not None and step > 1:
        best = -(-best // step)
    return best, len(compares) == 1


def _taps(n_in, n_out, win, stride, pad_lo, lhs_dil, rhs_dil) -> int:
    """Kernel taps that land on a real input (not padding, not a dilation hole)."""
    top = (n_in - 1) * lhs_dil
    return sum(
        1
        for o in range(n_out)
        for k in range(win)
        if 0 <= o * stride + k * rhs_dil - pad_lo <= top
        and (o * stride + k * rhs_dil - pad_lo) % lhs_dil == 0
    )


def conv_flops(lhs_dims, out_dims, labels, attrs: str) -> float:
    """2 x the output's batch and features x the input features x the kernel taps that land
    on a real input, as XLA's HloCostAnalysis counts a convolution. The TPU compiler writes
    batched matmuls as convolutions whose windows, padding and ``lhs_dilate`` select one
    input per tap."""
    lhs_l, _, out_l = labels
    spatial = sorted(c for c in lhs_l if c.isdigit())
    w = re.search(r"window=\{([^}]*)\}", attrs)
    fields = dict(re.findall(r"(\w+)=([\w\-]+)", w.group(1))) if w else {}

    def per_dim(key, default):
        v = fields.get(key)
        return [default] * len(spatial) if v is None else v.split("x")

    sizes = [int(x) for x in per_dim("size", 1)]
    strides = [int(x) for x in per_dim("stride", 1)]
    pads = [int(str(p).split("_")[0]) for p in per_dim("pad", "0_0")]
    ldil = [int(x) for x in per_dim("lhs_dilate", 1)]
    rdil = [int(x) for x in per_dim("rhs_dilate", 1)]
    taps = 1
    for i, d in enumerate(spatial):
        n_in, n_out = lhs_dims[lhs_l.index(d)], out_dims[out_l.index(d)]
        taps *= _taps(n_in, n_out, sizes[i], strides[i], pads[i], ldil[i], rdil[i])
    fgc = re.search(r"feature_group_count=(\d+)", attrs)
    in_f = lhs_dims[lhs_l.index("f")] // (int(fgc.group(1)) if fgc else 1)
    return 2.0 * out_dims[out_l.index("b")] * out_dims[out_l.index("f")] * in_f * taps


# The TPU compiler's own kernel for ``jax.lax.ragged_dot`` (a mixture of experts' grouped
# matmul, docs/moe.md): a custom call named for it (or carrying its tiling), its group
# metadata first, then the rows [m, k] and the groups' weights [g, k, n];
# "ragged-dot-metadata" computes no FLOPs.
_RAGGED_DOT = re.compile(r"ragged-dot-(?!metadata)")


def _ragged_dot_flops(ins: Instr, out, table: dict[str, str]) -> float:
    """2 x the output's [m, n] elements x k: each row times its one group's [k, n]."""
    if len(ins.operands) < 2 or len(out[0][1]) != 2:
        return 0.0
    lhs, rhs = (shapes_in(table.get(o, "")) for o in ins.operands[-2:])
    if not lhs or not rhs or len(rhs[0][1]) != 3 or rhs[0][1][-2] != lhs[0][1][-1]:
        return 0.0
    return 2.0 * math.prod(out[0][1]) * lhs[0][1][-1]


def _flops(ins: Instr, table: dict[str, str]) -> float:
    """A ``dot``'s 2 x the output's elements x the contracted size, a convolution's
    :func:`conv_flops`, a grouped matmul's :func:`_ragged_dot_flops`; 0 for anything else."""
    out = shapes_in(ins.shape)
    ragged = _RAGGED_DOT.match(ins.name) or "ragged_dot_tiling=" in ins.attrs
    if out and ins.op == "custom-call" and ragged:
        return _ragged_dot_flops(ins, out, table)
    if not out or ins.op not in ("dot", "convolution") or not ins.operands:
        return 0.0
    lhs = table.get(ins.operands[0])
    if lhs is None or not shapes_in(lhs):
        return 0.0
    lhs_dims = shapes_in(lhs)[0][1]
    if ins.op == "dot":
        m = re.search(r"lhs_contracting_dims=\{([\d,]*)\}", ins.attrs)
        k = math.prod(lhs_dims[int(d)] for d in m.group(1).split(",") if d) if m else 1
        return 2.0 * math.prod(out[0][1]) * k
    m = re.search(r"dim_labels=(\w+)_(\w+)->(\w+)", ins.attrs)
    return conv_flops(lhs_dims, out[0][1], m.groups(), ins.attrs) if m else 0.0


def _collective_bytes(ins: Instr) -> float:
    """What one collective writes: an asynchronous start's tuple holds its operand first."""
    elems = re.findall(r"\b(?:" + "|".join(DTYPE_BYTES) + r")\[[\d,]*\]", ins.shape)
    if ins.op.endswith("-start") and len(elems) >= 2:
        return nbytes(elems[1])
    return nbytes(ins.shape)


@dataclasses.dataclass
class Costs:
    """One whole run of a program, per device."""

    flops: float
    collective_bytes: float
    loops: list[tuple[int | None, bool]]  # (trips, exact) of each while loop
    custom_calls: dict[str, int]

    @property
    def kernels(self) -> int:
        return self.custom_calls.get("tpu_custom_call", 0)


def analyse(hlo: str) -> Costs:
    """The costs of one run of the entry computation: a ``while`` counts its body times
    :func:`trip_count`, a ``conditional`` its largest branch, fusions, calls and asynchronous
    starts their callees. Collective bytes are the outputs of the all-gathers, all-reduces,
    reduce-scatters, all-to-alls and collective permutes, times the trips of the loops around
    them. Pallas kernels (``tpu_custom_call``) have no FLOPs here, but for the TPU
    compiler's grouped matmul (:func:`_ragged_dot_flops`); they are counted by target."""
    comps, entry = parse(hlo)
    memo: dict[tuple[str, bool], tuple[float, float]] = {}
    loops: list[tuple[int | None, bool]] = []
    customs: Counter = Counter()
    seen_customs: set[str] = set()

    def walk(name: str, top: bool) -> tuple[float, float]:
        """(FLOPs, collective bytes) of one run of computation ``name``."""
        if (name, top) in memo:
            return memo[(name, top)]
        instrs = comps.get(name, [])
        table = {i.name: i.shape for i in instrs}
        f = cb = 0.0
        for ins in instrs:
            f += _flops(ins, table)
            called = _called(ins)
            if ins.op == "custom-call" and name not in seen_customs:
                t = re.search(r'custom_call_target="([^"]+)"', ins.attrs)
                customs[t.group(1) if t else "?"] += 1
            if top and ins.op.startswith(COLLECTIVES) and not ins.op.endswith("-done"):
                cb += _collective_bytes(ins)
            if ins.op == "while":
                n, exact = trip_count(comps, ins)
                loops.append((n, exact))
                bf, bc = walk(called["body"][0], True)
                f, cb = f + (n or 1) * bf, cb + (n or 1) * bc
            elif ins.op == "conditional":
                branches = sum((called.get(k, []) for k in ("branch_computations",
                               "true_computation", "false_computation")), [])  # fmt: skip
                if branches:
                    bf, bc = max(walk(c, True) for c in branches)
                    f, cb = f + bf, cb + bc
            elif ins.op == "fusion":
                f += sum(walk(c, False)[0] for c in called.get("calls", []))
            elif ins.op == "call" or ins.op.endswith("-start"):
                for c in called.get("calls", []) + called.get("to_apply", []):
                    ff, fc = walk(c, top)
                    f, cb = f + ff, cb + fc
        seen_customs.add(name)
        memo[(name, top)] = (f, cb)
        return f, cb

    f, cb = walk(entry, True) if entry else (0.0, 0.0)
    return Costs(flops=f, collective_bytes=cb, loops=loops, custom_calls=dict(customs))
