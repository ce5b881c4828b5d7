"""The tools a multi-turn episode lets the model call, and how a call is read out of the model's text.

    call = parse_call("Let me check. <calc>347*29</calc>", "tags")    # Call("calc", {"expression": "347*29"})
    box = Toolbox(("calc", "python"), python_limits=Limits(timeout_s=3, memory_mb=512, processes=8,
                                                           file_mb=4, output_kb=64))
    box.call(call)                                                    # "10063"

Two call formats: `tags` (`<calc>EXPR</calc>`, `<python>CODE</python>`), which any base model can learn, and
`hermes` (`<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, the arguments an object or, as OpenAI
writes them, a JSON string of one), what Qwen2.5-style chat templates emit when given `Toolbox.schemas()`; a
Hermes turn may hold several calls (`parse_calls`). Everything the model writes is untrusted: the calculator
parses arithmetic itself and never evaluates Python, and the python tool runs in the bubblewrap sandbox
(rewards/sandbox.py).
A failed call raises ToolError, whose one-line message the episode shows the model as the tool's answer.
"""
import json
import math
import operator
import re
import secrets
from dataclasses import dataclass
from fractions import Fraction

from registry import unknown
from rewards.sandbox import Job, Sandbox

FORMATS = ("tags", "hermes")
TAG_NAMES = ("calc", "python")  # every tool has its tag
ARGUMENT = {"calc": "expression", "python": "code"}  # the one argument each tool takes
HINT = {"calc": "the expression, e.g. (347 * 29) / 7", "python": "the program; print the values you need"}
MAX_LENGTH, MAX_DEPTH, MAX_DIGITS = 200, 20, 1000
LIMIT = 10 ** MAX_DIGITS
MAX_MESSAGE = 300  # characters of a program's error shown back to the model


class ToolError(Exception):
    """A tool call that failed; str(error) is a short one-line message shown to the model as the tool's
    answer. kind: "parse" (the call itself is malformed), "unknown" (no such tool), "error" (the tool ran and
    failed), "timeout" (the tool ran out of time)."""

    def __init__(self, kind: str, message: str):
        assert kind in ("parse", "unknown", "error", "timeout"), kind
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class Call:
    name: str
    arguments: dict


def stop_strings(fmt: str) -> tuple[str, ...]:
    """The strings that end a model's turn in this call format: generation stops where a call is complete."""
    if fmt == "tags":
        return tuple(f"</{name}>" for name in TAG_NAMES)
    if fmt == "hermes":
        return ("</tool_call>",)
    raise unknown("tool call format", fmt, FORMATS)


def parse_call(text: str, fmt: str) -> Call | None:
    """The first tool call in a model turn's text; None when the turn calls no tool (a final answer)."""
    calls = parse_calls(text, fmt)
    return calls[0] if calls else None


def parse_calls(text: str, fmt: str) -> list[Call]:
    """The tool calls in a model turn's text, in order; [] when the turn calls no tool (a final answer). Tags:
    the first call only, and text after its closing tag is ignored (the tool answers the call, not what the
    model imagined came next). Hermes: every well-formed `<tool_call>` block; one that is not (a tag
    mentioned in prose, JSON that does not parse) is passed over when a well-formed one follows or precedes
    it, else it is the turn's parse error."""
    if fmt == "tags":
        found = {name: text.find(f"<{name}>") for name in TAG_NAMES if f"<{name}>" in text}
        if not found:
            return []
        name = min(found, key=found.get)
        start = found[name] + len(f"<{name}>")
        end = text.find(f"</{name}>", start)
        if end < 0:
            raise ToolError("parse", f"unclosed <{name}> tag: end the call with </{name}>")
        return [Call(name, {ARGUMENT[name]: text[start:end]})]
    if fmt == "hermes":
        return _hermes_calls(text)
    raise unknown("tool call format", fmt, FORMATS)


OPEN, CLOSE = "<tool_call>", "</tool_call>"


def _hermes_calls(text: str) -> list[Call]:
    calls, errors, position = [], [], 0
    while (end := text.find(CLOSE, position)) >= 0:
        start = text.rfind(OPEN, position, end)  # the last opening tag before it: earlier ones were prose
        if start >= 0:
            try:
                calls.append(_hermes_call(text[start + len(OPEN):end]))
            except ToolError as error:
                errors.append(error)
        position = end + len(CLOSE)
    if calls:
        return calls
    if errors:
        raise errors[0]
    if OPEN in text[position:]:
        raise ToolError("parse", "unclosed <tool_call>: end the call with </tool_call>")
    return []


