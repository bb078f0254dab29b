"""``tool_use``: the model may call tools for several turns, then answers; the answer is scored.

    env.name = "tool_use(reward='exact_match', tools=('calculator',), max_turns=3)"

A turn with tool calls gets their results as the next observation; a turn without is the
final answer, scored by the reward ``reward`` against the example's fields; running out of
``max_turns`` while still calling tools scores 0 (docs/multiturn.md, "Writing an
environment").
"""

from __future__ import annotations

import math

from grpo_jax import rewards
from grpo_jax import tools as tools_lib
from grpo_jax.envs.base import register


@register("tool_use")
class ToolUse:
    def __init__(
        self,
        reward: str = "exact_match",
        tools: tuple | list | None = None,
        max_turns: int = 4,
        chat: bool = False,
        sandbox: str | None = None,
    ):
        self.reward_fn = rewards.get(reward)
        self.tools = list(tools) if tools is not None else tools_lib.available_tools()
        # Unknown names fail now, and so does a sandbox that cannot run code here.
        if any(tools_lib.get_tool(name).runs_code for name in self.tools):
            sandbox = tools_lib.sandbox_mode(sandbox)
        self.max_turns, self.chat, self.sandbox = int(max_turns), bool(chat), sandbox
        self.example, self.turn = None, 0

    def reset(self, example):
        self.example, self.turn = dict(example), 0
        return None  # the example's usual prompt

    def step(self, text: str):
        self.turn += 1
        calls = tools_lib.parse_tool_calls(text, tools=self.tools)
        if not calls:
            fields = rewards.fields_from_examples([self.example], 1, exclude=("prompt",))
            value = float(self.reward_fn([""], [text], **fields)[0])
            if math.isnan(value):
                raise ValueError("the reward could not score the answer")
            return None, value, True, {"success": value >= 1.0 - 1e-6, "turns": self.turn}
        if self.turn >= self.max_turns:
            return None, 0.0, True, {"success": False, "turns": self.turn}
        results = tools_lib.run_tool_calls(calls, sandbox=self.sandbox)
        if self.chat:
            obs = [
                {"role": "tool", "name": name, "content": tools_lib.result_text(r)}
                for name, r in results
            ]
        else:
            obs = tools_lib.format_results(results)
        return obs, 0.0, False, {"tool_calls": len(calls)}
