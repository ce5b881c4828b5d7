"""Agent code as a task: a workflow written against the `openai` client drives each episode through the
rollout worker's OpenAI-compatible endpoint, and the run trains on exactly what the endpoint served
(envs/agent.py).

    python train.py task=agent task.workflow=agents.arith_retry:run task.examples=arithmetic

`task.workflow` names `module:function`, `function(client, example) -> reward` (a coroutine function gets an
`openai.AsyncOpenAI`); `example` has `.question` and `.answer`, taken from the task `task.examples` names (its
train and test splits, its default settings). The reward is what the workflow returns, or, with `task.reward`
set, a verifier's score of the episode's last reply. agents/ holds worked examples.
"""
import importlib
from dataclasses import dataclass

import tasks
from registry import require
from tasks import Task


@dataclass
class Config:
    name: str = "agent"
    workflow: str = "agents.arith_retry:run"  # module:function, function(client, example) -> reward
    examples: str = "arithmetic"  # the task whose train and test examples the workflow is given
    # "": the workflow's return value is the reward; else a verifier (as task.reward) scores the last reply
    reward: str = ""

    def check(self):
        module, _, function = self.workflow.partition(":")
        require(bool(module and function), "task.workflow",
                "must be module:function (e.g. agents.arith_retry:run)", self.workflow)
        require(self.examples in tasks.names() and self.examples != self.name, "task.examples",
                f"must be another task: one of {', '.join(n for n in tasks.names() if n != self.name)}",
                self.examples)


def workflow(name: str):
    """The function `module:function` names; a one-line ValueError when it cannot be imported."""
    module, _, function = name.partition(":")
    try:
        found = getattr(importlib.import_module(module), function)
    except (ImportError, AttributeError) as error:
        raise ValueError(f"task.workflow={name}: {error}; name an importable module:function") from None
    if not callable(found):
        raise ValueError(f"task.workflow={name} is not a function")
    return found


def build(cfg: Config, seed: int) -> Task:
    source = tasks.get(cfg.examples)
    data = source.build(source.Config(), seed)
    return Task(reward=cfg.reward, train=data.train, test=data.test, agent=workflow(cfg.workflow))
