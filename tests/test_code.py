"""task=code: the sandbox (rewards/sandbox.py), the code reward (rewards/code.py), the loader (tasks/code.py).

Every program here is written by the test; hostile ones try what a policy might stumble on (or learn) to get a
reward without solving the problem, or to break out. Each must score 0, end within its time limits, and leave
no process and no file behind (the autouse no_leaks fixture checks the processes, the tests the files).
"""
import json
import os
import secrets
import socket
import tempfile
import threading
import time

import pytest

from rewards.code import CodeReward, extract_program, parse_reference
from rewards.pool import RewardPool
from tasks.code import Config, example
from tests.helpers import ROOT, TINY, require_sandbox, run_train

FENCE = "```"


def reply(program: str) -> str:
    return f"Here it is:\n{FENCE}python\n{program}\n{FENCE}\n"


def asserts(*tests, setup="") -> str:
    return json.dumps({"tests": list(tests), "setup": setup})


def stdio(inputs, outputs) -> str:
    return json.dumps({"inputs": inputs, "outputs": outputs})


@pytest.fixture(scope="module")
def sandbox():
    require_sandbox()


def _code_reward(**changes) -> CodeReward:
    """task=code's reward with the schema's values but for `changes` (tasks/code.py Config's keys)."""
    return CodeReward(**Config(**changes).reward_options())


@pytest.fixture(scope="module")
def reward(sandbox):
    return _code_reward(timeout_s=2.0, program_timeout_s=6.0)


ADD = "def add(a, b):\n    return a + b"
SUM_STDIN = "import sys\nprint(sum(int(x) for x in sys.stdin.read().split()))"


def test_right_and_wrong_programs_in_both_shapes(reward):
    tests = asserts("assert add(1, 2) == 3", "assert add(-1, 1) == 0")
    assert reward(reply(ADD), tests) == 1.0
    assert reward(reply(ADD.replace("a + b", "a - b")), tests) == 0.0
    assert reward(reply("import math\ndef area(r):\n    return math.pi * r * r"),
                  asserts("assert math.isclose(area(1), math.pi)", setup="import math")) == 1.0
    cases = stdio(["1 2\n", "5 5 5\n"], ["3\n", "15"])
    assert reward(reply(SUM_STDIN), cases) == 1.0
    assert reward(reply(SUM_STDIN + "\nprint('extra')"), cases) == 0.0
    assert reward(reply("print(3)"), cases) == 0.0
    assert reward("no code at all, just 3", cases) == 0.0
    # trailing whitespace is normalised, leading and inner whitespace are not
    assert reward(reply("print('a  b   ')\nprint()\nprint()"), stdio([""], ["a  b"])) == 1.0
    assert reward(reply("print(' a b')"), stdio([""], ["a b"])) == 0.0
    # standard-library values compare as they do in Python (a Counter equals a dict)
    counter = "import collections\ndef count(s):\n    return collections.Counter(s)"
    assert reward(reply(counter), asserts("assert count('aab') == {'a': 2, 'b': 1}")) == 1.0
    # exit() after printing is how competitive programs end; it passes
    assert reward(reply("print(3)\nexit()"), stdio([""], ["3"])) == 1.0


def test_fraction_mode_scores_the_share_of_cases_passed(sandbox):
    fraction = _code_reward(reward_mode="fraction", timeout_s=2.0, program_timeout_s=6.0)
    half = "def sign(x):\n    return 1 if x > 0 else 0"
    tests = asserts("assert sign(5) == 1", "assert sign(-5) == -1", "assert sign(7) == 1",
                    "assert sign(-1) == -1")
    assert fraction(reply(half), tests) == 0.5
    assert _code_reward(timeout_s=2.0)(reply(half), tests) == 0.0
    doubled = "print(2 * int(input()))"
    assert fraction(reply(doubled), stdio(["1", "2", "3"], ["2", "4", "7"])) == pytest.approx(2 / 3)


def test_the_last_python_block_is_the_program():
    text = f"{FENCE}python\nfirst\n{FENCE}\nthen\n{FENCE}text\nnot code\n{FENCE}\n{FENCE}py\nsecond\n{FENCE}"
    assert extract_program(text) == "second\n"
    assert extract_program(f"{FENCE}python\ncut off by the budget") == "cut off by the budget"
    assert extract_program("no block") is None
    assert extract_program(f"{FENCE}python\n{FENCE}") is None


