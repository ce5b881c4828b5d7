"""Verifiers (GSM8K, competition math) and the reward pool that runs them on untrusted replies."""
import multiprocessing as mp
import os
import signal
import subprocess
import sys
import time

import pytest

from rewards import get_reward
from rewards.pool import RewardPool

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GSM8K_REFERENCE = ("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n"
                   "Natalia sold 48+24 = <<48+24=72>>72 clips altogether in April and May.\n#### 72")


@pytest.mark.parametrize("completion, reference, expected", [
    ("#### 72", GSM8K_REFERENCE, 1.0),
    ("She sold 48/2 = 24 in May, 48+24 = 72 in all.\n#### 72", GSM8K_REFERENCE, 1.0),
    ("#### 71", GSM8K_REFERENCE, 0.0),
    ("#### 72", "72", 1.0),
    ("\\boxed{18}", "18", 1.0),
    ("So she makes \\boxed{\\$18} every day.", "18", 1.0),
    ("\\boxed{18 \\text{ dollars}}", "18", 1.0),
    ("\\boxed{x = 5}", "5", 1.0),
    ("\\boxed{\\frac{3}{4}}", "0.75", 1.0),
    ("The answer is $1,234.00.", "1234", 1.0),
    ("The answer is 1234", "1,234", 1.0),
    ("The answer is 18.", "18", 1.0),
    ("The answer is **$18**.", "18", 1.0),
    ("The answer is \\(18\\).", "18", 1.0),
    ("the final answer is: 18", "18", 1.0),
    ("Answer: 18", "18", 1.0),
    ("A: 18", "18", 1.0),
    ("Answer: the total is 18", "18", 1.0),  # no number right after the phrase: the last number
    ("A: Natalia sold 48/2 = 24 clips in May, so 72 in total.", "72", 1.0),  # a few-shot "A:" is no answer
    ("She earns 18 dollars", "18", 1.0),
    ("The rope is 5 cm long.", "5", 1.0),
    ("It costs \u20ac20.", "20", 1.0),
    ("It costs \u00a37.50", "7.5", 1.0),
    ("Total: 1,000,000 people", "1000000", 1.0),
    ("The discount is 25%.", "25", 1.0),
    ("+7", "7", 1.0),
    ("The temperature drops to -5 degrees.", "-5", 1.0),
    ("The temperature drops to \u22125 degrees.", "-5", 1.0),
    ("The temperature drops to 5 degrees.", "-5", 0.0),
    ("-5", "5", 0.0),
    ("It takes 18-20 minutes", "20", 1.0),  # a binary minus is no sign
    ("3/4", "0.75", 1.0),
    ("0.75", "3/4", 1.0),
    ("The answer is 0.5", "1/2", 1.0),
    ("18.00", "18", 1.0),
    ("18.5", "18", 0.0),
    ("1,2,3", "3", 1.0),  # a list, not 123
    ("The answer is 18. Wait, no: the answer is 20.", "20", 1.0),
    ("I first got 18, but rechecking gives 20", "18", 0.0),  # a wrong number after the right one
    ("#### 18\nBut maybe 20", "18", 1.0),  # #### outranks the last number
    ("\\boxed{18} and then 20", "18", 1.0),  # \boxed outranks the last number
    ("The answer is 18, so \\boxed{20}", "18", 0.0),  # \boxed outranks "the answer is"
    ("5/0", "5", 0.0),
    ("I don't know.", "18", 0.0),
    ("", "18", 0.0),
    ("12", "no number here", 0.0),
])
def test_gsm8k(completion, reference, expected):
    assert get_reward("gsm8k")(completion, reference) == expected


def test_gsm8k_megabyte_of_digits_is_quick():
    reward = get_reward("gsm8k")
    start = time.perf_counter()
    assert reward("1" * 1_000_000, "1") == 0.0
    assert reward("x " * 500_000 + "#### 7", "7") == 1.0
    assert time.perf_counter() - start < 0.5


