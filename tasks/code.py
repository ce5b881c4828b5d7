"""Programming problems, scored by running the reply's code against test cases in a sandbox (reward: code).

`task.path` empty downloads MBPP's sanitized split (`google-research-datasets/mbpp`, config `sanitized`: 120
train and 257 test problems, each with three asserts) through `datasets`. Otherwise it names a local .jsonl or
.parquet file, or a folder of them (read as in tasks/gsm8k.py). A row may use the hub datasets' own fields:
  - MBPP: `text` or `prompt`, `test_list`, and `test_setup_code` or `test_imports`;
  - HumanEval: `prompt` (the signature and docstring), `test` (a `check(candidate)` function), `entry_point`;
  - APPS / TACO: `question`, `input_output` (JSON: `inputs`, `outputs`, and `fn_name` for call-based
    problems, whose cases become asserts), optional `starter_code`;
or a plain form: `question` plus either `tests` (asserts; optional `setup`) or `inputs` and `outputs`
(stdin/stdout cases, e.g. from CodeContests, DeepCoder or LiveCodeBench's public cases).
A function-shaped prompt shows the first assert, so the model knows the function's name and signature.
Every run needs bubblewrap (rewards/sandbox.py): without it the run stops at start, saying how to install it.
"""
import json
from dataclasses import asdict, dataclass

from registry import require
from tasks import Example, Task
from tasks.gsm8k import check_sizes, choose, read_hub, read_path, text

HUB_ID, HUB_CONFIG = "google-research-datasets/mbpp", "sanitized"
INSTRUCTION = "Answer with one Python program in a ```python code block."
EXPECTED = ("'tests' (asserts), 'inputs' and 'outputs' (stdin/stdout cases), MBPP's 'test_list', HumanEval's "
            "'test' and 'entry_point', or APPS/TACO's 'input_output'")


@dataclass
class Config:
    name: str = "code"
    # local .jsonl/.parquet file or folder; empty: download MBPP (sanitized) through `datasets`
    path: str = ""
    max_train: int = 0  # training problems kept, chosen by the seed (0: all)
    max_test: int = 0  # test problems kept, chosen by the seed (0: all)
    test_size: int = 100  # problems held out as the test split when the data has none (a single file)
    max_cases: int = 0  # cases kept per problem, the first ones (0: all; APPS problems can have hundreds)
    reward_mode: str = "all"  # all: 1 when every case passes | fraction: the share of cases passed
    parallel_cases: int = 4  # stdin/stdout cases of one program run at once
    timeout_s: float = 3.0  # wall clock of one sandboxed run (a program's asserts share one run)
    program_timeout_s: float = 15.0  # all of one program's runs; reward.timeout_s must exceed it
    memory_mb: int = 1024  # address space of a run
    processes: int = 16  # processes and threads a run may have
    file_mb: int = 16  # largest file a run may write, and the size of its private /tmp
    output_kb: int = 1024  # output a run may print before it is killed

    def check(self):
        check_sizes(self)
        require(self.reward_mode in ("all", "fraction"), "task.reward_mode", "must be all or fraction",
                self.reward_mode)
        require(self.max_cases >= 0, "task.max_cases", "must be >= 0", self.max_cases)
        for key in ("parallel_cases", "processes", "memory_mb", "file_mb", "output_kb"):
            require(getattr(self, key) >= 1, f"task.{key}", "must be >= 1", getattr(self, key))
        require(self.timeout_s > 0, "task.timeout_s", "must be > 0", self.timeout_s)
        require(self.program_timeout_s >= self.timeout_s, "task.program_timeout_s",
                f"must be >= task.timeout_s={self.timeout_s}", self.program_timeout_s)

    @property
    def min_reward_timeout_s(self) -> float:
        """The reward pool's timeout must leave the sandbox time to end a program itself (and say why)."""
        return self.program_timeout_s + 2.0

    def reward_options(self) -> dict:
        options = asdict(self)
        for key in ("name", "path", "max_train", "max_test", "test_size", "max_cases", "reward_mode"):
            del options[key]
        return dict(options, mode=self.reward_mode)


def build(cfg: Config, seed: int) -> Task:
    from rewards.sandbox import check

    check()  # no sandbox, no run: say so now, not as a reward of 0 for every reply
    if cfg.path:
        train, test = read_path(cfg.path)
    else:
        train, test = read_hub(HUB_ID, [HUB_CONFIG])
    train = [example(where, row, cfg.max_cases) for where, row in train]
    test = None if test is None else [example(where, row, cfg.max_cases) for where, row in test]
    train, test = choose(train, test, cfg, seed, cfg.path or HUB_ID)
    return Task(reward="code", train=train, test=test, reward_options=cfg.reward_options())


