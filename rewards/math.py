"""Competition-math reward: 1 when the reply's last `\\boxed{...}` is equivalent to the reference, else 0.

Equivalence is decided by math-verify (LaTeX -> sympy, then numeric, symbolic, set and interval checks).
Only its LaTeX parser is used: its plain-expression parser hands text to sympy's `parse_expr`, which calls
Python's `eval`, and model output must never reach that. math-verify bounds its own work with SIGALRM, which
works only in a process's main thread and not inside long C calls: call this from `RewardPool` workers.
"""
import functools
import logging
import re
import threading

from math_verify import LatexExtractionConfig, parse, verify

TAIL_CHARS = 10_000  # answers sit at the end of a reply; this bounds the work on a megabyte of junk
MAX_ANSWER_CHARS = 1_000  # a real competition answer is short; longer ones are junk or an attack
PARSE_TIMEOUT_S = 1  # math-verify's own alarms (whole seconds); the pool's timeout is the hard limit
VERIFY_TIMEOUT_S = 1

_LATEX_ONLY = [LatexExtractionConfig(boxed_match_priority=0)]
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_INLINE_MATH = re.compile(r"\$([^$]{1,1000})\$")
_NUMBER = re.compile(r"-?\d+(?:\.\d+)?(?:/\d+)?")
# Markup that changes how an answer looks but never its value; removed before the cheap string match.
_COSMETIC = re.compile(r"\\left|\\right|\\!|\\,|\\;|\\ |\s|\\displaystyle|\^\{?\\circ\}?|\.$")

# On a timeout math-verify logs the whole input; for a megabyte of junk that is a megabyte per reply.
logging.getLogger("math_verify").setLevel(logging.CRITICAL)


def math_reward(completion: str, reference: str) -> float:
    pred = extract_answer(completion[-TAIL_CHARS:])
    gold = last_boxed(reference) or reference.strip()
    if not pred or len(pred) > MAX_ANSWER_CHARS:
        return 0.0
    if _normalize(pred) == _normalize(gold):
        return 1.0
    parse_s, verify_s = _timeouts()
    gold_parsed = _parse_reference(gold, parse_s)
    pred_parsed = parse(f"${pred}$", _LATEX_ONLY, parsing_timeout=parse_s)
    if not gold_parsed or not pred_parsed:
        return 0.0
    return float(verify(gold_parsed, pred_parsed, timeout_seconds=verify_s))


def extract_answer(text: str) -> str | None:
    """The last `\\boxed{...}`, else the last `$...$`, else the last number."""
    boxed = last_boxed(text)
    if boxed is not None:
        return boxed
    inline = None
    for inline in _INLINE_MATH.finditer(text):
        pass
    if inline is not None:
        return inline[1].strip()
    number = None
    for number in _NUMBER.finditer(text):
        pass
    return number[0] if number is not None else None


def last_boxed(text: str) -> str | None:
    """Content of the last `\\boxed{...}` whose braces balance, else None."""
    boxes = list(_BOXED.finditer(text))
    if not boxes:
        return None
    start = boxes[-1].end()
    depth = 1
    for i in range(start, min(len(text), start + MAX_ANSWER_CHARS + 1)):
        if text[i - 1] == "\\":  # an escaped brace (\{ of a set) neither opens nor closes
            continue
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i].strip()
    return None


def _normalize(answer: str) -> str:
    return _COSMETIC.sub("", answer).replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac")


def _timeouts() -> tuple[int | None, int | None]:
    # SIGALRM handlers can only be installed from the main thread; elsewhere (the in-process pool) run
    # without math-verify's alarms rather than fail on every reply.
    if threading.current_thread() is threading.main_thread():
        return PARSE_TIMEOUT_S, VERIFY_TIMEOUT_S
    return None, None


@functools.lru_cache(maxsize=1024)
def _parse_reference(gold: str, timeout_s: int | None):
    """A group's K replies share one reference: parse it once (sympy results are immutable)."""
    return parse(f"${gold}$", _LATEX_ONLY, parsing_timeout=timeout_s)


REWARD = math_reward  # what rewards.get_reward("math") returns (built with the task's options if a class)
