"""`python train.py --help`: every key with its default, its comment and its range, read from the schema's
source (launch/help.py, launch/schema_notes.py), printed before Hydra starts anything."""
import dataclasses
import importlib.util
import inspect
import os
import subprocess
import sys
import time

import pytest

from launch.help import blocks, render
from launch.schema_notes import notes_of, read_notes
from runtime.schema import Config, TrainConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

TINY = '''
from dataclasses import dataclass, field

from registry import require

MODES = ("a", "b")


@dataclass
class Inner:
    """The inner section.

    More about it, left out of help."""
    depth: int = 2  # how deep

    def check(self, where: str):
        require(self.depth >= 1, f"{where}.depth", "must be >= 1", self.depth)


@dataclass
class Outer:
    rate: float = 0.5  # a rate
    # the first line of a comment above,
    # and its second line
    size: int = 3
    slow_s: float = 10.0  # a timeout whose comment
    # goes on below its line
    fast_s: float = 1.0  # its own comment
    # Only with the fast path:
    mode: str = "a"  # a | b
    inner: Inner = field(default_factory=Inner)  # the nested section

    def check(self):
        self.inner.check("inner")
        for key in ("slow_s", "fast_s"):
            require(getattr(self, key) > 0, key, "must be > 0", getattr(self, key))
        require(self.size <= 9, "size", f"must be in [1, rate={self.rate}]", self.size)
        require(self.mode in MODES, "mode", f"must be one of {', '.join(MODES)} (got {self.mode})", self.mode)
'''


def test_the_reader_takes_each_fields_comment_from_its_line_and_the_lines_above():
    notes = read_notes(TINY)
    assert notes["Outer"].comments == {
        "rate": "a rate",
        "size": "the first line of a comment above, and its second line",
        "slow_s": "a timeout whose comment goes on below its line",  # not fast_s's: that one has its own
        "fast_s": "its own comment",
        "mode": "a | b",
        "inner": "the nested section"}
    assert notes["Outer"].headings == {"mode": "Only with the fast path:"}
    assert notes["Inner"].doc == "The inner section."


def test_the_reader_takes_each_keys_range_from_the_require_calls():
    ranges = read_notes(TINY)["Outer"].ranges
    assert ranges["slow_s"] == ranges["fast_s"] == ["must be > 0"]  # a loop over the keys: once for each
    assert ranges["size"] == ["must be in [1, rate]"]  # `rate={self.rate}` names the key, not a value
    assert ranges["mode"] == ["must be one of … (got …)"]  # the source alone: no values
    assert read_notes(TINY)["Inner"].ranges == {"{}.depth": ["must be >= 1"]}  # its caller gives the prefix


@pytest.fixture
def tiny_module(tmp_path):
    path = tmp_path / "tiny_schema.py"
    path.write_text(TINY)
    spec = importlib.util.spec_from_file_location("tiny_schema", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["tiny_schema"] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        del sys.modules["tiny_schema"]


def test_a_nested_section_is_its_own_block_with_dotted_keys(tiny_module):
    outer, inner = blocks(tiny_module.Outer())
    assert [r.key for r in outer.rows] == ["rate", "size", "slow_s", "fast_s", "mode"]
    assert (inner.title, inner.about) == ("inner", "the nested section. The inner section.")
    (depth,) = inner.rows
    assert (depth.key, depth.value, depth.meaning) == ("inner.depth", 2, "how deep")
    assert depth.ranges == ["must be >= 1"]
    # read from a module, a message's values that need only the module's names are filled in
    assert notes_of(tiny_module.Outer)[0].ranges["mode"] == ["must be one of a, b (got …)"]


def _comment_above(cls, name: str) -> str:
    """The comment lines right above a field in its class's source, read here without the reader."""
    lines = inspect.getsource(cls).splitlines()
    index = next(i for i, line in enumerate(lines) if line.strip().startswith(f"{name}:"))
    above = []
    while lines[index - 1 - len(above)].strip().startswith("#"):
        above.insert(0, lines[index - 1 - len(above)].strip().lstrip("#").strip())
    return " ".join(above)


def _entry(text: str, key: str) -> str:
    """One key's line and its wrapped continuation lines, as one line."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(f"  {key} = "))
    end = next((i for i in range(start + 1, len(lines)) if not lines[i].startswith("      ")), len(lines))
    return " ".join(" ".join(lines[start:end]).split())


def _train_py(*args, cwd):
    start = time.time()
    done = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *args], cwd=cwd,
                          capture_output=True, text=True, timeout=120)
    return done, time.time() - start


def test_help_lists_every_key_with_its_default_meaning_and_range_and_starts_nothing(tmp_path):
    done, took = _train_py("--help", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    assert took < 60 and os.listdir(tmp_path) == []  # no run directory: Hydra never ran
    assert "powered by Hydra" not in done.stdout
    staleness = _entry(done.stdout, "max_staleness")
    assert staleness.startswith(f"max_staleness = {Config().max_staleness} ")
    assert " ".join(_comment_above(Config, "max_staleness").split()) in staleness
    assert staleness.endswith("[must be >= 0]")
    lr = _entry(done.stdout, "train.lr")
    assert lr.startswith(f"train.lr = {TrainConfig().lr} ") and lr.endswith("[must be > 0]")
    assert _entry(done.stdout, "train.lora.rank").startswith("train.lora.rank = 0 ")
    for group in ("algo=", "task=", "cluster="):
        assert f"  {group}" in done.stdout
    assert max(len(line) for line in done.stdout.splitlines()) <= 110
    short, _ = _train_py("-h", cwd=tmp_path)
    assert short.stdout == done.stdout


def test_help_with_a_word_lists_only_the_keys_it_names(tmp_path):
    done, _ = _train_py("--help", "max_staleness", cwd=tmp_path)
    assert done.returncode == 0, done.stderr
    keys = [line.split(" = ")[0].strip() for line in done.stdout.splitlines() if line.startswith("  ")
            and not line.startswith("   ")]
    assert keys == ["max_staleness"]
    missing, _ = _train_py("--help", "train.lrr", cwd=tmp_path)
    assert missing.returncode == 2 and missing.stderr.strip().splitlines() == [
        "error: no config key holds 'train.lrr', did you mean 'train.lr'?"]


def test_every_key_of_the_schema_and_of_the_chosen_rule_and_task_is_listed():
    import algos
    import tasks

    text = render(["algo=tb", "task=gsm8k"])
    sections = {"": Config, "algo.": algos.get("tb").Config, "task.": tasks.get("gsm8k").Config}
    for prefix, cls in sections.items():
        for f in dataclasses.fields(cls):
            section = dataclasses.is_dataclass(f.default_factory) or f.name in ("algo", "task") and not prefix
            assert section or f"  {prefix}{f.name} = " in text, prefix + f.name
    assert "  train.lora.rank = " in text and "  cluster.ray.nodes[i].role = " in text
    assert "(algo=tb sets 5e-05)" in _entry(text, "train.lr")  # a chosen preset's change is said