@pytest.mark.parametrize("completion, reference, expected", [
    ("\\boxed{0.5}", "\\frac{1}{2}", 1.0),
    ("The answer is $\\boxed{2\\sqrt{2}}$.", "\\sqrt{8}", 1.0),
    ("\\boxed{\\dfrac{1}{2}}", "Hence the answer is $\\boxed{\\frac{1}{2}}$.", 1.0),  # a full solution
    ("\\boxed{\\frac{\\pi}{2}}", "\\pi/2", 1.0),
    ("\\boxed{(x+1)^2}", "x^2+2x+1", 1.0),
    ("\\boxed{[1,2)}", "[1,2)", 1.0),
    ("\\boxed{(1,2]}", "[1,2)", 0.0),
    ("\\boxed{\\{3,2,1\\}}", "\\{1,2,3\\}", 1.0),
    ("First \\boxed{3}, then \\boxed{4}", "4", 1.0),
    ("\\boxed{3}", "4", 0.0),
    ("so we get $\\frac{3}{4}$", "0.75", 1.0),  # no box: the last $...$
    ("I think it is 7", "7", 1.0),  # no box, no $: the last number
    ("", "7", 0.0),
    ("\\boxed{", "7", 0.0),
])
def test_math(completion, reference, expected):
    assert get_reward("math")(completion, reference) == expected


def test_get_reward_names():
    assert get_reward("arithmetic")("so 12", "12") == 1.0
    with pytest.raises(ValueError, match="unknown reward"):
        get_reward("nope")


# Verifiers injected into the pool by their "module:function" path; spawned workers import this module.
def raising_verifier(completion, reference):
    raise ValueError("a broken verifier")


def hanging_verifier(completion, reference):
    if completion == "hang":
        time.sleep(60)
    if completion == "burn":  # busy in C, where no signal handler runs: only killing the process stops it
        sum(range(10**12))
    return float(completion == reference)


@pytest.fixture
def math_pool():
    with RewardPool("math", workers=1, timeout_s=2.0) as pool:
        yield pool


def _adversarial(touch_path):
    attack = f"__import__('os').system('touch {touch_path}')"
    return {
        "power tower": "\\boxed{9^{9^{9^{9}}}}",
        "python power": "9**9**9**9",
        "import": attack,
        "boxed import": f"\\boxed{{{attack}}}",
        "deep frac": "\\boxed{" + "\\frac{1}{" * 5000 + "2" + "}" * 5000 + "}",
        "frac the parser sees": "\\boxed{" + "\\frac{1}{" * 90 + "2" + "}" * 90 + "}",
        "megabyte": "9" * 1_000_000,
        "boxed megabyte": "\\boxed{" + "9" * 1_000_000 + "}",
        "unbalanced": "\\boxed{{{{{1}",
        "unbalanced close": "}}}}\\boxed{1}}}}",
        "lambda": f"(lambda: {attack})()",
        "boxed lambda": f"\\boxed{{(lambda: {attack})()}}",
        "dollar import": f"${attack}$",
        "exec": f'exec("{attack}")',
        "dunder walk": "\\boxed{().__class__.__bases__[0].__subclasses__()}",
        "text import": f"\\boxed{{\\text{{{attack}}}}}",
        "sympify bait": f"\\boxed{{Symbol('x').__class__.__init__.__globals__['os'].system("
                        f"'touch {touch_path}')}}",
    }


@pytest.mark.parametrize("name", list(_adversarial("x")))
def test_pool_survives_adversarial_math(math_pool, tmp_path, name):
    touched = tmp_path / "pwned"
    errors = math_pool.errors
    start = time.perf_counter()
    assert math_pool.score([_adversarial(touched)[name]], ["7"]) == [0.0]
    assert time.perf_counter() - start < math_pool.timeout_s + 3.0
    assert not touched.exists()
    assert math_pool.errors == errors  # math-verify turns its own failures into "not equal"
    assert math_pool.score(["\\boxed{7}"], ["7"]) == [1.0]


