"""docs/design.md's checkable statements, checked against the code (the import layers are tests/test_layering.py):
each fails if the code stops doing what the design says."""
import ast
import dataclasses
import inspect
import os

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRODUCT = ("algos", "buffer", "engines", "evaluate.py", "launch", "models", "registry.py", "rewards", "rollout.py",
           "tasks", "train.py", "trainer", "plot.py", "scripts", "heap.py")


def _files() -> list[str]:
    out = []
    for entry in PRODUCT:
        path = os.path.join(ROOT, entry)
        if path.endswith(".py"):
            out.append(path)
        else:
            out += [os.path.join(d, f) for d, _, fs in os.walk(path) for f in fs if f.endswith(".py")]
    return sorted(out)


def _tree(path: str) -> ast.Module:
    return ast.parse(open(path).read(), path)


def test_only_the_launcher_and_the_process_entries_take_the_whole_config():
    """"One typed argument object per process": the typed config whole reaches train.py, launch/ and the two
    process entries (their Args); every other module takes sections or values."""
    allowed = {"train.py", "rollout.py", "trainer/loop.py"}
    found = set()
    for path in _files():
        rel = os.path.relpath(path, ROOT)
        for node in ast.walk(_tree(path)):
            if isinstance(node, ast.ImportFrom) and node.module in ("runtime.schema", "launch.config") and \
                    any(alias.name == "Config" for alias in node.names):
                found.add(rel)
    outside = {f for f in found if f not in allowed and not f.startswith("launch/")}
    assert outside == set(), f"these take the whole config: {sorted(outside)}"
    assert {"rollout.py", "trainer/loop.py"} <= found  # and the process entries do (the check can fail)


def test_each_process_entry_takes_one_argument_object():
    import rollout
    from trainer import loop

    for entry, args in ((rollout.run, rollout.RolloutArgs), (loop.run, loop.TrainerArgs)):
        (param,) = inspect.signature(entry).parameters.values()
        assert param.annotation in (args, args.__name__)
        assert dataclasses.is_dataclass(args) and args.__dataclass_params__.frozen  # picklable values, passed whole
        assert any(f.name == "cfg" for f in dataclasses.fields(args))


SCHEMA = ("Config", "ClusterConfig", "TrainConfig", "RolloutConfig", "BufferConfig", "EvalConfig")
RECORDS = ("MicroBatch", "Group", "Batch", "Episode")


def _parameters(node: ast.FunctionDef) -> int:
    a = node.args
    names = [x.arg for x in a.posonlyargs + a.args]
    n = len(names) + len(a.kwonlyargs) + bool(a.vararg) + bool(a.kwarg)
    return n - (1 if names and names[0] in ("self", "cls") else 0)


def test_no_function_or_constructor_takes_more_than_ten_parameters():
    """Flattened argument lists are the symptom the args objects cure. The schema's dataclasses (built by
    `parse`, never by hand) and the records of a trajectory (the loss's MicroBatch, the ring's Group, the
    trainer's Batch, the rollout's Episode: each filled field by field in one place) are the exceptions."""
    too_many = []
    for path in _files():
        rel = os.path.relpath(path, ROOT)
        for node in ast.walk(_tree(path)):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) and _parameters(node) > 10:
                too_many.append(f"{rel}:{node.lineno} {node.name}")
            if isinstance(node, ast.ClassDef) and any("dataclass" in ast.unparse(d) for d in node.decorator_list):
                fields = [s for s in node.body if isinstance(s, ast.AnnAssign)]
                if len(fields) > 10 and node.name not in SCHEMA + RECORDS and \
                        not (rel.startswith("tasks/") and node.name == "Config"):
                    too_many.append(f"{rel}:{node.lineno} {node.name} ({len(fields)} fields)")
    assert too_many == []


def test_weights_are_published_once_per_batch_not_per_optimizer_step():
    """"Weights flow back after every batch": the loop's step publishes once, after Learner.step, which runs
    all train.minibatches optimizer steps and publishes nothing itself."""
    source = _tree(os.path.join(ROOT, "trainer", "loop.py"))
    run = next(n for n in ast.walk(source) if isinstance(n, ast.FunctionDef) and n.name == "run"
               and any(isinstance(a, ast.arg) and a.arg == "self" for a in n.args.args))
    loop = next(n for n in ast.walk(run) if isinstance(n, ast.For))
    calls = [ast.unparse(n.func) for n in ast.walk(loop) if isinstance(n, ast.Call)]
    assert calls.count("self.learner.publish") == 1 and calls.count("self.learner.step") == 1
    learner = _tree(os.path.join(ROOT, "trainer", "learner.py"))
    step = next(n for n in ast.walk(learner) if isinstance(n, ast.FunctionDef) and n.name == "step")
    assert not [n for n in ast.walk(step) if isinstance(n, ast.Call) and "publish" in ast.unparse(n.func)]


@pytest.mark.parametrize("package, registry", [("algos", "LOSSES"), ("tasks", "TASKS"), ("rewards", "REWARDS"),
                                               ("engines", "ENGINES")])
