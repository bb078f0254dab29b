"""Tools a model can call during a multi-turn rollout, and the sandbox that runs code.

    from grpo_jax import tools
    r = tools.run_python("print(sum(range(10)))", timeout_s=5, memory_mb=256)
    r.stdout, r.exit_code, r.timed_out            # '45\\n', 0, False
    tools.calculate("17*23")                       # '391'
    tools.format_results(tools.run_tool_calls(tools.parse_tool_calls("<calculator>17*23</calculator>")))

docs/multiturn.md has the tool-call format, the sandbox's limits and what enforces each.
"""

from grpo_jax.tools.calculator import CalculatorError, calculate
from grpo_jax.tools.registry import (
    Tool,
    ToolCall,
    available_tools,
    format_results,
    get_tool,
    parse_tool_calls,
    register_tool,
    result_text,
    run_tool_calls,
)
from grpo_jax.tools.sandbox import (
    SANDBOXES,
    SandboxUnavailable,
    ToolResult,
    network_isolation,
    run_python,
    sandbox_mode,
)

__all__ = [
    "SANDBOXES",
    "CalculatorError",
    "SandboxUnavailable",
    "Tool",
    "ToolCall",
    "ToolResult",
    "available_tools",
    "calculate",
    "format_results",
    "get_tool",
    "network_isolation",
    "parse_tool_calls",
    "register_tool",
    "result_text",
    "run_python",
    "run_tool_calls",
    "sandbox_mode",
]