def example(where: str, row: dict, max_cases: int = 0) -> Example:
    """One row, in any of the shapes above, as (prompt, reference JSON for rewards/code.py)."""
    if "input_output" in row:
        return _apps(where, row, max_cases)
    if "test_list" in row:  # MBPP
        statement = text(row, where, "text" if "text" in row else "prompt", "MBPP's 'text' or 'prompt'")
        setup = row.get("test_setup_code") or "\n".join(row.get("test_imports") or [])
        return _function(where, statement, _list(row, where, "test_list"), setup, max_cases)
    if "entry_point" in row and "test" in row:  # HumanEval: the reply completes the prompt's function
        prompt = text(row, where, "prompt", "HumanEval's 'prompt'")
        entry = text(row, where, "entry_point", "HumanEval's 'entry_point'")
        imports = "\n".join(line for line in prompt.splitlines() if line.startswith(("import ", "from ")))
        question = f"Complete this Python function:\n```python\n{prompt.rstrip()}\n```\n{INSTRUCTION}"
        reference = {"tests": [f"{text(row, where, 'test', 'test')}\ncheck({entry})\n"], "setup": imports}
        return Example(question, json.dumps(reference))
    question = text(row, where, "question", f"'question' and {EXPECTED}")
    if "tests" in row:
        return _function(where, question, _list(row, where, "tests"), row.get("setup") or "", max_cases)
    if "inputs" in row and "outputs" in row:
        return _stdio(where, question, _list(row, where, "inputs"), _list(row, where, "outputs"), max_cases)
    raise ValueError(f"{where}: no test cases (expected {EXPECTED})")


def _function(where: str, statement: str, tests: list, setup, max_cases: int) -> Example:
    tests = _cut(tests, max_cases)
    if not all(isinstance(t, str) and t.strip() for t in tests) or not isinstance(setup, str):
        raise ValueError(f"{where}: tests must be strings of code (asserts) and setup a string")
    question = f"{statement.strip()}\nYour code should pass this test:\n{tests[0].strip()}\n{INSTRUCTION}"
    return Example(question, json.dumps({"tests": tests, "setup": setup}))


def _stdio(where: str, question: str, inputs: list, outputs: list, max_cases: int) -> Example:
    if len(inputs) != len(outputs):
        raise ValueError(f"{where}: {len(inputs)} inputs but {len(outputs)} outputs")
    inputs, outputs = (_cut([_lines(x) for x in inputs], max_cases),
                       _cut([_lines(x) for x in outputs], max_cases))
    if not all(isinstance(x, str) for x in inputs + outputs):
        raise ValueError(f"{where}: stdin/stdout cases must be strings (or lists of lines)")
    question = (f"{question.strip()}\n"
                "Read the input from standard input and print the answer to standard output.\n"
                f"{INSTRUCTION}")
    return Example(question, json.dumps({"inputs": inputs, "outputs": outputs}))


def _apps(where: str, row: dict, max_cases: int) -> Example:
    question = text(row, where, "question", "APPS's 'question' and 'input_output'")
    cases = row["input_output"]
    try:
        cases = json.loads(cases) if isinstance(cases, str) else cases
        inputs, outputs = cases["inputs"], cases["outputs"]
    except (json.JSONDecodeError, TypeError, KeyError):
        raise ValueError(f"{where}: 'input_output' must be JSON with 'inputs' and 'outputs'") from None
    if (not isinstance(inputs, list) or not isinstance(outputs, list) or not inputs
            or len(inputs) != len(outputs)):
        raise ValueError(f"{where}: 'input_output' needs equally long, non-empty 'inputs' "
                         "and 'outputs' lists")
    starter = row.get("starter_code") or ""
    if not cases.get("fn_name"):
        if starter.strip():
            question = f"{question.strip()}\nStart from:\n```python\n{starter.rstrip()}\n```"
        return _stdio(where, question, inputs, outputs, max_cases)
    # Call-based: each case calls the function with the input list as arguments. APPS wraps some expected
    # values in a one-element list; its checker accepts either, and so do these asserts.
    name = str(cases["fn_name"])
    call = f"Solution().{name}" if "class Solution" in starter else name
    tests = []
    for args, want in zip(inputs, outputs):
        args = args if isinstance(args, list) else [args]
        accepted = f"({want!r}, {want[0]!r})" if isinstance(want, list) and len(want) == 1 else f"({want!r},)"
        tests.append(f"assert {call}(*{args!r}) in {accepted}")
    statement = f"{question.strip()}\nWrite it as the function `{name}`."
    if starter.strip():
        statement += f" Start from:\n```python\n{starter.rstrip()}\n```"
    tests = _cut(tests, max_cases)
    return Example(f"{statement}\n{INSTRUCTION}", json.dumps({"tests": tests, "setup": ""}))


def _list(row: dict, where: str, key: str) -> list:
    value = row[key]
    if isinstance(value, str):  # some exports store lists as JSON text
        try:
            value = json.loads(value)
        except json.JSONDecodeError:
            pass
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: field '{key}' must be a non-empty list (expected {EXPECTED})")
    return list(value)


def _lines(x):
    return "\n".join(str(line) for line in x) + "\n" if isinstance(x, list) else x


def _cut(cases: list, max_cases: int) -> list:
    return cases[:max_cases] if max_cases else cases