def _hermes_call(body: str) -> Call:
    try:
        call = json.loads(body)
    except (ValueError, RecursionError) as e:  # ValueError: JSONDecodeError, or an int too long to read
        raise ToolError("parse", f"the tool call is not valid JSON ({str(e)[:100]})") from None
    if not isinstance(call, dict) or not isinstance(call.get("name"), str):
        raise ToolError("parse", 'a tool call is a JSON object {"name": ..., "arguments": {...}}')
    arguments = call.get("arguments")
    if isinstance(arguments, str):  # OpenAI's format: the arguments object as a JSON string
        try:
            arguments = json.loads(arguments)
        except (ValueError, RecursionError):
            arguments = None
    if not isinstance(arguments, dict):
        raise ToolError("parse", f"the call to '{call['name'][:50]}' needs \"arguments\" as a JSON object "
                        "(or a string of one)")
    return Call(call["name"], arguments)


class _Arithmetic:
    """A recursive-descent parser that computes as it reads, over exact fractions (floats only for a power
    with a fractional exponent). Every value is checked as it is made, so hostile input fails in microseconds.

        expr  := term (("+" | "-") term)*          term  := unary (("*" | "/" | "//" | "%") unary)*
        unary := ("-" | "+") unary | power          power := atom ("**" unary)?
        atom  := NUMBER | "(" expr ")"
    """
    TOKEN = re.compile(r"\s*(?:(\d+\.?\d*|\.\d+)|(\*\*|//|[-+*/%()]))")

    def __init__(self, expression: str):
        self.tokens, self.i = [], 0
        position, end = 0, len(expression.rstrip())
        while position < end:
            match = self.TOKEN.match(expression, position)
            if match is None:
                rest = expression[position:].lstrip()
                hint = "; write powers as **" if rest.startswith("^") else ""
                raise ToolError("error", f"not arithmetic at {rest[:20]!r}: "
                                f"use numbers, + - * / // % ** and ( ){hint}")
            self.tokens.append(match.group(1) or match.group(2))
            position = match.end()

    def value(self):
        result = self.expr(0)
        if self.i < len(self.tokens):
            raise ToolError("error", f"unexpected {self.tokens[self.i]!r} after a complete expression")
        return result

    def expr(self, depth: int):
        value = self.term(depth)
        while self._peek() in ("+", "-"):
            value = _apply(self._next(), value, self.term(depth))
        return value

    def term(self, depth: int):
        value = self.unary(depth)
        while self._peek() in ("*", "/", "//", "%"):
            value = _apply(self._next(), value, self.unary(depth))
        return value

    def unary(self, depth: int):
        if self._peek() not in ("-", "+"):
            return self.power(depth)
        sign, value = self._next(), self.unary(_deeper(depth))
        return -value if sign == "-" else value

    def power(self, depth: int):
        base = self.atom(depth)
        if self._peek() != "**":
            return base
        self._next()
        return _apply("**", base, self.unary(_deeper(depth)))

    def atom(self, depth: int):
        token = self._next()
        if token is not None and token[0] in "0123456789.":
            return _bounded(Fraction(token))
        if token != "(":
            raise ToolError("error",
                            f"expected a number or ( but found {repr(token) if token else 'the end'}")
        value = self.expr(_deeper(depth))
        if self._next() != ")":
            raise ToolError("error", "unbalanced parentheses: a ( is never closed")
        return value

    def _peek(self):
        return self.tokens[self.i] if self.i < len(self.tokens) else None

    def _next(self):
        token = self._peek()
        self.i += 1
        return token


def _deeper(depth: int) -> int:
    if depth >= MAX_DEPTH:
        raise ToolError("error", f"expression nested deeper than {MAX_DEPTH} levels")
    return depth + 1


OPERATIONS = {"+": operator.add, "-": operator.sub, "*": operator.mul, "/": operator.truediv,
              "//": operator.floordiv, "%": operator.mod, "**": operator.pow}


def _apply(op: str, a, b):
    """a op b, with every result checked, and a power refused before it is computed when its result would be
    too long to write out (exponent * log10(base) digits)."""
    if op == "**" and isinstance(a, Fraction) and isinstance(b, Fraction) and b.denominator == 1:
        size = max(abs(a.numerator), a.denominator)
        if size > 1 and (abs(b.numerator) > 10 * MAX_DIGITS
                         or abs(b.numerator) * math.log10(size) > MAX_DIGITS):
            raise ToolError("error",
                            f"the power is too large: its result would have over {MAX_DIGITS} digits")
    try:
        value = OPERATIONS[op](a, b)
    except ZeroDivisionError:
        raise ToolError("error", "division by zero") from None
    except OverflowError:
        raise ToolError("error", "the result is too large") from None
    if isinstance(value, complex):
        raise ToolError("error", "the result is not a real number (a negative number to a fractional power)")
    return _bounded(value)


def _bounded(value):
    if isinstance(value, float):
        if not math.isfinite(value):
            raise ToolError("error", "the result is too large")
    elif abs(value.numerator) > LIMIT or value.denominator > LIMIT:
        raise ToolError("error", f"a number in the calculation has over {MAX_DIGITS} digits")
    return value


