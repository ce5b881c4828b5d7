"""docs/design.md's checkable statements, checked against the code (the import layers are
tests/test_layering.py): each fails if the code stops doing what the design says."""
import ast
import dataclasses
import inspect
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PRODUCT = ("algos", "buffer", "engines", "evaluate.py", "launch", "models", "registry.py", "rewards",
           "rollout.py", "tasks", "train.py", "trainer", "plot.py", "scripts", "heap.py")


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
        # picklable values, passed whole
        assert dataclasses.is_dataclass(args) and args.__dataclass_params__.frozen
        assert any(f.name == "cfg" for f in dataclasses.fields(args))


SCHEMA = ("Config", "ClusterConfig", "TrainConfig", "RolloutConfig", "BufferConfig", "EvalConfig")
RECORDS = ("MicroBatch", "Group", "Batch", "Episode", "Completion")  # records: one field per thing recorded


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
            if isinstance(node, ast.ClassDef) \
                    and any("dataclass" in ast.unparse(d) for d in node.decorator_list):
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


@pytest.mark.parametrize("package, registry", [("algos", "LOSSES"), ("tasks", "TASKS"),
                                               ("rewards", "REWARDS"), ("engines", "ENGINES")])
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
        strings = {n.value for n in ast.walk(tree)
                   if isinstance(n, ast.Constant) and isinstance(n.value, str)}
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
    """"A new part is its file": nothing else lists the parts, so the command line, the schema, the checks and
    the trainer's lookup all find them."""
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


# design.md's lists and figures, read from the file and checked against the code. Each check is a function
# of the text, so the tests below also run it on copies edited the way drift would edit them: each can fail.

DOCS = {name: os.path.join(ROOT, "docs", name) for name in ("design.md", "gpu.md")}


def _doc(name: str = "design.md") -> str:
    with open(DOCS[name]) as f:
        return f.read()


def _section(text: str, title: str) -> str:
    """The body of the `## <title>` section, up to the next `## ` heading."""
    start = text.index(f"\n## {title}")
    end = text.find("\n## ", start + 1)
    return text[start:] if end < 0 else text[start:end]


def _list_span(text: str, group: str) -> re.Match | None:
    """Where the contract lists `group=`'s options: the parentheses after `` `group=` ``."""
    return re.search(rf"`{group}=`\s*\(([^)]*)\)", text)


def _listed(text: str, group: str) -> set[str]:
    """The options listed for `group=`: items split at commas and semicolons, less a `label:` before one."""
    match = _list_span(text, group)
    if match is None:
        return set()
    return {item.split(":")[-1].strip() for item in re.split(r"[,;]", match.group(1))}


def _options() -> dict[str, set[str]]:
    """What each group can be: the registry's parts (algos, tasks) and the presets in conf/<group>/."""
    import algos
    import tasks

    def presets(group: str) -> set[str]:
        return {f[:-5] for f in os.listdir(os.path.join(ROOT, "conf", group)) if f.endswith(".yaml")}

    return {"algo": set(algos.LOSSES.names()) | presets("algo"),
            "task": set(tasks.TASKS.names()) | presets("task"),
            "cluster": presets("cluster"), "model": presets("model")}


def _list_problems(text: str, options: dict[str, set[str]]) -> list[str]:
    """Each option missing from its group's list; for every group but model= (which also takes any Hugging
    Face folder, said in words), each listed name that is no option."""
    contract = _section(text, "User-facing contract")
    problems = []
    for group, names in options.items():
        listed = _listed(contract, group)
        problems += [f"{group}={name} is not listed" for name in sorted(names - listed)]
        if group != "model":
            problems += [f"{group}={name} is listed but is no option" for name in sorted(listed - names)]
    return problems


def test_the_contract_lists_every_rule_task_and_preset():
    """"Config groups": every rule in algos.LOSSES, every task in tasks.TASKS, every conf/<group>/*.yaml."""
    text, options = _doc(), _options()
    assert _list_problems(text, options) == []
    for group, names in options.items():  # the check can fail: each name dropped; a name that is gone, added
        match = _list_span(text, group)
        for name in names:
            dropped = re.sub(rf"(?<![\w-]){re.escape(name)}(?![\w-]),? ?", "", match.group(1))
            edited = text[:match.start(1)] + dropped + text[match.end(1):]
            assert f"{group}={name} is not listed" in _list_problems(edited, options)
        if group != "model":
            edited = text[:match.end(1)] + ", zz_gone" + text[match.end(1):]
            assert _list_problems(edited, options) == [f"{group}=zz_gone is listed but is no option"]


CLAIM = re.compile(r"\((\d+) lines\)")
FILE_CLAIM = re.compile(r"`([\w./-]+\.\w+)`[^`()]*\((\d+) lines\)")


