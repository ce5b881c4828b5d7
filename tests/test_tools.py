"""The tools of multi-turn episodes (envs/tools.py): the calculator's arithmetic and its refusals, reading
calls out of model text in both formats, and the python tool in the sandbox. Every input here plays the model:
hostile ones must fail fast, with the right kind of ToolError, and run nothing."""
import os
import time

import pytest

from envs.tools import Call, Toolbox, ToolError, calculate, parse_call, parse_calls, stop_strings
from rewards.sandbox import Limits
from tests.helpers import require_sandbox

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LIMITS = Limits(timeout_s=1, memory_mb=512, processes=8, file_mb=4, output_kb=64)


@pytest.mark.parametrize("expression, expected", [
    ("347*29", "10063"),
    ("2 + 3 * 4", "14"),
    ("(2 + 3) * 4", "20"),
    ("10 - 4 - 3", "3"),
    ("-3 + 5", "2"),
    ("--3", "3"),
    ("3 * -2", "-6"),
    ("-2**2", "-4"),
    ("2**3**2", "512"),
    ("2**10", "1024"),
    ("2**-2", "0.25"),
    ("6/3", "2"),
    ("1/3", "0.333333"),
    ("-1/3", "-0.333333"),
    ("0.1 + 0.2", "0.3"),
    ("1.5 * 2", "3"),
    ("7 // 2", "3"),
    ("-7 // 2", "-4"),
    ("7 % 3", "1"),
    ("-7 % 3", "2"),
    ("2**0.5", "1.414214"),
    ("99999999999999999999 / 3", "33333333333333333333"),
    ("1/100000", "0.00001"),
    ("1/300000", "0.00000333333"),
    ("-2/3 * 10**-7", "-0.0000000666667"),
    ("1/10**30", "1/10**30"),
    ("2**-80", "827181/10**30"),
    ("10**1000 // 10**999", "10"),
])
def test_the_calculator_computes_arithmetic(expression, expected):
    assert calculate(expression) == expected


@pytest.mark.parametrize("expression, message", [
    ("9**9**9**9", "power is too large"),
    ("2**100000", "power is too large"),
    ("10**999 * 10**999", "over 1000 digits"),
    ("(" * 30 + "1" + ")" * 30, "nested deeper"),
    ("-" * 30 + "1", "nested deeper"),
    ("2" + "**2" * 30, "nested deeper"),
    ("1" * 10000, "longer than 200"),
    ("1/0", "division by zero"),
    ("5 % (3-3)", "division by zero"),
    ("0**-1", "division by zero"),
    ("(-8)**(1/3)", "not a real number"),
    ("(10**500)**0.5", "too large"),
    ("2^3", "write powers as **"),
    ("x + 1", "not arithmetic"),
    ("abs(-3)", "not arithmetic"),
    ("'a' * 3", "not arithmetic"),
    ("(1).__class__", "not arithmetic"),
    ("lambda: 1", "not arithmetic"),
    ("__import__('os').system('true')", "not arithmetic"),
    ("(1 + 2", "never closed"),
    ("2(3)", "unexpected"),
    ("1 +", "found the end"),
    ("", "empty"),
])
def test_the_calculator_refuses_at_once(expression, message):
    start = time.perf_counter()
    with pytest.raises(ToolError) as error:
        calculate(expression)
    assert time.perf_counter() - start < 0.05
    assert error.value.kind == "error"
    assert message in str(error.value) and "\n" not in str(error.value)


def test_the_calculator_runs_nothing_it_reads(tmp_path):
    marker = tmp_path / "ran"
    for expression in (f"__import__('pathlib').Path({str(marker)!r}).touch()",
                       f"open({str(marker)!r}, 'w')",
                       f"[c for c in ().__class__.__base__.__subclasses__()] or open({str(marker)!r}, 'w')"):
        with pytest.raises(ToolError) as error:
            calculate(expression)
        assert error.value.kind == "error"
    assert not marker.exists()