def calculate(expression: str) -> str:
    """Evaluate arithmetic without eval: an exact integer when the result is integral, else a decimal rounded
    to 6 places, or below 1e-4 to 6 significant digits (0.00000333333; past 20 places as digits / 10**k).
    Everything it prints it reads back as that value. Anything that is not arithmetic is a ToolError."""
    if len(expression) > MAX_LENGTH:
        raise ToolError("error", f"expression longer than {MAX_LENGTH} characters; split the calculation")
    if not expression.strip():
        raise ToolError("error", "empty expression")
    value = _Arithmetic(expression).value()
    value = Fraction(value) if isinstance(value, float) else value
    if value.denominator == 1:
        return str(value.numerator)
    sign, value = "-" if value < 0 else "", abs(value)
    if value >= Fraction(1, 10 ** 4):
        whole, part = divmod(round(value * 10 ** 6), 10 ** 6)
        return sign + f"{whole}.{part:06d}".rstrip("0").rstrip(".")
    places = len(str(value.denominator)) - len(str(value.numerator)) + 5  # 6 significant digits, about
    while value * 10 ** places < 10 ** 5:
        places += 1
    while value * 10 ** places >= 10 ** 6:
        places -= 1
    digits = round(value * 10 ** places)
    while digits % 10 == 0:
        digits, places = digits // 10, places - 1
    if places <= 20:
        return sign + "0." + str(digits).zfill(places)
    return f"{sign}{digits}/10**{places}"


class Toolbox:
    """The tools one environment offers. names: a subset of TAG_NAMES; python_limits (rewards.sandbox.Limits):
    the python tool's limits, required when it is offered."""

    def __init__(self, names: tuple[str, ...], python_limits=None):
        for name in names:
            if name not in TAG_NAMES:
                raise unknown("tool", name, TAG_NAMES)
        if "python" in names and python_limits is None:
            raise ValueError("the python tool needs python_limits (a rewards.sandbox.Limits); "
                             "set them or drop it")
        self.names, self.limits = tuple(names), python_limits
        self.sandbox = Sandbox(python_limits) if "python" in names else None

    def call(self, call: Call) -> str:
        """Run a call; return the tool's text answer, or raise ToolError."""
        if call.name not in self.names:
            raise ToolError("unknown", f"unknown tool '{call.name[:50]}' (tools: {', '.join(self.names)})")
        argument = ARGUMENT[call.name]
        if not isinstance(call.arguments.get(argument), str):
            raise ToolError("parse", f"{call.name} needs the argument \"{argument}\", a string")
        if call.name == "calc":
            return calculate(call.arguments[argument])
        return self._python(call.arguments[argument])

    def _python(self, code: str) -> str:
        tag = secrets.token_hex(8)
        run = self.sandbox.run([Job(program=_reporting(code, tag))])[0]
        limits = self.limits
        if run.killed == "time":
            raise ToolError("timeout", f"the program ran longer than {limits.timeout_s:g} s and was stopped")
        if run.killed == "memory":
            raise ToolError("error", f"MemoryError: the program used more than {limits.memory_mb} MB")
        if run.killed == "output":
            raise ToolError("error", f"the program printed more than {limits.output_kb} KB and was stopped")
        if not run.passed[0]:
            lines = [line[len(tag):] for line in run.stderr.splitlines() if line.startswith(tag)]
            raise ToolError("error", (lines[-1] if lines else "the program failed")[:MAX_MESSAGE])
        return run.stdout

    def schemas(self) -> list[dict]:
        """JSON-schema tool descriptions in the OpenAI/Hermes form, for
        apply_chat_template(..., tools=...)."""
        return [{"type": "function", "function": {
            "name": name, "description": self._description(name),
            "parameters": {"type": "object", "required": [ARGUMENT[name]],
                           "properties": {ARGUMENT[name]: {"type": "string", "description": HINT[name]}}}}}
            for name in self.names]

    def _description(self, name: str) -> str:
        if name == "calc":
            return "Evaluate an arithmetic expression exactly: numbers, + - * / // % ** and parentheses."
        return (f"Run a Python program (standard library only, no files or network, at most "
                f"{self.limits.timeout_s:g} s) and return what it prints.")


def _reporting(code: str, tag: str) -> str:
    """The program wrapped so that an exception's last line reaches stderr after `tag`: the sandbox's runner
    swallows a stdin/stdout program's exceptions and reports only that it failed. A clean exit and MemoryError
    (the runner reports that one itself) pass through as they are."""
    return f"""
def __ringrl_tool(write=__import__("os").write):
    try:
        exec(compile({code!r}, "<python>", "exec"), {{"__name__": "__main__"}})
    except BaseException as e:
        if not isinstance(e, MemoryError) and not (isinstance(e, SystemExit) and e.code in (None, 0)):
            text = " ".join(str(e).split())
            write(2, ("\\n{tag}" + type(e).__name__ + (": " + text if text else "") + "\\n").encode(errors="replace"))
        raise
__ringrl_tool()
"""  # noqa: E501
