"""Code reward: run the reply's last fenced Python block against the reference's cases in the sandbox.

`reference` is JSON, in one of two shapes (tasks/code.py writes them; anyone may call this directly):
  - function + asserts: {"tests": ["assert f(1) == 2", ...], "setup": "optional code run first"}. The
    program and its asserts share one sandboxed run; each assert is a case.
  - stdin/stdout: {"inputs": ["1 2\\n", ...], "outputs": ["3\\n", ...]}. One run per case, up to
    `parallel_cases` at a time; the output is compared with trailing whitespace normalised (each line's, and
    trailing blank lines), outside the sandbox.
The score is 1 when every case passes (`mode="all"`) or the fraction passed (`mode="fraction"`); a reply with
no code block scores 0. A reference that is not one of these shapes raises ValueError (the reward pool counts
it in `reward/errors`). Runs that a limit ended are counted by reason, for `reward/sandbox_kills_*`.
"""
import collections
import json
import re
import time

from rewards.sandbox import Job, Limits, Sandbox

_FENCE = re.compile(r"```[ \t]*([A-Za-z0-9_+-]*)[^\n]*\n(.*?)(?:```|\Z)", re.S)
KILL_REASONS = ("time", "memory", "output")


class CodeReward:
    def __init__(self, mode: str, parallel_cases: int, program_timeout_s: float, timeout_s: float,
                 memory_mb: int, processes: int, file_mb: int, output_kb: int, isolate: bool = True):
        """The values are task=code's schema (tasks/code.py `Config.reward_options()`); isolate=False runs
        without the container, for bench/sandbox.py's baseline only."""
        if mode not in ("all", "fraction"):
            raise ValueError(f"code reward mode must be 'all' or 'fraction' (got {mode!r})")
        self.mode, self.parallel, self.program_timeout_s = mode, parallel_cases, program_timeout_s
        self.limits = Limits(timeout_s, memory_mb, processes, file_mb, output_kb)
        self.isolate = isolate
        # built at the first call: building the reward in the owner stays cheap
        self._box: Sandbox | None = None
        self._kills: collections.Counter = collections.Counter()

    def __call__(self, completion: str, reference: str) -> float:
        setup, tests, inputs, outputs = parse_reference(reference)
        program = extract_program(completion)
        if program is None:
            return 0.0
        if self._box is None:
            self._box = Sandbox(self.limits, self.isolate)
        deadline = time.monotonic() + self.program_timeout_s
        if tests is not None:
            runs = self._box.run([Job(program, setup, tuple(tests))], deadline=deadline)
            passed = runs[0].passed
        else:
            runs = self._box.run([Job(program, setup, stdin=x) for x in inputs], self.parallel, deadline)
            passed = [run.passed[0] and _normalise(run.stdout) == _normalise(want)
                      for run, want in zip(runs, outputs)]
        self._kills.update(run.killed for run in runs if run.killed)
        if self.mode == "all":
            return float(all(passed))
        return sum(passed) / len(passed)

    def take_counts(self) -> dict[str, int]:
        """Runs killed since the last call, by reason: {"sandbox_kills_time": 1, ...} (the reward pool
        asks)."""
        counts = {f"sandbox_kills_{reason}": self._kills[reason]
                  for reason in KILL_REASONS if self._kills[reason]}
        self._kills.clear()
        return counts


def extract_program(completion: str) -> str | None:
    """The last fenced code block (an unclosed last one counts: the reply may have hit its token budget)."""
    blocks = [code for lang, code in _FENCE.findall(completion)
              if lang.lower() in ("", "python", "py", "python3")]
    return blocks[-1] if blocks and blocks[-1].strip() else None


def parse_reference(reference: str) -> tuple[str, list[str] | None, list[str] | None, list[str] | None]:
    """(setup, tests, inputs, outputs) of a reference; one of tests and inputs is None."""
    try:
        ref = json.loads(reference)
    except (TypeError, json.JSONDecodeError):
        raise ValueError("a code reference must be JSON: {\"tests\": [...]} or {\"inputs\": [...], "
                         "\"outputs\": [...]}") from None
    if not isinstance(ref, dict):
        raise ValueError("a code reference must be a JSON object with 'tests', or 'inputs' and 'outputs'")
    setup = ref.get("setup", "")
    if not isinstance(setup, str):
        raise ValueError("a code reference's 'setup' must be a string of code")
    if "tests" in ref:
        tests = _strings(ref["tests"], "tests")
        for test in tests:
            try:
                # compiling trusted text runs nothing; a bad case is the data's fault
                compile(test, "<test>", "exec")
            except SyntaxError as e:
                raise ValueError(f"a code reference's test does not parse ({e.msg}): {test[:60]!r}") from None
        return setup, tests, None, None
    inputs, outputs = _strings(ref.get("inputs"), "inputs"), _strings(ref.get("outputs"), "outputs")
    if len(inputs) != len(outputs):
        raise ValueError(f"a code reference has {len(inputs)} inputs but {len(outputs)} outputs")
    return setup, None, inputs, outputs


def _strings(value, key: str) -> list[str]:
    if not isinstance(value, list) or not value or not all(isinstance(x, str) for x in value):
        raise ValueError(f"a code reference's '{key}' must be a non-empty list of strings")
    return value


def _normalise(text: str) -> str:
    return "\n".join(line.rstrip() for line in text.rstrip().splitlines())


REWARD = CodeReward  # what rewards.get_reward("code") returns (built with the task's options if a class)
