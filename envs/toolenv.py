"""An environment whose turns are tool calls until a final answer: the shape of calc_tool and of any task that
lends the model a calculator or a python sandbox.

    env = ToolEnv(Toolbox(("calc",)), "tags", score=lambda reply, answer: float(...), prompt=...)

A turn with a call gets the tool's answer (or its one-line error) as the next observation; a turn without one
is the final answer, scored by `score(reply, answer)`. A malformed call (an unclosed tag, JSON that does not
parse) is answered with its error and counted, never taken for a final answer: the episode goes on.
"""
from typing import Callable

from envs import Step
from envs.tools import Toolbox, ToolError, parse_call

COUNT = {"parse": "parse_errors", "unknown": "unknown_tools", "error": "tool_errors",
         "timeout": "tool_timeouts"}


class ToolEnv:
    def __init__(self, toolbox: Toolbox, fmt: str, score: Callable[[str, str], float],
                 prompt: Callable[[object], list[dict]]):
        """`prompt(example)`: the first messages; `score(final_reply, example.answer)`: the episode's
        reward."""
        self.toolbox, self.fmt, self.score, self.prompt = toolbox, fmt, score, prompt
        self.answer = ""

    def reset(self, example) -> list[dict]:
        self.answer = example.answer
        return self.prompt(example)

    def step(self, action: str) -> Step:
        try:
            call = parse_call(action, self.fmt)
        except ToolError as error:
            return Step(f"error: {error}", info={COUNT[error.kind]: 1})
        if call is None:
            reward = self.score(action, self.answer)
            return Step(None, reward, done=True, info={"success": reward >= 1.0})
        try:
            return Step(self._result(self.toolbox.call(call)), info={"tool_calls": 1})
        except ToolError as error:
            counts = {COUNT[error.kind]: 1}
            if error.kind in ("error", "timeout"):
                counts["tool_calls"] = 1  # a well-formed call to a real tool, which failed
            return Step(f"error: {error}", info=counts)

    def _result(self, text: str) -> str:
        return text if text.strip() else "(no output)"

    def close(self) -> None:
        pass