@pytest.mark.parametrize("text, fmt, expected", [
    ("Let me check. <calc>347*29</calc>", "tags", Call("calc", {"expression": "347*29"})),
    ("<python>\nprint(1)\n</python>", "tags", Call("python", {"code": "\nprint(1)\n"})),
    ("<calc>1+1</calc> and then I guess <answer>2</answer>", "tags", Call("calc", {"expression": "1+1"})),
    ("<python>print(2)</python><calc>1+1</calc>", "tags", Call("python", {"code": "print(2)"})),
    ('<tool_call>\n{"name": "calc", "arguments": {"expression": "2*3"}}\n</tool_call> so it is 6',
     "hermes", Call("calc", {"expression": "2*3"})),
    ('<tool_call>{"name": "search", "arguments": {}}</tool_call>', "hermes", Call("search", {})),
    # OpenAI's format: the arguments as a JSON string
    ('<tool_call>{"name": "calc", "arguments": "{\\"expression\\": \\"2*3\\"}"}</tool_call>', "hermes",
     Call("calc", {"expression": "2*3"})),
    # a <tool_call> mentioned in prose, before or after the call
    ('I write <tool_call> tags. <tool_call>{"name": "calc", "arguments": {"expression": "1"}}</tool_call>',
     "hermes", Call("calc", {"expression": "1"})),
    ('<tool_call>{"name": "calc", "arguments": {"expression": "1"}}</tool_call> as a <tool_call> tag does',
     "hermes", Call("calc", {"expression": "1"})),
    ('a <tool_call> and its </tool_call> then <tool_call>{"name": "calc", "arguments": {"expression": "1"}}'
     "</tool_call>", "hermes", Call("calc", {"expression": "1"})),
])
def test_the_first_call_is_read_and_text_after_it_ignored(text, fmt, expected):
    assert parse_call(text, fmt) == expected


@pytest.mark.parametrize("text, fmt", [
    ("The answer is <answer>42</answer>.", "tags"),
    ("No tools needed: 42. </calc>", "tags"),
    ("The answer is 42.", "hermes"),
    ("<calc>6*7</calc>", "hermes"),
])
def test_a_turn_without_a_call_is_a_final_answer(text, fmt):
    assert parse_call(text, fmt) is None


@pytest.mark.parametrize("text, fmt, message", [
    ("Let me compute <calc>347*29", "tags", "unclosed <calc>"),
    ("<python>print(1)</calc>", "tags", "unclosed <python>"),
    ('<tool_call>{"name": "calc", "arguments": {"expression": "1"}}', "hermes", "unclosed <tool_call>"),
    ('<tool_call>{"name": "calc", "arguments": </tool_call>', "hermes", "not valid JSON"),
    ("<tool_call>" + "[" * 100000 + "</tool_call>", "hermes", "not valid JSON"),
    ('<tool_call>["calc", "1+1"]</tool_call>', "hermes", "JSON object"),
    ('<tool_call>{"arguments": {"expression": "1"}}</tool_call>', "hermes", "JSON object"),
    ('<tool_call>{"name": 3, "arguments": {}}</tool_call>', "hermes", "JSON object"),
    ('<tool_call>{"name": "calc"}</tool_call>', "hermes", '"arguments"'),
    ('<tool_call>{"name": "calc", "arguments": "1+1"}</tool_call>', "hermes", '"arguments"'),
    ('<tool_call>{"name": "calc", "arguments": "[1]"}</tool_call>', "hermes", '"arguments"'),
    ("I use <tool_call> tags, like <tool_call>this</tool_call>.", "hermes", "not valid JSON"),
])
def test_a_malformed_call_is_a_parse_error(text, fmt, message):
    with pytest.raises(ToolError) as error:
        parse_call(text, fmt)
    assert error.value.kind == "parse"
    assert message in str(error.value) and "\n" not in str(error.value)


def test_several_hermes_calls_in_one_turn_are_read_in_order():
    text = ('<tool_call>{"name": "calc", "arguments": {"expression": "1+1"}}</tool_call> and '
            '<tool_call>{"name": "calc", "arguments": "{\\"expression\\": \\"2*3\\"}"}</tool_call>')
    assert parse_calls(text, "hermes") == [Call("calc", {"expression": "1+1"}),
                                           Call("calc", {"expression": "2*3"})]
    assert parse_calls("<calc>1</calc><calc>2</calc>", "tags") == [Call("calc", {"expression": "1"})]
    assert parse_calls("42", "hermes") == []


