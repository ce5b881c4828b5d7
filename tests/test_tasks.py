"""Dataset tasks (GSM8K, MATH): local JSONL/parquet files and folders, splits, one-line errors, rewards."""
import json
import os
import sys
import types

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

import tasks
from rewards import get_reward

HENDRYCKS = "EleutherAI/hendrycks_math"
GSM8K = [{"question": f"Tom has {i} apples and buys {i} more. How many?",
          "answer": f"{i}+{i}=<<{i}+{i}={2 * i}>>"
                    f"{2 * i}\n#### {2 * i}"} for i in range(10)]
MATH = [{"problem": f"Compute $\\frac{{{i}}}{{2}}$.", "level": f"Level {i % 5 + 1}",
         "type": "Number Theory" if i % 2 else "Counting & Probability",
         "solution": f"Halve it: $\\boxed{{\\frac{{{i}}}{{2}}}}$."} for i in range(1, 9)]


def write_jsonl(path, rows):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path, "w") as f:
        f.writelines(json.dumps(row) + "\n" for row in rows)
    return str(path)


def write_parquet(path, rows):
    os.makedirs(os.path.dirname(path), exist_ok=True)
    pq.write_table(pa.Table.from_pylist(rows), path)
    return str(path)


def build(name, seed=0, **knobs):
    module = tasks.get(name)
    cfg = module.Config(**knobs)
    cfg.check()
    return module.build(cfg, seed)


def ids(examples):
    """The i of each GSM8K example ("Tom has i apples"); rows are written in increasing i."""
    return [int(ex.question.split()[2]) for ex in examples]


def test_gsm8k_jsonl_holds_out_a_test_split_chosen_by_the_seed(tmp_path):
    path = write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K)
    task = build("gsm8k", path=path, test_size=3)
    assert (len(task.train), len(task.test), task.reward) == (7, 3, "gsm8k")
    assert sorted(ids(task.train + task.test)) == list(range(10)) and ids(task.test) == sorted(ids(task.test))
    assert all(ex.question.endswith("'#### <number>'.") and ex.answer == GSM8K[i]["answer"]
               for ex, i in zip(task.train + task.test, ids(task.train + task.test)))
    assert build("gsm8k", path=path, test_size=3) == task
    assert any(build("gsm8k", seed, path=path, test_size=3).test != task.test for seed in range(1, 6))


def test_gsm8k_folder_of_train_and_test_jsonl_reads_main_only_and_subsamples(tmp_path):
    write_jsonl(tmp_path / "main" / "train.jsonl", GSM8K[:6])
    write_jsonl(tmp_path / "main" / "test.jsonl", GSM8K[6:])
    write_jsonl(tmp_path / "socratic" / "train.jsonl", [{"question": "other", "answer": "#### 1"}])
    task = build("gsm8k", path=str(tmp_path), test_size=100)  # a test split exists: test_size is unused
    assert (ids(task.train), ids(task.test)) == ([0, 1, 2, 3, 4, 5], [6, 7, 8, 9])
    task = build("gsm8k", path=str(tmp_path), max_train=4, max_test=2)
    assert (len(task.train), len(task.test)) == (4, 2) and ids(task.train) == sorted(ids(task.train))
    assert set(ids(task.train)) < set(range(6)) and set(ids(task.test)) < {6, 7, 8, 9}


def test_gsm8k_parquet_file_and_hub_layout_folder(tmp_path):
    write_parquet(tmp_path / "main" / "train-00000-of-00001.parquet", GSM8K[:7])
    write_parquet(tmp_path / "main" / "test-00000-of-00001.parquet", GSM8K[7:])
    task = build("gsm8k", path=str(tmp_path))
    assert (ids(task.train), ids(task.test)) == ([0, 1, 2, 3, 4, 5, 6], [7, 8, 9])
    single = build("gsm8k", path=str(tmp_path / "main" / "train-00000-of-00001.parquet"), test_size=2)
    assert (len(single.train), len(single.test)) == (5, 2)


def test_math_jsonl_with_solution_or_answer_and_filters(tmp_path):
    task = build("math", path=write_jsonl(tmp_path / "math.jsonl", MATH), test_size=2)
    assert (len(task.train), len(task.test), task.reward) == (6, 2, "math")
    assert task.train[0].question.endswith("\\boxed{}.") and "\\boxed{" in task.train[0].answer
    rows = [{"problem": "What is 1 + 1?", "answer": "2"}, {"problem": "What is 2 + 2?", "answer": 4}]
    task = build("math", path=write_jsonl(tmp_path / "answers.jsonl", rows), test_size=1)
    assert sorted(ex.answer for ex in task.train + task.test) == ["2", "4"]
    task = build("math", path=str(tmp_path / "math.jsonl"), test_size=1, levels=[2, 3],
                 subjects=["number_theory"])
    assert sorted(ex.answer for ex in task.train + task.test) == [MATH[0]["solution"], MATH[6]["solution"]]


def test_hub_loads_through_datasets_and_fails_in_one_line(monkeypatch):
    calls = []

    def load_dataset(name, config):
        calls.append((name, config))
        return {"train": MATH[:5], "test": MATH[5:]}

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    task = build("math")
    assert [config for _, config in calls] == list(tasks.get("math").SUBJECTS) and calls[0][0] == HENDRYCKS
    assert (len(task.train), len(task.test)) == (35, 21)
    calls.clear()
    task = build("math", subjects=["number_theory"])  # only the subject's config, then the filter on `type`
    assert calls == [(HENDRYCKS, "number_theory")] and (len(task.train), len(task.test)) == (3, 1)

    def offline(name, config):
        raise ConnectionError("no network\nretry later")

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=offline))
    with pytest.raises(ValueError) as error:
        build("gsm8k")
    assert "openai/gsm8k" in str(error.value) and "task.path=" in str(error.value)
    assert len(str(error.value).splitlines()) == 1


