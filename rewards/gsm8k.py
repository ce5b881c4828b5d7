"""GSM8K reward: 1 when the reply's final number equals the reference's `#### N`, else 0.

The final answer is looked for in this order: `#### N`, `\\boxed{N}`, "the answer is N" / "Answer: N" /
"A: N", else the last number in the text. Numbers may carry thousands commas, a currency sign, a sign, a
percent sign or a unit after them, and may be decimals or fractions (3/4); they are compared as floats.
Model output is untrusted: only its tail is read, every regex runs in linear time, nothing is evaluated.
"""
import math
import re

TAIL_CHARS = 10_000  # final answers sit at the end; this bounds the work on a megabyte of junk
PHRASE_WINDOW = 40  # how far after "the answer is" its number may start
BOXED_CHARS = 200  # a boxed GSM8K answer is a number, maybe with a unit

# A sign only when it is not a binary minus ("18-20" is 20, not -20); then an optional currency sign;
# thousands groups ("1,234") before plain digits so that "1,2,3" stays three numbers; an optional fraction.
_NUMBER = re.compile(
    r"(?:(?<![\w)])(?P<sign>[-+\u2212]))?[$\u20ac\u00a3]?"
    r"(?P<num>(?:\d{1,3}(?:,\d{3})+|\d+)(?:\.\d+)?|\.\d+)"
    r"(?:[ \t]*/[ \t]*(?P<den>\d+(?:\.\d+)?))?"
)
_HASHES = re.compile(r"####")
_BOXED = re.compile(r"\\(?:boxed|fbox)\s*\{")
_FRAC = re.compile(r"\\[dt]?frac\{([^{}]{1,30})\}\{([^{}]{1,30})\}")
# "The answer is", "final answer is:", "Answer:", "answer =", or a few-shot "A:".
_PHRASE = re.compile(r"\b(?i:answer)\s{0,3}(?:(?i:is)\b\s{0,3}:?|[:=])|\bA\s?:")
# Between the phrase and its number only punctuation or markup may stand ("is **$18**", "is: -5").
_FILLER = re.compile(r"[^\w+\-\u2212.]{0,12}")


def gsm8k_reward(completion: str, reference: str) -> float:
    gold = reference_answer(reference)
    pred = final_answer(completion)
    if gold is None or pred is None:
        return 0.0
    return float(math.isclose(pred, gold, rel_tol=1e-6, abs_tol=1e-6))


def reference_answer(reference: str) -> float | None:
    """GSM8K's `answer` field (reasoning, then `#### N`) or a bare number."""
    marker = reference.rfind("####")
    return first_number(reference[marker + 4:] if marker >= 0 else reference)


def final_answer(completion: str) -> float | None:
    text = completion[-TAIL_CHARS:]
    for extract in (_after_hashes, _in_last_box, _after_answer_phrase):
        value = extract(text)
        if value is not None:
            return value
    return last_number(text)


def _after_hashes(text: str) -> float | None:
    hashes = list(_HASHES.finditer(text))
    return first_number(text[hashes[-1].end():hashes[-1].end() + PHRASE_WINDOW]) if hashes else None


def _in_last_box(text: str) -> float | None:
    boxes = list(_BOXED.finditer(text))
    if not boxes:
        return None
    content = _balanced(text, boxes[-1].end())
    if content is None:
        return None
    content = _FRAC.sub(r"\1/\2", content)
    return first_number(content.rpartition("=")[2])  # "\boxed{x = 5}" is 5


def _balanced(text: str, start: int) -> str | None:
    """The text from `start` to the brace that closes the one just before it, if within BOXED_CHARS."""
    depth = 1
    for i in range(start, min(len(text), start + BOXED_CHARS)):
        depth += {"{": 1, "}": -1}.get(text[i], 0)
        if depth == 0:
            return text[start:i]
    return None


def _after_answer_phrase(text: str) -> float | None:
    for phrase in reversed(list(_PHRASE.finditer(text))):
        window = text[phrase.end():phrase.end() + PHRASE_WINDOW]
        number = _NUMBER.match(window, _FILLER.match(window).end())
        if number:
            return _value(number)
    return None


def first_number(text: str) -> float | None:
    match = _NUMBER.search(text)
    return _value(match) if match else None


def last_number(text: str) -> float | None:
    match = None
    for match in _NUMBER.finditer(text):
        pass
    return _value(match) if match else None


def _value(match: re.Match) -> float | None:
    # float() of a digit string never raises (a huge one is inf); int() would refuse past 4300 digits
    value = float(match["num"].replace(",", ""))
    if match["den"] is not None:
        den = float(match["den"])
        if den == 0:
            return None
        value /= den
    if math.isinf(value) or math.isnan(value):
        return None
    return -value if match["sign"] in ("-", "\u2212") else value


REWARD = gsm8k_reward  # what rewards.get_reward("gsm8k") returns (built with the task's options if a class)