@pytest.mark.parametrize("reference", ["not json", "[1, 2]", '{"tests": []}', '{"tests": [1]}',
                                       '{"inputs": ["1"]}', '{"inputs": ["1"], "outputs": ["1", "2"]}',
                                       '{"tests": ["assert ("]}', '{"tests": ["x"], "setup": 3}'])
def test_garbage_references_are_clear_errors(reference):
    with pytest.raises(ValueError, match="code reference"):
        parse_reference(reference)


# Hostile programs. Each is scored through a reward pool, so a timeout or a crash would show in its counters,
# and the pool must score a right program afterwards: the run is unaffected.

def _secret_home_file():
    folder = tempfile.mkdtemp(prefix=".ringrl-test-", dir=os.path.expanduser("~"))
    path = os.path.join(folder, "secret.txt")
    with open(path, "w") as f:
        f.write("home-secret")
    return folder, path


HOSTILE = {
    "infinite loop": ("def add(a, b):\n    while True:\n        pass", asserts("assert add(1, 2) == 3"),
                      "time"),
    "fork bomb": ("import os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n        pass",
                  asserts("assert add(1, 2) == 3"), "time"),
    "50 GB allocation": ("big = bytearray(50 * 2**30)\n" + ADD, asserts("assert add(1, 2) == 3"), "memory"),
    "10 GB file": ("f = open('/tmp/big', 'wb')\nfor _ in range(10 * 1024):\n"
                   "    f.write(bytes(2**20))\n" + ADD, asserts("assert add(1, 2) == 3"), None),
    "many files": ("for i in range(10**6):\n    open(f'/tmp/f{i}', 'wb').write(bytes(2**20))\n" + ADD,
                   asserts("assert add(1, 2) == 3"), None),
    "prints forever": ("while True:\n    print('spam' * 1000)", stdio([""], ["3"]), "output"),
    "exits before the asserts": ("import sys\nsys.exit(0)", asserts("assert add(1, 2) == 3"), None),
    "_exit before the asserts": ("import os\nos._exit(0)", asserts("assert add(1, 2) == 3"), None),
    "_exit in stdin/stdout": ("import os\nos._exit(0)", stdio(["1 2"], ["3"]), None),
    "always-equal object": ("class Any:\n    def __eq__(self, other):\n        return True\n"
                            "    def __ne__(self, other):\n        return False\n"
                            "def add(a, b):\n    return Any()", asserts("assert add(1, 2) == 3"), None),
    "always-equal int": ("class Int(int):\n    def __eq__(self, other):\n        return True\n"
                         "def add(a, b):\n    return Int(0)", asserts("assert add(1, 2) == 3"), None),
    "always-equal in a list": ("class Any:\n    def __eq__(self, other):\n        return True\n"
                               "def pair(a):\n    return [Any(), Any()]", asserts("assert pair(1) == [1, 2]"),
                               None),
    "truthy object": ("class Yes:\n    def __bool__(self):\n        return True\n"
                      "def is_prime(n):\n    return Yes()", asserts("assert is_prime(7)"),
                      None),
    "patched builtin": ("import builtins\nbuiltins.sorted = lambda *a, **k: [1, 2, 3]\n"
                        "def items():\n    return [3]", asserts("assert sorted(items()) == [1, 2, 3]"), None),
    "patched Counter": ("import collections\ncollections.Counter.__eq__ = lambda self, other: True\n"
                        "def count(s):\n    return collections.Counter()",
                        asserts("assert count('ab') == {'a': 1, 'b': 1}"), None),
    "closes stdout and stderr": ("import os\nos.close(1)\nos.close(2)\ndef add(a, b):\n    return 0",
                                 asserts("assert add(1, 2) == 3"), None),
    "closes stdout before printing": ("import os\nos.close(1)\nprint(3)", stdio(["1 2"], ["3"]), None),
    "closes every descriptor": ("import os\nos.closerange(0, 256)\nos._exit(0)",
                                asserts("assert add(1, 2) == 3"), None),
    "kills its parent and everyone": ("import os, signal\nos.kill(os.getppid(), signal.SIGKILL)\n"
                                      "os.kill(-1, signal.SIGKILL)\nos._exit(0)",
                                      asserts("assert add(1, 2) == 3"), None),
}


@pytest.fixture
def pool(sandbox):
    options = Config(timeout_s=2.0, program_timeout_s=6.0).reward_options()
    with RewardPool("code", workers=1, timeout_s=10.0, options=options) as pool:
        yield pool