@pytest.mark.parametrize("task, name, content, expected", [
    ("gsm8k", "absent.jsonl", None, "does not exist"),
    ("gsm8k", "bad.jsonl", '{"question": "q", "answer": "#### 1"}\n{"question": oops}\n',
     "line 2 is not JSON"),
    ("gsm8k", "list.jsonl", "[1, 2]\n", "line 1 is not a JSON object"),
    ("gsm8k", "noanswer.jsonl", '{"question": "q"}\n', "line 1: missing field 'answer'"),
    ("gsm8k", "nohash.jsonl", '{"question": "q", "answer": "it is 5"}\n', "line 1: the answer has no '####"),
    ("gsm8k", "broken.parquet", "not parquet", "as parquet"),
    ("gsm8k", "train.parquet", [{"question": "q"}], "row 1: missing field 'answer'"),
    ("gsm8k", "data.csv", "question,answer\n", "neither .jsonl nor .parquet"),
    ("math", "nobox.jsonl", '{"problem": "p", "solution": "it is 5"}\n',
     "line 1: the solution has no \\boxed"),
    ("math", "noproblem.jsonl", '{"solution": "\\\\boxed{5}"}\n', "line 1: missing field 'problem'"),
])
def test_malformed_input_stops_with_one_line_naming_the_file(tmp_path, task, name, content, expected):
    path = tmp_path / name
    if isinstance(content, list):
        write_parquet(path, content)
    elif content is not None:
        path.write_text(content)
    with pytest.raises(ValueError) as error:
        build(task, path=str(path), test_size=0)
    assert expected in str(error.value) and name in str(error.value)
    assert len(str(error.value).splitlines()) == 1


def test_bad_folders_and_knobs_are_one_line_errors(tmp_path):
    (tmp_path / "empty").mkdir()
    with pytest.raises(ValueError, match=r"has no .jsonl or .parquet file with 'train'"):
        build("gsm8k", path=str(tmp_path / "empty"))
    with pytest.raises(ValueError, match=r"'task.test_size' must be < the 10 examples"):
        build("gsm8k", path=write_jsonl(tmp_path / "g.jsonl", GSM8K), test_size=10)
    for name, knobs, key in [("gsm8k", {"max_train": -1}, "task.max_train"),
                             ("math", {"levels": [6]}, "task.levels"),
                             ("math", {"subjects": ["biology"]}, "task.subjects")]:
        with pytest.raises(ValueError, match=f"config key '{key}'"):
            tasks.get(name).Config(**knobs).check()


def test_reward_of_a_loaded_example(tmp_path):
    task = build("gsm8k", path=write_jsonl(tmp_path / "g.jsonl", GSM8K), test_size=1)
    example = next(ex for ex in task.train + task.test if ids([ex]) == [3])
    score = get_reward("gsm8k")
    assert score("3 + 3 = 6.\n#### 6", example.answer) == 1.0 and score("#### 7", example.answer) == 0.0
    task = build("math", path=write_jsonl(tmp_path / "m.jsonl", MATH), test_size=1)
    example = next(ex for ex in task.train + task.test if ex.question.startswith("Compute $\\frac{1}{2}$"))
    score = get_reward("math")
    assert score("So it is \\boxed{\\frac{1}{2}}.", example.answer) == 1.0
    assert score("So it is \\boxed{\\frac{3}{2}}.", example.answer) == 0.0


@pytest.mark.parametrize("overrides, budget", [
    ([], 12), (["task=gsm8k"], 512), (["task=math"], 1024), (["task=preference"], 53), (["task=code"], 512),
    (["task=redteam"], 16),
    (["task=gsm8k", "rollout.max_new_tokens=64"], 64),  # the command line beats the task's budget
])
def test_a_task_sets_its_completion_budget(overrides, budget):
    from launch.config import compose

    cfg = compose(overrides)
    assert cfg.rollout.max_new_tokens == budget and cfg.rollout.group_size == 8


def test_arithmetic_takes_more_terms_and_products_and_keeps_its_default_questions():
    import random

    from tasks.arithmetic import Config, build

    default = build(Config(), seed=3)
    pairs = [(a, b) for a in range(10) for b in range(10)]  # the task's questions before task.terms
    random.Random(3).shuffle(pairs)
    assert [(e.question, e.answer) for e in default.test + default.train] == \
        [(f"What is {a} + {b}? Reply with just the number.", str(a + b)) for a, b in pairs]
    three = build(Config(terms=3, max_operand=5, test_size=10), seed=0)
    assert len(three.train) + len(three.test) == 6 ** 3
    for example in three.train[:20]:
        terms = [int(t) for t in example.question[len("What is "):].split("?")[0].split(" + ")]
        assert len(terms) == 3 and int(example.answer) == sum(terms)
    products = build(Config(op="*", max_operand=12), seed=0)
    for example in products.train[:20]:
        a, b = (int(t) for t in example.question[len("What is "):].split("?")[0].split(" * "))
        assert int(example.answer) == a * b
    for bad, match in [(dict(op="-"), "task.op"), (dict(terms=1), "task.terms"),
                       (dict(terms=6, max_operand=9), "makes 1000000 questions")]:
        with pytest.raises(ValueError, match=match):
            Config(**bad).check()
