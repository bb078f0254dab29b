"""Tools by name, and the tool-call format a model's turn uses.

A tool is ``fn(arguments: dict) -> ToolResult``; ``calculator`` and ``python`` are built in,
:func:`register_tool` adds more. :func:`parse_tool_calls` finds a turn's calls in order
(``<tool_call>{"name": ..., "arguments": ...}</tool_call>``, or the short
``<calculator>17*23</calculator>``), :func:`run_tool_calls` runs them and
:func:`format_results` writes the results back as ``<tool_result>`` blocks
(docs/multiturn.md, "Tools").
"""

from __future__ import annotations

import dataclasses
import json
import re
from collections.abc import Callable

from grpo_jax.tools.calculator import CalculatorError, calculate
from grpo_jax.tools.sandbox import ToolResult, run_python

ToolFn = Callable[[dict], ToolResult]


@dataclasses.dataclass(frozen=True)
class Tool:
    name: str
    fn: ToolFn
    argument: str  # the argument the short tag form fills
    description: str = ""
    runs_code: bool = False  # fn(arguments, sandbox=...): run_python's sandbox


_TOOLS: dict[str, Tool] = {}
_NAME = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def register_tool(
    name: str, fn: ToolFn, *, argument: str = "input", description: str = "", runs_code=False
):
    """Registers ``fn`` as tool ``name``; ``argument`` is what the short tag form fills;
    ``runs_code``: ``fn`` also takes ``sandbox=`` (see the module docstring)."""
    if not isinstance(name, str) or not _NAME.match(name) or name in ("tool_call", "tool_result"):
        raise ValueError(f"tool name {name!r} must be an identifier (not tool_call/tool_result)")
    if name in _TOOLS:
        raise ValueError(f"tool {name!r} is already registered")
    _TOOLS[name] = Tool(name, fn, argument, description, bool(runs_code))
    return fn


def get_tool(name: str) -> Tool:
    try:
        return _TOOLS[name]
    except KeyError:
        raise KeyError(f"unknown tool {name!r}; registered tools: {sorted(_TOOLS)}") from None


def available_tools() -> list[str]:
    return sorted(_TOOLS)


def _calculator(args: dict) -> ToolResult:
    try:
        return ToolResult(calculate(str(args.get("expression", ""))), "", 0, False)
    except CalculatorError as e:
        return ToolResult("", f"error: {e}", 1, False)


PYTHON_TIMEOUT_S, PYTHON_MEMORY_MB = 5.0, 256


def _python(args: dict, sandbox: str | None = None) -> ToolResult:
    # The model may ask for less time or memory, never more: the limits are the trainer's.
    try:
        timeout_s = min(float(args.get("timeout_s", PYTHON_TIMEOUT_S)), PYTHON_TIMEOUT_S)
        memory_mb = min(int(args.get("memory_mb", PYTHON_MEMORY_MB)), PYTHON_MEMORY_MB)
    except (TypeError, ValueError, OverflowError):
        return ToolResult("", "error: timeout_s and memory_mb must be numbers", 1, False)
    if not timeout_s > 0 or memory_mb < 16:
        return ToolResult("", "error: timeout_s must be > 0 and memory_mb >= 16", 1, False)
    return run_python(
        str(args.get("code", "")), timeout_s=timeout_s, memory_mb=memory_mb, sandbox=sandbox
    )


register_tool(
    "calculator", _calculator, argument="expression", description="exact arithmetic: + - * / ** ()"
)
register_tool(
    "python", _python, argument="code", description="runs Python code in a sandbox", runs_code=True
)


@dataclasses.dataclass(frozen=True)
class ToolCall:
    name: str
    arguments: dict
    error: str | None = None  # a call that could not be parsed or names no tool


_JSON_CALL = re.compile(r"<tool_call>(.*?)</tool_call>", re.S)
_TAG_CALL = re.compile(r"<([A-Za-z_][A-Za-z0-9_]*)>(.*?)</\1>", re.S)


def parse_tool_calls(text: str, tools: list[str] | None = None) -> list[ToolCall]:
    """The tool calls in ``text``, in order of appearance (see the module docstring).

    ``tools`` limits the short tag form to those names (default: every registered
    tool); other tags are ordinary text. A malformed JSON call is returned with
    ``error`` set, so the model is told what went wrong.
    """
    names = set(available_tools() if tools is None else tools)
    found: list[tuple[int, ToolCall]] = []
    for m in _JSON_CALL.finditer(text):
        try:
            obj = json.loads(m.group(1))
            name, args = obj["name"], obj.get("arguments", {})
            if isinstance(args, str):
                args = json.loads(args)
            if not isinstance(name, str) or not isinstance(args, dict):
                raise TypeError("name must be text and arguments an object")
            call = ToolCall(name, args)
            if name not in names:
                call = ToolCall(name, args, f"unknown tool {name!r}; tools: {sorted(names)}")
        except (ValueError, KeyError, TypeError) as e:
            call = ToolCall("", {}, f"malformed tool call: {e}")
        found.append((m.start(), call))
    for m in _TAG_CALL.finditer(text):
        name = m.group(1)
        if name in names and not any(s <= m.start() < e for s, e in _spans(text)):
            found.append((m.start(), ToolCall(name, {get_tool(name).argument: m.group(2)})))
    return [c for _, c in sorted(found, key=lambda x: x[0])]


def _spans(text: str):
    return [(m.start(), m.end()) for m in _JSON_CALL.finditer(text)]


def run_tool_calls(
    calls: list[ToolCall], *, sandbox: str | None = None
) -> list[tuple[str, ToolResult]]:
    """Runs each call; a tool that raises gives an error result, never an exception.

    ``sandbox``: the sandbox of the tools that run code (``run_python``'s; None: its
    default).
    """
    out = []
    for call in calls:
        if call.error is not None:
            out.append((call.name, ToolResult("", call.error, 1, False)))
            continue
        try:
            tool = get_tool(call.name)
            if tool.runs_code:
                result = tool.fn(call.arguments, sandbox=sandbox)
            else:
                result = tool.fn(call.arguments)
        except Exception as e:  # a tool's failure is the model's observation
            result = ToolResult("", f"error: {type(e).__name__}: {e}", 1, False)
        out.append((call.name, result))
    return out


def result_text(result: ToolResult) -> str:
    """What the model reads of a result: stdout, then stderr when the run failed."""
    text = result.stdout.rstrip("\n")
    if not result.ok:
        text = (text + ("\n" if text else "") + result.stderr).strip("\n")
    return text


def format_results(results: list[tuple[str, ToolResult]]) -> str:
    return "".join(
        f'<tool_result name="{name}">{result_text(r)}</tool_result>' for name, r in results
    )