@pytest.mark.parametrize("name", HOSTILE)
def test_hostile_program_scores_zero_and_leaves_nothing(pool, name):
    program, reference, killed = HOSTILE[name]
    tmp_before = set(os.listdir(tempfile.gettempdir()))
    counts_before = dict(pool.counts)
    start = time.monotonic()
    assert pool.score([reply(program)], [reference]) == [0.0]
    assert time.monotonic() - start < 6.0 + 2.0  # the program's own budget, plus the sandbox's start-up
    assert (pool.timeouts, pool.errors) == (0, 0)  # the sandbox ended it, not the pool's hard timeout
    if killed:
        key = f"sandbox_kills_{killed}"
        assert pool.counts[key] == counts_before.get(key, 0) + 1
    assert set(os.listdir(tempfile.gettempdir())) <= tmp_before
    assert pool.score([reply(ADD)], [asserts("assert add(1, 2) == 3")]) == [1.0]


@pytest.mark.parametrize("name", ["exits before the asserts", "_exit before the asserts",
                                  "always-equal object", "always-equal int", "always-equal in a list",
                                  "truthy object", "patched builtin", "patched Counter"])
def test_those_hacks_pass_a_naive_harness(name, tmp_path):
    """What the marker and the value checks are for: run as program + asserts, judged by the exit code, each
    of these would count as a pass."""
    import subprocess
    import sys

    program, reference, _ = HOSTILE[name]
    script = tmp_path / "naive.py"
    script.write_text(program + "\n" + "\n".join(json.loads(reference)["tests"]) + "\n")
    assert subprocess.run([sys.executable, str(script)], capture_output=True, timeout=30).returncode == 0


def test_no_network(pool):
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    threading.Thread(target=lambda: server.accept()[0].sendall(b"42"), daemon=True).start()
    program = ("import socket\ndef answer():\n"
               f"    return int(socket.create_connection(('127.0.0.1', {port}), "
               "timeout=1).recv(2))")
    try:
        assert pool.score([reply(program)], [asserts("assert answer() == 42")]) == [0.0]
        # the same program outside the sandbox would pass: the test can fail
        scope = {}
        exec(program, scope)  # noqa: S102 - the test's own program, not model output
        assert scope["answer"]() == 42
    finally:
        server.close()


def test_no_view_of_the_repository_the_home_directory_or_other_processes(pool):
    with open(os.path.join(ROOT, "README.md")) as f:
        readme = f.read(40)
    folder, secret = _secret_home_file()
    try:
        readers = {
            "repository": (f"def peek():\n    return open({os.path.join(ROOT, 'README.md')!r}).read(40)",
                           f"assert peek() == {readme!r}"),
            "home": (f"def peek():\n    return open({secret!r}).read()", "assert peek() == 'home-secret'"),
            "host /proc": (f"def peek():\n    return open('/proc/{os.getpid()}/cmdline', 'rb').read()",
                           f"assert peek() == {open(f'/proc/{os.getpid()}/cmdline', 'rb').read()!r}"),
            "any pytest process": ("import os\ndef peek():\n    found = False\n"
                                   "    for p in os.listdir('/proc'):\n        try:\n"
                                   "            found |= b'pytest' in open(f'/proc/{p}/cmdline', 'rb')"
                                   ".read()\n        except OSError:\n            pass\n    return found",
                                   "assert peek() == True"),
        }
        for name, (program, test) in readers.items():
            scope = {}
            exec(program, scope)  # noqa: S102 - outside the sandbox each reader finds what it looks for
            exec(test, scope)  # noqa: S102
            assert pool.score([reply(program)], [asserts(test)]) == [0.0], name
    finally:
        os.remove(secret)
        os.rmdir(folder)


def test_no_writing_into_the_repository(pool):
    target = os.path.join(ROOT, f"escaped-{secrets.token_hex(4)}.txt")
    program = (f"try:\n    open({target!r}, 'w').write('x')\n    wrote = True\n"
               "except OSError:\n    wrote = False\n"
               "def escaped():\n    return wrote")
    assert pool.score([reply(program)], [asserts("assert escaped() == True")]) == [0.0]
    assert not os.path.exists(target)


def test_expected_outputs_never_enter_the_sandbox(pool):
    secret = f"expected-{secrets.token_hex(8)}"
    program = (
        "import os, sys\nfound = ''\n"
        "for fd in range(256):\n    try:\n        os.lseek(fd, 0, 0)\n        data = os.read(fd, 1 << 20)\n"
        "        found = found or next((w for w in data.decode(errors='ignore').split('\"') if w.startswith("
        "'expected-')), '')\n    except OSError:\n        pass\n"
        "for root, dirs, files in os.walk('/'):\n"
        "    dirs[:] = [d for d in dirs if root != '/' or d in ('tmp', 'proc')]\n"
        "    for name in files[:50]:\n        try:\n"
        "            text = open(os.path.join(root, name), errors='ignore')"
        ".read(1 << 16)\n        except OSError:\n            continue\n        if 'expected-' in text:\n"
        "            found = found or text[text.index('expected-'):][:25]\n"
        "found = found or os.environ.get('EXPECTED', '') or ' '.join(sys.argv)\nprint(found)")
    assert pool.score([reply(program)], [stdio(["x"], [secret])]) == [0.0]