def test_pool_counts_errors():
    with RewardPool(f"{__name__}:raising_verifier", workers=1, timeout_s=5.0) as pool:
        assert pool.score(["1", "2"], ["1", "2"]) == [0.0, 0.0]
        assert (pool.errors, pool.timeouts) == (2, 0)


def test_pool_kills_a_hung_verifier_and_keeps_going():
    with RewardPool(f"{__name__}:hanging_verifier", workers=2, timeout_s=1.0) as pool:
        hung = {p.pid for p in mp.active_children()}
        start = time.perf_counter()
        handle = pool.submit(["hang", "burn", "ok", "no"], ["ok"] * 4)
        assert not handle.done()
        assert handle.result(timeout=10) == [0.0, 0.0, 1.0, 0.0]
        assert time.perf_counter() - start < 1.0 + 3.0
        assert (pool.timeouts, pool.errors) == (2, 0)
        assert pool.score(["ok"] * 4, ["ok"] * 4) == [1.0] * 4
        assert len(hung - {p.pid for p in mp.active_children()}) == 2  # both stuck workers were replaced


def test_in_process_pool():
    with RewardPool("gsm8k", workers=0, timeout_s=5.0) as pool:
        assert pool.score(["#### 72", "#### 7"], [GSM8K_REFERENCE] * 2) == [1.0, 0.0]
        assert pool.submit(["18 dollars"], ["18"]).result() == [1.0]
    pool = RewardPool(f"{__name__}:raising_verifier", workers=0, timeout_s=5.0)
    assert pool.score(["1"], ["1"]) == [0.0] and pool.errors == 1


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rpartition(")")[2].split()[0] != "Z"  # a zombie is dead, only not yet reaped
    except FileNotFoundError:
        return False


def test_close_leaves_no_child():
    before = {p.pid for p in mp.active_children()}
    with RewardPool("arithmetic", workers=2, timeout_s=5.0) as pool:
        workers = {p.pid for p in mp.active_children()} - before
        assert len(workers) == 2 and pool.score(["so 3"], ["3"]) == [1.0]
    assert not any(_alive(pid) for pid in workers)
    with pytest.raises(RuntimeError, match="closed"):
        pool.submit(["3"], ["3"])


def test_workers_die_with_their_owner(tmp_path):
    # The workers are busy in a hung verifier, so only PR_SET_PDEATHSIG can end them when the owner is killed.
    owner = ("import multiprocessing as mp, os, signal, time\n"
             "from rewards.pool import RewardPool\n"
             "pool = RewardPool('tests.test_rewards:hanging_verifier', workers=2, timeout_s=60)\n"
             "pool.submit(['hang', 'hang'], ['', ''])\n"
             "time.sleep(0.5)\n"
             "print(*[p.pid for p in mp.active_children()], flush=True)\n"
             "os.kill(os.getpid(), signal.SIGKILL)\n")
    # a file, not a pipe: a surviving worker would hold a pipe open
    with open(tmp_path / "pids", "w+") as out:
        subprocess.run([sys.executable, "-c", owner], cwd=REPO, stdout=out, timeout=60)
        out.seek(0)
        workers = [int(pid) for pid in out.read().split()]
    try:
        assert len(workers) == 2
        deadline = time.time() + 5
        while any(_alive(pid) for pid in workers) and time.time() < deadline:
            time.sleep(0.05)
        assert not any(_alive(pid) for pid in workers)
    finally:
        for pid in filter(_alive, workers):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.parametrize("verifier", ["gsm8k", "arithmetic", "math"])
def test_no_verifier_runs_model_output(verifier, tmp_path):
    """Code-injection strings scored directly by each verifier (in-process): nothing runs, each scores 0."""
    from rewards import get_reward

    touched = tmp_path / "pwned"
    score = get_reward(verifier)
    for name, text in _adversarial(touched).items():
        if "megabyte" in name or "power" in name or "frac" in name:
            continue  # size and time attacks are the pool's job (timeouts), tested above
        assert score(text, "7") == 0.0, name
    assert not touched.exists()