def test_every_kind_of_part_is_found_the_same_way(package, registry):
    """"Finding parts by name": one Registry per kind, over its package's folder; an unknown name is one line
    naming the valid ones."""
    import importlib

    from registry import Registry

    found = getattr(importlib.import_module(package), registry)
    assert isinstance(found, Registry) and found.names()
    for name in found.names():
        module = found.get(name)
        assert module.__name__ == f"{package}.{name}"
    with pytest.raises(ValueError, match=r"^unknown \w+ 'nope' \(choose one of: ") as error:
        found.get("nope")
    assert "\n" not in str(error.value)


def test_no_weight_path_names_an_engine():
    """"No weight path asks which engine it feeds": the weight paths import no engine and compare no engine's
    name; they speak the engine contract (engines/base.py)."""
    engines = ("engines.builtin", "engines.sglang", "engines.llama", "engines.hf")
    for name in ("weights.py", "weight_sync.py", "buckets.py"):
        tree = _tree(os.path.join(ROOT, "engines", name))
        imports = {n.module for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)}
        strings = {n.value for n in ast.walk(tree) if isinstance(n, ast.Constant) and isinstance(n.value, str)}
        assert not imports & set(engines) and not strings & {"builtin", "sglang"}, name


NEW_LOSS = '''"""A probe rule: REINFORCE with the group's mean reward as baseline."""
from dataclasses import dataclass

from algos import MicroBatch, sequence_logprobs


@dataclass
class Config:
    name: str = "zz_probe_loss"
    scale: float = 1.0  # its own knob


class Loss:
    needs_reference = False
    needs_proximal = False

    def __init__(self, cfg: Config):
        self.cfg = cfg

    def __call__(self, mb: MicroBatch):
        r = mb.rewards.view(-1, mb.group_size)
        adv = (r - r.mean(1, keepdim=True)).reshape(-1)
        loss = -(self.cfg.scale * adv * sequence_logprobs(mb.logprobs, mb.mask)).sum() / mb.batch_sequences
        return loss, {"zz/adv_abs_mean": adv.abs().mean().item()}
'''

NEW_TASK = '''"""A probe task: repeat a word."""
from dataclasses import dataclass

from tasks import Example, Task


@dataclass
class Config:
    name: str = "zz_probe_task"
    reward: str = "arithmetic"


def build(cfg: Config, seed: int) -> Task:
    examples = [Example(f"Say {n}.", str(n)) for n in range(10)]
    return Task(reward=cfg.reward, train=examples[2:], test=examples[:2])
'''

NEW_PRESET = """# @package _global_
defaults:
  - /schema/task@task: zz_probe_task
rollout:
  max_new_tokens: 7
"""


@pytest.fixture
def new_parts():
    """A loss (one file), a task (its file and its preset) dropped into the tree, and removed afterwards."""
    import sys

    paths = {os.path.join(ROOT, "algos", "zz_probe_loss.py"): NEW_LOSS,
             os.path.join(ROOT, "tasks", "zz_probe_task.py"): NEW_TASK,
             os.path.join(ROOT, "conf", "task", "zz_probe_task.yaml"): NEW_PRESET}
    try:
        for path, text in paths.items():
            with open(path, "w") as f:
                f.write(text)
        yield
    finally:
        for path in paths:
            if os.path.exists(path):
                os.remove(path)
        for name in ("algos.zz_probe_loss", "tasks.zz_probe_task"):
            sys.modules.pop(name, None)


def test_a_new_loss_is_its_file_and_a_new_task_its_file_and_preset(new_parts):
    """"A new part is its file": nothing else lists the parts, so the command line, the schema, the checks and the
    trainer's lookup all find them."""
    import torch

    import algos
    import tasks
    from launch.config import check_overrides, compose, parse

    overrides = ["algo=zz_probe_loss", "task=zz_probe_task", "algo.scale=2.0"]
    check_overrides(overrides)
    cfg = parse(compose(overrides))
    assert (cfg.algo.name, cfg.algo.scale, cfg.task.name) == ("zz_probe_loss", 2.0, "zz_probe_task")
    assert cfg.rollout.max_new_tokens == 7  # the task's preset set another section's key
    with pytest.raises(ValueError, match=r"^unknown config key 'algo.scal'"):
        check_overrides(["algo=zz_probe_loss", "algo.scal=1"])

    loss_fn = algos.get(cfg.algo.name).Loss(cfg.algo)  # what trainer/learner.py does
    logprobs = torch.zeros(4, 3, requires_grad=True)
    mb = algos.MicroBatch(logprobs=logprobs, behav_logprobs=torch.zeros(4, 3), mask=torch.ones(4, 3),
                          rewards=torch.tensor([1.0, 0.0, 0.0, 1.0]), group_size=2, batch_sequences=4,
                          batch_tokens=12, max_new_tokens=3, step=0)
    loss, metrics = loss_fn(mb)
    loss.backward()
    assert metrics["zz/adv_abs_mean"] == 0.5 and logprobs.grad[0, 0] == -2.0 * 0.5 / 4
    task = tasks.get(cfg.task.name).build(cfg.task, 0)
    assert (len(task.train), task.test[0].answer) == (8, "0")
