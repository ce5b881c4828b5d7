"""Tasks: a train and a test split of `Example`s, a prompt format and the name of their reward."""
import importlib
from dataclasses import dataclass, field


@dataclass(frozen=True)
class Example:
    question: str  # the user's message
    answer: str  # the reference the reward compares against


@dataclass
class Task:
    reward: str  # name for rewards.get_reward
    train: list[Example]
    test: list[Example]
    reward_options: dict = field(default_factory=dict)  # keyword arguments of a reward built per process


_TASKS = {name: f"tasks.{name}" for name in ("arithmetic", "code", "gsm8k", "math", "preference", "redteam")}


def names() -> list[str]:
    return sorted(_TASKS)


def get(name: str):
    """The module of task `name` (it has `Config` and `build(cfg, seed) -> Task`)."""
    if name not in _TASKS:
        raise ValueError(f"unknown task '{name}' (choose one of: {', '.join(sorted(_TASKS))})")
    return importlib.import_module(_TASKS[name])


def prompt_ids(tokenizer, question: str) -> list[int]:
    """The question as a chat turn, ready for the assistant's reply."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True)
    return tokenizer(text, add_special_tokens=False)["input_ids"]
