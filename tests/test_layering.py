"""The layering rule of docs/design.md, read from the source: imports point down, processes never import each
other, and only the plans name a concrete engine."""
import ast
import os
import re

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CONCRETE_ENGINES = ("engines.builtin", "engines.sampler", "engines.llama", "engines.sglang",
                    "engines.weights", "engines.weight_sync")


def _sources(folder_or_file: str) -> list[str]:
    path = os.path.join(ROOT, folder_or_file)
    if path.endswith(".py"):
        return [path]
    return sorted(os.path.join(path, f) for f in os.listdir(path) if f.endswith(".py"))


def _imports(path: str) -> set[str]:
    """Every module a file imports, at the top or inside a function, as dotted names."""
    found = set()
    for node in ast.walk(ast.parse(open(path).read(), path)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return found


def _offending(sources: list[str], forbidden: tuple[str, ...]) -> list[str]:
    return [f"{os.path.relpath(p, ROOT)} imports {m}" for p in sources for m in sorted(_imports(p))
            if any(m == f or m.startswith(f + ".") for f in forbidden)]


RULES = [  # (files, what they must not import)
    # launch/ builds and starts the processes, runtime/ is what they share: the processes import runtime only
    ("trainer", ("rollout", "launch", "train") + CONCRETE_ENGINES),
    ("rollout.py", ("trainer", "launch", "train") + CONCRETE_ENGINES),
    ("evaluate.py", ("trainer", "rollout", "launch", "train") + CONCRETE_ENGINES),
    ("runtime", ("trainer", "rollout", "evaluate", "launch", "train", "tasks", "envs") + CONCRETE_ENGINES),
    ("tasks", ("trainer", "rollout", "evaluate", "launch", "runtime", "train")),
    ("train.py", CONCRETE_ENGINES),
    ("buffer", ("algos", "engines", "trainer", "rollout", "evaluate", "launch", "runtime", "rewards")),
    ("algos",
     ("buffer", "engines", "trainer", "rollout", "evaluate", "launch", "runtime", "rewards", "tasks")),
    ("engines",
     ("algos", "buffer", "trainer", "rollout", "evaluate", "launch", "runtime", "rewards", "tasks")),
    ("rewards", ("engines", "trainer", "buffer", "rollout", "launch", "runtime", "algos")),
    ("envs",
     ("algos", "trainer", "rollout", "evaluate", "launch", "runtime", "tasks", "train") + CONCRETE_ENGINES),
    ("registry.py",
     ("algos", "buffer", "engines", "trainer", "rollout", "evaluate", "launch", "rewards", "tasks")),
    ("heap.py",
     ("algos", "buffer", "engines", "trainer", "rollout", "evaluate", "launch", "rewards", "tasks")),
    ("launch", CONCRETE_ENGINES[:3] + ("engines.hf",)),  # engines are found by name (engines.ENGINES)
]


@pytest.mark.parametrize("where, forbidden", RULES, ids=[r[0] for r in RULES])
def test_imports_point_down(where, forbidden):
    assert _offending(_sources(where), forbidden) == []


def test_the_rule_can_fail():
    """The checker sees imports inside functions too (a lazy import is still a dependency)."""
    found = _offending(_sources("launch/gpu.py"), ("engines.weight_sync",))
    assert found == ["launch/gpu.py imports engines.weight_sync",
                     "launch/gpu.py imports engines.weight_sync.GPUWeights"]


def test_benchmarks_run_as_modules_without_path_patches():
    for path in _sources("bench"):
        assert "sys.path" not in open(path).read(), path


def test_the_readme_links_only_files_in_the_repository():
    text = open(os.path.join(ROOT, "README.md")).read()
    assert "../" not in text
    for target in re.findall(r"\]\(([^)#]+)\)", text):
        if not target.startswith(("http://", "https://")):
            assert os.path.exists(os.path.join(ROOT, target)), target
    assert "docs/design.md" in text


def test_the_code_passes_the_linter():
    """ruff with pyproject.toml's settings (pycodestyle, pyflakes, import order)."""
    import subprocess
    import sys

    result = subprocess.run([sys.executable, "-m", "ruff", "check", "--output-format", "concise", ROOT],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-1000:]


def test_the_launcher_asks_an_engine_s_spec_and_never_names_one():
    """launch/ and train.py decide by what an engine's spec says it can do (engines/base.py EngineSpec): no
    string in their code is an engine's name."""
    from engines import ENGINES

    names = set(ENGINES.names())
    assert names == {"builtin", "sglang", "simulated"}  # the engines, not their helper modules
    found = [f"{os.path.relpath(path, ROOT)}:{node.lineno} {node.value!r}"
             for path in _sources("launch") + _sources("train.py")
             for node in ast.walk(ast.parse(open(path).read(), path))
             if isinstance(node, ast.Constant) and node.value in names]
    assert found == []
