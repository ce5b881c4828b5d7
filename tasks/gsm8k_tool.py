"""GSM8K with the python tool: the model may run code in the sandbox before its final `#### <number>`.

For the models researchers train on GPUs (Qwen2.5-style chat templates): `task.format=hermes` (the default)
puts the tool's schema in the prompt and reads
`<tool_call>{"name": "python", "arguments": {"code": ...}}</tool_call>`, answered as a `tool` turn;
`task.format=tags` reads `<python>...</python>` instead. The data and the final answer's scoring are
task=gsm8k's (`task.path`, the "gsm8k" reward). Runnable on the CPU; not expected to learn there with the
embedded 135M model.
"""
from dataclasses import dataclass

from envs.toolenv import ToolEnv
from envs.tools import FORMATS, Toolbox, stop_strings
from registry import require
from rewards.gsm8k import gsm8k_reward
from rewards.sandbox import Limits
from tasks import Task, gsm8k

TOOL_HINT = {"hermes": "You may run Python with the python tool; print what you need.",
             "tags": "You may run Python by writing <python>code</python>; you will see what it prints."}


@dataclass
class Config(gsm8k.Config):
    name: str = "gsm8k_tool"
    # hermes (<tool_call>{json}</tool_call> via the chat template) | tags (<python>...</python>)
    format: str = "hermes"
    python_timeout_s: float = 5.0  # the python tool's wall clock per call
    python_memory_mb: int = 1024  # its address space

    def check(self):
        super().check()
        require(self.format in FORMATS, "task.format", f"must be one of {', '.join(FORMATS)}", self.format)
        require(self.python_timeout_s > 0, "task.python_timeout_s", "must be > 0", self.python_timeout_s)


def build(cfg: Config, seed: int) -> Task:
    data = gsm8k.build(cfg, seed)
    limits = Limits(timeout_s=cfg.python_timeout_s, memory_mb=cfg.python_memory_mb, processes=8, file_mb=16,
                    output_kb=64)
    toolbox = Toolbox(("python",), python_limits=limits)
    hermes = cfg.format == "hermes"

    def prompt(example) -> list[dict]:
        return [{"role": "user", "content": f"{example.question}\n{TOOL_HINT[cfg.format]}"}]

    return Task(reward="", train=data.train, test=data.test,
                env=lambda: ToolEnv(toolbox, cfg.format, gsm8k_reward, prompt),
                stop_strings=stop_strings(cfg.format), observation_role="tool" if hermes else "user",
                tools=toolbox.schemas() if hermes else None)
