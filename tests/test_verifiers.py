"""`verifiers` environments as a task (tasks/verifiers.py): the example environment written with verifiers'
own classes (agents/verifiers_arith.py) builds into train and test rows; each episode is a verifiers rollout
through the rollout worker's endpoint, its reward the rubric's, its record exactly the sampled tokens; what
cannot load says so in one line. Needs verifiers (requirements-agents.txt, installed by setup.sh)."""
import importlib.util
import json
import os
import sys

import pytest
from transformers import AutoTokenizer

from envs.render import Renderer
from rollout import to_group
from tests.test_agent import agent_episodes, run_episodes
from tests.test_episodes import ScriptEngine

pytestmark = pytest.mark.skipif(importlib.util.find_spec("verifiers") is None,
                                reason="verifiers is not installed: pip install -r requirements-agents.txt")


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return AutoTokenizer.from_pretrained(tokenizer_dir)


@pytest.fixture(scope="module")
def task():
    from tasks.verifiers import Config, build

    return build(Config(), seed=0)


def test_the_example_environment_builds_into_train_and_test_rows(task):
    """The taskset's tasks are the examples, each carrying its task; the splits are the taskset loaded with
    split=train and split=test (task.train_split, task.test_split): the 100 sums, 80 and 20, disjoint."""
    assert (len(task.train), len(task.test), task.reward) == (80, 20, "")
    for row in task.train[:3] + task.test[:3]:
        assert row.question == row.task.data.prompt and row.question.startswith("What is ")
        a, b = (int(n) for n in row.question[len("What is "):row.question.index("?")].split(" + "))
        assert row.answer == row.task.data.answer == str(a + b)
    assert not {r.question for r in task.train} & {r.question for r in task.test}
    assert task.agent is not None and task.multi_turn
    from tasks.verifiers import Config, build

    same = build(Config(test_split=""), seed=0)  # a taskset without splits: evaluated on its training tasks
    assert same.test == same.train == task.train


def test_the_rubric_s_reward_is_the_episode_s_and_only_sampled_tokens_train(task, tokenizer):
    """Four rollouts of one row through the endpoint: a right reply scores 1, a wrong one 0 (the task's
    @vf.reward); the record is the harness's request rendered as the prompt and the reply as sampled, mask 1
    on it alone."""
    row = task.train[0]
    replies = {0: f"It is {row.answer}.", 1: "It is 99.", 2: row.answer, 3: "I do not know."}
    engine = ScriptEngine(tokenizer, lambda key, turn: (replies[key], True))
    counts = {}
    ended = run_episodes(agent_episodes(tokenizer, engine, task.agent, counts), engine, n=4, example=row)
    assert [(e.finish, e.reward, e.turns) for e in ended] == [("done", 1.0, 1), ("done", 0.0, 1),
                                                              ("done", 1.0, 1), ("done", 0.0, 1)]
    prompt = Renderer(tokenizer, "user").prompt([{"role": "user", "content": row.question}])
    for episode in ended:
        sampled = tokenizer(replies[episode.key], add_special_tokens=False)["input_ids"] + [2]
        assert episode.prompt_ids == prompt
        assert episode.token_ids == sampled and all(episode.mask) and not episode.masked
    group = to_group(ended, [e.reward for e in ended], 0, 0, 0)
    for i, episode in enumerate(ended):
        assert group.loss_mask[i].sum().item() == len(episode.mask)
        assert group.completion_ids[i, :len(episode.token_ids)].tolist() == episode.token_ids
    assert counts["agent_calls"] == 4 and "env_errors" not in counts
    assert not [name for name in os.environ if name.startswith("RINGRL_VERIFIERS_KEY_")]


def test_a_rollout_verifiers_reports_as_failed_ends_as_a_masked_env_error(task, tokenizer, monkeypatch,
                                                                          capsys):
    """The harness raises after its request was served: verifiers records the error on the trace and skips
    scoring; the episode ends env_error, kept out of the loss (env.mask), its cause printed once."""
    import agents.verifiers_arith as example

    served = example.AskOnce.launch

    async def launch_then_break(self, *args, **kwargs):
        await served(self, *args, **kwargs)
        raise RuntimeError("the harness broke")

    monkeypatch.setattr(example.AskOnce, "launch", launch_then_break)
    engine = ScriptEngine(tokenizer, lambda key, turn: ("12", True))
    counts = {}
    episodes = agent_episodes(tokenizer, engine, task.agent, counts)
    episode, = run_episodes(episodes, engine, example=task.train[0])
    assert (episode.finish, episode.masked, episode.turns) == ("env_error", True, 1)
    assert counts["env_errors"] == 1
    assert "the harness broke" in capsys.readouterr().out
    assert not to_group([episode], [0.0], 0, 0, 0).loss_mask.any()


@pytest.mark.parametrize("changes, message", [
    ({"env": "agents.arith_retry"}, r"^task.env=agents.arith_retry: taskset module .* defines no `__all__`"),
    ({"env": "agents.nope"}, r"^task.env=agents.nope: No module named 'agents.nope'; name an importable"),
    ({"args": {"nope": 1}}, r"^task.env=agents.verifiers_arith: taskset.nope: Extra inputs are not "),
    ({"args": {"test_size": 0}}, r"^task.env=agents.verifiers_arith: its taskset has no tasks for the test "),
    ({"limit": 0, "args": {"max_operand": 1, "test_size": 4}}, r"has no tasks for the train split"),
])
def test_what_cannot_load_says_so_in_one_line(changes, message):
    from tasks.verifiers import Config, build

    with pytest.raises(ValueError, match=message) as error:
        build(Config(**changes), seed=0)
    assert "\n" not in str(error.value)


def test_without_verifiers_the_task_names_its_requirements_file(monkeypatch):
    from tasks.verifiers import Config, build

    monkeypatch.setitem(sys.modules, "verifiers", None)
    monkeypatch.delitem(sys.modules, "verifiers.v1", raising=False)
    with pytest.raises(ValueError, match=r"^task=verifiers needs the verifiers package .*: pip install -r "
                                         r"requirements-agents.txt$"):
        build(Config(), seed=0)


def test_every_agent_runs_locally_on_the_harness_asked_for():
    """The endpoint listens on loopback, so every seat runs on verifiers' subprocess runtime (its default is a
    remote sandbox); task.harness pins every seat's harness, else the taskset's own."""
    import verifiers.v1 as vf

    from tasks.verifiers import Config, _env_config

    own = _env_config(vf, Config(), "")
    assert own.agent.runtime.type == "subprocess" and own.agent.harness is None
    assert own.agent_harnesses()["agent"].id == own.taskset.id  # the module's AskOnce
    pinned = _env_config(vf, Config(harness="null"), "test")
    assert pinned.agent.harness.id == "null" and pinned.taskset.split == "test"


def test_train_py_trains_a_verifiers_environment_end_to_end(tiny_model_dir, tmp_path):
    """task=verifiers: the example environment's rollouts drive every episode through each rollout worker's
    endpoint, the test split evaluated through the evaluation's own; nothing fails."""
    from tests.helpers import TINY, run_train

    result = run_train(tmp_path, f"model.path={tiny_model_dir}", "task=verifiers", "steps=3",
                       "max_staleness=1", "eval.k=1", "eval.max_examples=4", "checkpoint.at_end=false", *TINY)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert row["episode/finish_done"] == 1.0 and row["episode/env_errors"] == 0
        assert row["episode/turns_mean"] == 1.0 and row["episode/policy_tokens"] > 0
    assert rows[-1]["episode/agent_calls"] > 0 and rows[-1]["eval_examples"] == 4