def test_a_setsid_child_does_not_outlive_its_program(pool):
    tag = f"{61 + secrets.randbelow(1000) / 1000:.3f}"
    program = ("import os\nif os.fork() == 0:\n    os.setsid()\n"
               f"    os.execv('/bin/sleep', ['sleep', '{tag}'])\n"
               "import time\ntime.sleep(0.5)\ndef add(a, b):\n    return 0")
    assert pool.score([reply(program)], [asserts("assert add(1, 2) == 3")]) == [0.0]

    def sleepers():
        found = []
        for pid in filter(str.isdigit, os.listdir("/proc")):
            try:
                with open(f"/proc/{pid}/cmdline", "rb") as f:
                    if f.read().split(b"\0")[:2] == [b"sleep", tag.encode()]:
                        found.append(pid)
            except OSError:
                pass
        return found
    deadline = time.monotonic() + 2
    while sleepers() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert sleepers() == []


def test_missing_bubblewrap_is_a_one_line_error(monkeypatch):
    import rewards.sandbox as sandbox
    monkeypatch.setattr(sandbox.shutil, "which", lambda name: None)
    with pytest.raises(ValueError, match="apt-get install bubblewrap"):
        sandbox.Sandbox(sandbox.PROBE_LIMITS)


# The loader: every dataset shape becomes a prompt and a reference the reward scores.

SHAPES = {
    "mbpp full": ({"text": "Add two numbers.",
                   "test_list": ["assert add(1, 2) == 3", "assert add(0, 0) == 0"],
                   "test_setup_code": ""}, ADD, "assert add(1, 2) == 3"),
    "mbpp sanitized": ({"prompt": "Area of a circle.", "test_list": ["assert math.isclose(area(1), math.pi)"],
                        "test_imports": ["import math"]},
                       "import math\ndef area(r):\n    return math.pi * r * r", "area(1)"),
    "humaneval": ({"prompt": "from typing import List\n\ndef total(xs: List[int]) -> int:\n"
                             "    \"\"\"Sum.\"\"\"\n",
                   "test": "def check(candidate):\n    assert candidate([1, 2]) == 3\n"
                           "    assert candidate([]) == 0\n",
                   "entry_point": "total"}, "def total(xs: List[int]) -> int:\n    return sum(xs)",
                  "def total(xs: List[int]) -> int:"),
    "apps stdin": ({"question": "Sum the numbers.", "input_output": json.dumps(
        {"inputs": ["1 2\n", "3 4\n"], "outputs": ["3\n", "7\n"]})}, SUM_STDIN, "standard input"),
    "taco lines": ({"question": "Sum the numbers.",
                    "input_output": {"inputs": [["1", "2"]], "outputs": [["3"]]}},
                   SUM_STDIN, "standard input"),
    "apps call-based": ({"question": "Add.", "starter_code": "def add(a, b):", "input_output": json.dumps(
        {"fn_name": "add", "inputs": [[1, 2], [2, 2]], "outputs": [[3], 4]})}, ADD, "`add`"),
    "leetcode style": ({"question": "Add.", "starter_code": "class Solution:\n    def add(self, a, b):",
                        "input_output": json.dumps({"fn_name": "add", "inputs": [[1, 2]], "outputs": [3]})},
                       "class Solution:\n    def add(self, a, b):\n        return a + b", "class Solution"),
    "plain asserts": ({"question": "Add.", "tests": ["assert add(1, 2) == 3"], "setup": "import math"}, ADD,
                      "assert add(1, 2) == 3"),
    "plain stdin": ({"question": "Sum.", "inputs": ["1 2"], "outputs": ["3"]}, SUM_STDIN, "standard input"),
}


@pytest.mark.parametrize("shape", SHAPES)
def test_every_dataset_shape_loads_and_its_solution_scores_one(reward, shape):
    row, solution, shown = SHAPES[shape]
    ex = example("data.jsonl line 1", row)
    assert shown in ex.question and "```python" in ex.question
    assert reward(reply(solution), ex.answer) == 1.0
    assert reward(reply("def nothing():\n    pass"), ex.answer) == 0.0