def test_a_tool_env_answers_every_call_of_a_turn_in_one_observation_in_order():
    from envs.toolenv import ToolEnv

    env = ToolEnv(Toolbox(("calc",)), "hermes", score=lambda reply, answer: 0.0, prompt=lambda ex: [])
    step = env.step('<tool_call>{"name": "calc", "arguments": {"expression": "6*7"}}</tool_call>'
                    '<tool_call>{"name": "nope", "arguments": {}}</tool_call>'
                    '<tool_call>{"name": "calc", "arguments": "{\\"expression\\": \\"1/0\\"}"}</tool_call>')
    assert step.observation == ("42\nerror: unknown tool 'nope' (tools: calc)\nerror: division by zero")
    assert not step.done and step.info == {"tool_calls": 2, "unknown_tools": 1, "tool_errors": 1}


@pytest.mark.parametrize("expression", ["1/3", "-1/3", "2**0.5", "1/100000", "1/300000", "2/3 * 10**-7",
                                        "1/10**30", "2**-80", "1/7/10**25", "99999999999999999999 / 3",
                                        "0.1 + 0.2", "10**-20", "-3 * 10**-21", "1/99999", "1/100001"])
def test_the_calculator_reads_back_what_it_prints(expression):
    printed = calculate(expression)
    assert calculate(printed) == printed and "e" not in printed


def test_formats_name_their_stop_strings_and_refuse_unknown_ones():
    assert stop_strings("tags") == ("</calc>", "</python>")
    assert stop_strings("hermes") == ("</tool_call>",)
    for bad in (lambda: stop_strings("xml"), lambda: parse_call("<calc>1</calc>", "xml")):
        with pytest.raises(ValueError, match="tags, hermes"):
            bad()


def test_the_toolbox_refuses_unknown_tools_and_bad_arguments():
    with pytest.raises(ValueError, match="calc, python"):
        Toolbox(("calc", "search"))
    with pytest.raises(ValueError, match="python_limits"):
        Toolbox(("python",))
    box = Toolbox(("calc",))
    assert box.call(Call("calc", {"expression": "6*7"})) == "42"
    for call, kind, message in (
            (Call("python", {"code": "print(1)"}), "unknown", "unknown tool 'python' (tools: calc)"),
            (Call("calc", {}), "parse", '"expression"'),
            (Call("calc", {"expression": 42}), "parse", '"expression"'),
            (Call("calc", {"expression": "1/0"}), "error", "division by zero")):
        with pytest.raises(ToolError) as error:
            box.call(call)
        assert error.value.kind == kind and message in str(error.value)
    assert [s["function"]["name"] for s in box.schemas()] == ["calc"]
    assert box.schemas()[0]["function"]["parameters"]["required"] == ["expression"]


@pytest.fixture(scope="module")
def box():
    require_sandbox()
    return Toolbox(("calc", "python"), python_limits=LIMITS)


def test_the_python_tool_returns_what_the_program_prints(box):
    assert box.call(Call("python", {"code": "import math\nprint(math.comb(10, 3))\nprint('done')"})) \
        == "120\ndone\n"
    assert "1 s" in box.schemas()[1]["function"]["description"]


@pytest.mark.parametrize("code, kind, message", [
    ("print('partial')\nraise ValueError('bad input 42')", "error", "ValueError: bad input 42"),
    ("def f(:\n    pass", "error", "SyntaxError: invalid syntax"),
    ("import sys\nsys.exit(3)", "error", "SystemExit: 3"),
    ("x = bytearray(2 * 1024**3)", "error", "MemoryError"),
    ("while True:\n    print('x' * 1000)", "error", "more than 64 KB"),
    ("while True:\n    pass", "timeout", "longer than 1 s"),
])
def test_a_failing_program_answers_with_its_error(box, code, kind, message):
    start = time.monotonic()
    with pytest.raises(ToolError) as error:
        box.call(Call("python", {"code": code}))
    assert time.monotonic() - start < LIMITS.timeout_s + 1.0
    assert error.value.kind == kind
    assert message in str(error.value) and "\n" not in str(error.value)


def test_the_python_tool_reaches_neither_the_repository_nor_the_network(box):
    path = os.path.join(REPO, "pyproject.toml")
    assert os.path.exists(path)  # outside the sandbox the read below succeeds
    code = f"""
import socket
for what, attempt in (("repo", lambda: open({path!r}).read()),
                      ("net", lambda: socket.create_connection(("1.1.1.1", 53), timeout=0.5))):
    try:
        attempt()
        print(what, "reached")
    except OSError:
        print(what, "blocked")
"""
    assert box.call(Call("python", {"code": code})) == "repo blocked\nnet blocked\n"
