"""An environment whose turns are tool calls until a final answer: the shape of calc_tool and of any task that
lends the model a calculator or a python sandbox.

    env = ToolEnv(Toolbox(("calc",)), "tags", score=lambda reply, answer: float(...), prompt=...)

A turn with a call gets the tool's answer (or its one-line error) as the next observation; a turn with
several (Hermes) gets one observation holding each call's answer in order, a line each; a turn without one is
the final answer, scored by `score(reply, answer)`. A malformed call (an unclosed tag, JSON that does not
parse) is answered with its error and counted, never taken for a final answer: the episode goes on.
"""
from typing import Callable

from envs import Step
from envs.tools import Call, Toolbox, ToolError, parse_calls

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
            calls = parse_calls(action, self.fmt)
        except ToolError as error:
            return Step(f"error: {error}", info={COUNT[error.kind]: 1})
        if not calls:
            reward = self.score(action, self.answer)
            return Step(None, reward, done=True, info={"success": reward >= 1.0})
        answers, counts = [], {}
        for call in calls:
            answers.append(self._answer(call, counts))
        return Step("\n".join(answers), info=counts)

    def _answer(self, call: Call, counts: dict) -> str:
        """One call's answer, its counts added to `counts`."""
        try:
            text, kinds = self._result(self.toolbox.call(call)), ("tool_calls",)
        except ToolError as error:
            text, kinds = f"error: {error}", (COUNT[error.kind],)
            if error.kind in ("error", "timeout"):
                kinds += ("tool_calls",)  # a well-formed call to a real tool, which failed
        for kind in kinds:
            counts[kind] = counts.get(kind, 0) + 1
        return text

    def _result(self, text: str) -> str:
        return text if text.strip() else "(no output)"

    def close(self) -> None:
        pass