@pytest.mark.parametrize("row, message", [
    ({"question": "x"}, "no test cases"),
    ({"text": "x", "test_list": []}, "non-empty list"),
    ({"question": "x", "inputs": ["1"], "outputs": ["1", "2"]}, "1 inputs but 2 outputs"),
    ({"question": "x", "input_output": "not json"}, "'input_output' must be JSON"),
    ({"input_output": "{}", "question": "x"}, "'input_output' must be JSON"),
    ({"tests": ["assert True"]}, "missing field 'question'"),
])
def test_malformed_rows_name_the_fields_expected(row, message):
    with pytest.raises(ValueError, match=message) as info:
        example("data.jsonl line 3", row)
    assert "data.jsonl line 3" in str(info.value) and "\n" not in str(info.value)


def test_max_cases_keeps_the_first_cases():
    ex = example("x", {"question": "q", "inputs": ["1", "2", "3"], "outputs": ["1", "2", "3"]}, max_cases=2)
    assert json.loads(ex.answer) == {"inputs": ["1", "2"], "outputs": ["1", "2"]}


def test_reward_options_reach_the_reward():
    options = Config(timeout_s=1.5, reward_mode="fraction").reward_options()
    built = CodeReward(**options)
    assert (built.mode, built.limits.timeout_s, built.program_timeout_s) == ("fraction", 1.5, 15.0)


# The task in a real run.

PROBLEMS = [
    {"text": f"Write a function add_{i} that adds {i} to a number.",
     "test_list": [f"assert add_{i}(1) == {i + 1}"]}
    for i in range(6)
] + [{"question": f"Print {i} times the input number.", "inputs": ["2\n"], "outputs": [f"{2 * i}\n"]}
     for i in range(4)]


def test_a_run_on_a_local_file_trains_and_writes_pass_at_1(sandbox, tiny_model_dir, tmp_path):
    data = tmp_path / "code.jsonl"
    data.write_text("\n".join(json.dumps(row) for row in PROBLEMS) + "\n")
    run_dir = tmp_path / "run"
    result = run_train(run_dir, f"model.path={tiny_model_dir}", "task=code", f"task.path={data}",
                       "task.test_size=3", "steps=2", *TINY)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(run_dir / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[-1]["eval_examples"] == 3 and 0.0 <= rows[-1]["eval_pass@1"] <= 1.0
    assert {"reward/sandbox_kills_time", "reward/sandbox_kills_memory", "reward/sandbox_kills_output"} \
        <= set(rows[-1])


def test_no_bubblewrap_stops_the_run_at_start_with_one_line(tmp_path):
    data = tmp_path / "code.jsonl"
    data.write_text("\n".join(json.dumps(row) for row in PROBLEMS) + "\n")
    import subprocess
    import sys

    from tests.helpers import train_cmd
    result = subprocess.run(train_cmd(tmp_path / "run", "task=code", f"task.path={data}"), cwd=ROOT,
                            capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, PATH="/nonexistent", RINGRL_CACHE=str(tmp_path / "cache")))
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.strip().splitlines() if line]
    assert len(lines) == 1 and "apt-get install bubblewrap" in lines[0], result.stderr
    # said before the embedded model's 20 s conversion, as on a new machine
    assert not (tmp_path / "cache").exists()
    assert sys.executable  # the launcher itself needs no PATH


def test_the_reward_timeout_must_cover_the_sandbox():
    from launch.config import compose, parse

    assert parse(compose(["task=code"])).reward.timeout_s == 20
    with pytest.raises(ValueError, match="'reward.timeout_s' must be >= 17 for task=code"):
        parse(compose(["task=code", "reward.timeout_s=5"]))
    assert parse(compose(["task=code", "reward.timeout_s=5",
                          "task.program_timeout_s=3"])).task.timeout_s == 3.0


def test_the_default_data_is_mbpp_sanitized_from_the_hub(sandbox, monkeypatch):
    import sys
    import types

    import tasks
    calls = []
    rows = [{"prompt": f"Add {i}.", "test_list": [f"assert add_{i}(0) == {i}"], "test_imports": []}
            for i in range(9)]

    def load_dataset(name, config):
        calls.append((name, config))
        return {"train": rows[:6], "test": rows[6:]}

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    task = tasks.get("code").build(Config(), seed=0)
    assert calls == [("google-research-datasets/mbpp", "sanitized")]
    assert (len(task.train), len(task.test), task.reward) == (6, 3, "code")
    assert "assert add_0(0) == 0" in task.train[0].question
