"""What a compiled program's HLO text says of its collectives."""

import re

_ALL_REDUCE = re.compile(r"= \(?([^=]*?)\)? all-reduce(?:-start)?\(")
_ARRAY = re.compile(r"\w+\[(\d+)[\d,]*\]")


def reduced_activations(hlo_text: str, rows: int, positions) -> list[str]:
    """The all-reduces in ``hlo_text`` of an activation: an array whose leading dimension is
    the batch's ``rows`` or rows times one of ``positions`` (tokens flattened with rows).
    With rows split over the batch axes none is reduced: each device holds its own rows (a
    step reduces its gradients and the metrics' scalars only)."""
    leading = {rows} | {rows * p for p in positions}
    return [
        s for s in _ALL_REDUCE.findall(hlo_text)
        if any(int(d) in leading for d in _ARRAY.findall(s))
    ]  # fmt: skip
