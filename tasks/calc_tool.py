"""Multi-turn with a tool: multi-digit multiplication, which a 135M model cannot do in its head, with a
calculator.

The model may write `<calc>347*29</calc>` (the tags format; generation stops at the closing tag), reads the
result as the next user turn, and ends with its answer; the reply's last number is scored against the product.
`task.format=hermes` uses `<tool_call>{"name": "calc", "arguments": {"expression": ...}}</tool_call>` through
the model's chat template (Qwen2.5-style models, which render the tool schemas and the `tool` role), and
`task.tools=[calc,python]` adds the sandboxed python tool. SmolLM2-135M rarely writes a valid call unprompted,
so the conversation opens with one worked exchange (`task.shots=1`): a call, its result, the answer.
"""
import random
import re
from dataclasses import dataclass, field

from envs.toolenv import ToolEnv
from envs.tools import FORMATS, Toolbox, stop_strings
from registry import require
from rewards.sandbox import Limits
from tasks import Example, Task


@dataclass
class Config:
    name: str = "calc_tool"
    digits: int = 3  # the larger factor has this many digits, the other one fewer
    train_size: int = 2000  # generated training questions
    test_size: int = 20  # generated test questions
    # tags (<calc>...</calc>) | hermes (<tool_call>{json}</tool_call> via the chat template)
    format: str = "tags"
    tools: list[str] = field(default_factory=lambda: ["calc"])  # calc, python (sandboxed)
    # worked exchanges (a call, its result, the answer) before the question, as earlier chat turns:
    # SmolLM2-135M writes a valid call in 0% of first turns without one, 16% after one, 89% after two
    # (bench/tool_calls.py)
    shots: int = 1
    python_timeout_s: float = 3.0  # the python tool's wall clock per call

    def check(self):
        require(2 <= self.digits <= 6, "task.digits", "must be in [2, 6]", self.digits)
        require(self.train_size >= 1 and self.test_size >= 1, "task.train_size",
                "and task.test_size must be >= 1", (self.train_size, self.test_size))
        require(0 <= self.shots <= len(SHOTS), "task.shots", f"must be in [0, {len(SHOTS)}]", self.shots)
        require(self.format in FORMATS, "task.format", f"must be one of {', '.join(FORMATS)}", self.format)
        require(bool(self.tools) and set(self.tools) <= {"calc", "python"}, "task.tools",
                "must name calc and/or python", self.tools)


SHOTS = ((12, 34), (57, 81), (203, 46))


def _question(a: int, b: int, cfg: Config) -> str:
    if cfg.format == "hermes":
        return f"What is {a} * {b}? Use the calc tool, then give the final number."
    return f"What is {a} * {b}? Use the calculator: <calc>expression</calc>. End with just the final number."


def _messages(example: Example, cfg: Config) -> list[dict]:
    """The worked exchanges (tags format), then the question."""
    messages = []
    for a, b in SHOTS[:cfg.shots] if cfg.format == "tags" else ():
        messages += [{"role": "user", "content": _question(a, b, cfg)},
                     {"role": "assistant", "content": f"<calc>{a}*{b}</calc>"},
                     {"role": "user", "content": str(a * b)}, {"role": "assistant", "content": str(a * b)}]
    return messages + [{"role": "user", "content": example.question}]


def score(reply: str, answer: str) -> float:
    numbers = re.findall(r"-?\d[\d,]*", reply)
    return float(bool(numbers) and numbers[-1].replace(",", "") == answer)


def build(cfg: Config, seed: int) -> Task:
    rng = random.Random(seed)
    high = 10 ** cfg.digits

    def example() -> Example:
        a, b = rng.randrange(high // 10, high), rng.randrange(10, high // 10)
        return Example(_question(a, b, cfg), str(a * b))

    test = [example() for _ in range(cfg.test_size)]
    train = [example() for _ in range(cfg.train_size)]
    limits = Limits(timeout_s=cfg.python_timeout_s, memory_mb=512, processes=8, file_mb=4, output_kb=64)
    toolbox = Toolbox(tuple(cfg.tools), python_limits=limits if "python" in cfg.tools else None)
    hermes = cfg.format == "hermes"
    return Task(reward="", train=train, test=test,
                env=lambda: ToolEnv(toolbox, cfg.format, score, lambda ex: _messages(ex, cfg)),
                stop_strings=stop_strings(cfg.format), observation_role="tool" if hermes else "user",
                tools=toolbox.schemas() if hermes else None)
