"""Compile one program and read what XLA says of it: memory per chip, FLOPs and collective
bytes of one whole run (loops times their trips), Pallas kernels, compile time.

A program's total is what XLA's ``memory_analysis()`` says one device holds while it runs:
arguments + outputs - the outputs written into donated arguments + temporaries + code.
"""

from __future__ import annotations

import dataclasses
import re
import time

from grpo_jax.aot import hlo_costs

GiB = 2**30


@dataclasses.dataclass
class Measured:
    """One compiled program, per chip (bytes, FLOPs, seconds); ``error``: the compiler's
    refusal, one line."""

    program: str
    compile_s: float
    arguments: int = 0
    outputs: int = 0
    aliased: int = 0
    temporaries: int = 0
    code: int = 0
    flops: float = 0.0
    xla_flops_once: float = 0.0
    collective_bytes: float = 0.0
    loops: list = dataclasses.field(default_factory=list)
    kernels: int = 0
    error: str = ""

    @property
    def total(self) -> int:
        return self.arguments + self.outputs - self.aliased + self.temporaries + self.code


def one_line(e: BaseException) -> str:
    """The compiler's message as one line: XLA's own sentence when it has one."""
    text = str(e)
    m = re.search(r"(RESOURCE_EXHAUSTED: [^\n]*)", text)
    if m:
        return m.group(1).strip()
    lines = [x.strip() for x in text.splitlines() if x.strip()]
    return f"{type(e).__name__}: {lines[0] if lines else ''}"


def compile_program(program) -> tuple[Measured, object | None]:
    """(what XLA says of ``program`` compiled, the executable or None when it failed)."""
    t0 = time.perf_counter()
    try:
        compiled = program.lower().compile()
    except Exception as e:  # noqa: BLE001 - the compiler's refusal is a result here
        return Measured(program.name, time.perf_counter() - t0, error=one_line(e)), None
    seconds = time.perf_counter() - t0
    m = compiled.memory_analysis()
    cost = compiled.cost_analysis() or {}
    if isinstance(cost, list):
        cost = cost[0] if cost else {}
    walked = hlo_costs.analyse(compiled.as_text())
    return Measured(
        program=program.name,
        compile_s=seconds,
        arguments=m.argument_size_in_bytes,
        outputs=m.output_size_in_bytes,
        aliased=m.alias_size_in_bytes,
        temporaries=m.temp_size_in_bytes,
        code=m.generated_code_size_in_bytes,
        flops=walked.flops,
        xla_flops_once=float(cost.get("flops", 0.0)),
        collective_bytes=walked.collective_bytes,
        loops=walked.loops,
        kernels=walked.kernels,
    ), compiled