def _line_claim_problems(text: str) -> list[str]:
    """Every "(N lines)" follows, in its sentence, the file it counts, and N is within 10% (at least 5 lines)
    of the file's length."""
    claims = FILE_CLAIM.findall(text)
    unnamed = len(CLAIM.findall(text)) - len(claims)
    problems = ["a (N lines) claim names no file before it"] if unnamed else []
    for path, said in claims:
        full = os.path.join(ROOT, path)
        if not os.path.isfile(full):
            problems.append(f"{path}: no such file")
            continue
        with open(full) as f:
            lines = sum(1 for _ in f)
        if abs(lines - int(said)) > max(5, lines // 10):
            problems.append(f"{path}: said to be {said} lines, has {lines}")
    return problems


@pytest.mark.parametrize("doc", sorted(DOCS))
def test_a_file_s_length_is_stated_as_it_is(doc):
    text = _doc(doc)
    assert _line_claim_problems(text) == []
    # the check can fail: a claim far off, a claim about no file, a claim that names no file
    guess = len(open(os.path.join(ROOT, "tasks", "guess_number.py")).readlines())
    assert _line_claim_problems(text + f"\n`tasks/guess_number.py` ({guess * 2} lines)") == \
        [f"tasks/guess_number.py: said to be {guess * 2} lines, has {guess}"]
    assert _line_claim_problems(text + "\n`tasks/zz_gone.py` (10 lines)") == \
        ["tasks/zz_gone.py: no such file"]
    assert _line_claim_problems(text + "\nthe worked example (10 lines)") == \
        ["a (N lines) claim names no file before it"]


BASE = os.path.join(ROOT, "engines", "base.py")
PROTOCOLS = ("Engine", "EngineSpec", "WeightPath")  # engines/base.py's, each a row of "Written interfaces"


def _members(source: str, name: str) -> tuple[set[str], set[str]]:
    """Protocol `name`'s public methods and its declared attributes, read from `source`."""
    cls = next(n for n in ast.parse(source).body if isinstance(n, ast.ClassDef) and n.name == name)
    methods = {n.name for n in cls.body if isinstance(n, ast.FunctionDef) and not n.name.startswith("_")}
    attributes = {n.target.id for n in cls.body
                  if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)}
    return methods, attributes


def _role(text: str, protocol: str) -> str | None:
    """The role cell of the "Written interfaces" row whose protocol cell is `protocol`."""
    for line in _section(text, "Written interfaces").splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[1] == f"`{protocol}`":
            return cells[0]
    return None


def _interface_problems(text: str, source: str) -> list[str]:
    """The names in backticks in each engines/base.py Protocol's row are its public methods, every one of
    them, and may add its declared attributes; nothing else."""
    problems = []
    for name in PROTOCOLS:
        role = _role(text, f"engines.base.{name}")
        if role is None:
            problems.append(f"no row for engines.base.{name}")
            continue
        listed = set(re.findall(r"`(\w+)`", role))
        methods, attributes = _members(source, name)
        problems += [f"{name}.{m} is not in its row" for m in sorted(methods - listed)]
        problems += [f"{name}'s row names {m}, which it does not declare"
                     for m in sorted(listed - methods - attributes)]
    return problems


def test_the_engine_rows_name_the_protocols_methods():
    """"Written interfaces": the rows of Engine, EngineSpec and WeightPath follow engines/base.py."""
    text, source = _doc(), open(BASE).read()
    assert _interface_problems(text, source) == []
    for name in PROTOCOLS:  # the check can fail: a method dropped from the row, added to the Protocol, ...
        role = _role(text, f"engines.base.{name}")
        for method in _members(source, name)[0]:
            edited = text.replace(role, role.replace(f"`{method}`", method))
            assert f"{name}.{method} is not in its row" in _interface_problems(edited, source)
        header = f"class {name}(Protocol):\n"
        grown = source.replace(header, header + "    def zz_new(self): ...\n")
        assert _interface_problems(text, grown) == [f"{name}.zz_new is not in its row"]
        edited = text.replace(role, role + " `zz_gone`")
        assert _interface_problems(edited, source) == \
            [f"{name}'s row names zz_gone, which it does not declare"]


def _test_names() -> set[str]:
    """Every test function under tests/."""
    names = set()
    for entry in os.listdir(os.path.join(ROOT, "tests")):
        if entry.startswith("test_") and entry.endswith(".py"):
            tree = _tree(os.path.join(ROOT, "tests", entry))
            names |= {n.name for n in ast.walk(tree) if isinstance(n, ast.FunctionDef)}
    return {name for name in names if name.startswith("test_")}


def _cited_test_problems(text: str, tests: set[str]) -> list[str]:
    return [f"{name} is no test" for name in sorted(set(re.findall(r"`(test_\w+)`", text)) - tests)]


@pytest.mark.parametrize("doc", sorted(DOCS))
def test_every_test_a_doc_cites_exists(doc):
    """"Failures" and the other sections name the tests that check them: a renamed test fails here."""
    text, tests = _doc(doc), _test_names()
    assert _cited_test_problems(text, tests) == []
    assert _cited_test_problems(text + " `test_zz_gone`", tests) == ["test_zz_gone is no test"]


WORDING = {r"session \d": "cite a commit, not a session",
           r"(weights|publish|version)[^.]{0,60}(after|per|each|every) (every |each )?optimizer step":
               "weights go out once per batch (one version), which may take several optimizer steps"}


def _wording_problems(text: str) -> list[str]:
    return [f"{pattern!r}: {why}" for pattern, why in WORDING.items() if re.search(pattern, text)]


@pytest.mark.parametrize("doc", sorted(DOCS))
def test_the_docs_cite_commits_and_count_versions_in_batches(doc):
    """A version is one published batch, not one optimizer step (with train.minibatches or train.epochs > 1 a
    batch takes several); a figure's provenance is a commit."""
    text = _doc(doc)
    assert _wording_problems(text) == []
    cited_by_period = "session" + " 3"  # spelled apart so that `git grep "session [0-9]"` finds none
    assert len(_wording_problems(f"{text} {cited_by_period}; weights go out after every optimizer step")) == 2
