"""Tasks: a train and a test split of `Example`s, a prompt format and the name of their reward."""
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable

from envs.render import prompt_ids  # noqa: F401 (tasks.prompt_ids: how every process renders a question)
from registry import Registry

if TYPE_CHECKING:
    from envs import Env


@dataclass(frozen=True)
class Example:
    question: str  # the user's message
    answer: str  # the reference the reward compares against


@dataclass
class Task:
    reward: str  # name for rewards.get_reward ("" for a multi-turn task: its environment gives the rewards)
    train: list[Example]
    test: list[Example]
    reward_options: dict = field(default_factory=dict)  # keyword arguments of a reward built per process
    # Multi-turn (envs/): a new environment per episode, built in the rollout process (None: one-shot replies)
    env: Callable[[], "Env"] | None = None
    # text that ends a turn besides the stop tokens (a tool call's closing tag)
    stop_strings: tuple[str, ...] = ()
    # the role the environment's turns are rendered with (Hermes tools: "tool")
    observation_role: str = "user"
    tools: list[dict] | None = None  # tool schemas handed to the chat template (the Hermes/Qwen call format)
    # Agent code (envs/agent.py): workflow(client, example) -> reward, driving its episode through the rollout
    # worker's OpenAI-compatible endpoint with the `openai` client it is given (None: the worker drives
    # episodes)
    agent: Callable | None = None

    @property
    def multi_turn(self) -> bool:
        """Episodes rather than one reply: an environment's, or agent code's."""
        return self.env is not None or self.agent is not None

    def messages(self, example: Example) -> list[dict]:
        """The first messages of an episode of `example`: the environment's, or the question as a user
        turn."""
        if self.env is None:
            return [{"role": "user", "content": example.question}]
        env = self.env()
        try:
            return env.reset(example)
        finally:
            env.close()


TASKS = Registry("task", __name__, os.path.dirname(__file__))  # tasks/<name>.py: Config and build(cfg, seed)


def names() -> list[str]:
    return TASKS.names()


def get(name: str):
    """The module of task `name` (it has `Config` and `build(cfg, seed) -> Task`)."""
    return TASKS.get(name)


def load_tokenizer(model_path: str, chat_template: dict | None = None):
    """The model's tokenizer, carrying `model.chat_template` (options of its chat template, such as Qwen3's
    enable_thinking) for `prompt_ids`. Every process loads it here, so the rollouts' prompts, the evaluation's
    and the ring's width agree; the trainer scores the prompt tokens the ring carries."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_path)
    tokenizer.ringrl_chat_template = dict(chat_template or {})
    return tokenizer


def first_prompts(tokenizer, task: Task, examples: list[Example]) -> list[list[int]]:
    """The first prompt of an episode of each example (a one-shot task's: `prompt_ids` of its question)."""
    if task.env is None:  # an agent's prompt is its workflow's first request: the question alone, as a guess
        return [prompt_ids(tokenizer, example.question) for example in examples]
    from envs.render import Renderer

    renderer = Renderer(tokenizer, task.observation_role, task.tools)
    return [renderer.prompt(task.messages(example)) for example in examples]
