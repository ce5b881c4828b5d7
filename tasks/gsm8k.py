"""GSM8K grade-school word problems, answered as `#### <number>` and scored by the "gsm8k" reward.

`task.path` empty downloads `openai/gsm8k` (config `main`) through `datasets`; otherwise it names a local
copy:
  - a JSONL file in GSM8K's format, one {"question": ..., "answer": "... #### 72"} per line;
  - a parquet file with those columns (the hub's main/train-*.parquet);
  - a folder whose .jsonl/.parquet files, at any depth, have "train" or "test" in their names (for a copy of
    the hub repository, its `main/` subfolder is read and `socratic/` ignored).
A single file, or a folder without test files, has no test split: `test_size` examples chosen by the seed are
held out. Examples keep the files' order; the seed only picks held-out and subsampled examples.
"""
import json
import os
import random
from dataclasses import dataclass

from registry import require
from tasks import Example, Task

HUB_ID, HUB_CONFIG = "openai/gsm8k", "main"
INSTRUCTION = "Reason briefly, then end with the final answer as '#### <number>'."
SUFFIXES = (".jsonl", ".parquet")


@dataclass
class Config:
    name: str = "gsm8k"
    path: str = ""  # local .jsonl/.parquet file or folder; empty: download openai/gsm8k (needs internet)
    max_train: int = 0  # training examples kept, chosen by the seed (0: all)
    max_test: int = 0  # test examples kept, chosen by the seed (0: all)
    test_size: int = 100  # examples held out as the test split when the data has none (a single file)

    def check(self):
        check_sizes(self)


def build(cfg: Config, seed: int) -> Task:
    if not cfg.path:
        train, test = read_hub(HUB_ID, [HUB_CONFIG])
    else:
        main = os.path.join(cfg.path, HUB_CONFIG)
        train, test = read_path(main if os.path.isdir(main) else cfg.path)
    train = [_example(where, row) for where, row in train]
    test = None if test is None else [_example(where, row) for where, row in test]
    train, test = choose(train, test, cfg, seed, cfg.path or HUB_ID)
    return Task(reward="gsm8k", train=train, test=test)


def _example(where: str, row: dict) -> Example:
    expected = "fields 'question' and 'answer'"
    question, answer = text(row, where, "question", expected), text(row, where, "answer", expected)
    if "####" not in answer:
        raise ValueError(f"{where}: the answer has no '#### <number>' (GSM8K answers end with '#### 72')")
    return Example(f"{question.strip()}\n{INSTRUCTION}", answer)


# The readers, shared with tasks/math.py. A row is (where, dict): `where` names its file and line for errors.

def check_sizes(cfg):
    for key in ("max_train", "max_test", "test_size"):
        require(getattr(cfg, key) >= 0, f"task.{key}", "must be >= 0", getattr(cfg, key))


def text(row: dict, where: str, key: str, expected: str) -> str:
    if key not in row:
        raise ValueError(f"{where}: missing field '{key}' (expected {expected})")
    value = row[key]
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        value = str(value)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"{where}: field '{key}' must be a non-empty string (got {value!r:.40})")
    return value


def read_hub(dataset: str, configs: list[str]) -> tuple[list, list]:
    try:
        import datasets
        parts = [datasets.load_dataset(dataset, config) for config in configs]
    except Exception as e:  # no internet, no `datasets`, a hub error: all are the user's to work around
        raise ValueError(f"could not load '{dataset}' from the hub ({first_line(e)}); "
                         "download the dataset and pass task.path=<file or folder>") from None
    return tuple([(f"{dataset} {split} row {i}", row)
                  for part in parts for i, row in enumerate(part[split], 1)]
                 for split in ("train", "test"))


def read_path(path: str) -> tuple[list, list | None]:
    """(train rows, test rows or None) from one file or a folder of train and test files."""
    if os.path.isfile(path):
        return read_file(path), None
    if not os.path.isdir(path):
        raise ValueError(f"task.path '{path}' does not exist; give a .jsonl or .parquet file or "
                         "a folder of them")
    files = sorted(os.path.join(root, name) for root, _, names in os.walk(path) for name in names
                   if name.endswith(SUFFIXES))
    train = [f for f in files if "train" in os.path.basename(f)]
    test = [f for f in files if "test" in os.path.basename(f)]
    if not train:
        raise ValueError(f"task.path folder '{path}' has no .jsonl or .parquet file with 'train' in its name")
    return [r for f in train for r in read_file(f)], [r for f in test for r in read_file(f)] if test else None


def read_file(file: str) -> list:
    if file.endswith(".parquet"):
        import pyarrow.parquet as pq
        try:
            return [(f"{file} row {i}", row) for i, row in enumerate(pq.read_table(file).to_pylist(), 1)]
        except Exception as e:
            # pyarrow raises OSError, ArrowInvalid (a ValueError) and others for a bad file
            raise ValueError(f"cannot read task.path file '{file}' as parquet ({first_line(e)})") from None
    if not file.endswith(".jsonl"):
        raise ValueError(f"task.path file '{file}' is neither .jsonl nor .parquet")
    rows = []
    try:
        with open(file, encoding="utf-8") as f:
            for n, line in enumerate(f, 1):
                if not line.strip():
                    continue
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{file} line {n} is not JSON ({e.msg}); expected "
                                     "one object per line") from None
                if not isinstance(row, dict):
                    raise ValueError(f"{file} line {n} is not a JSON object; expected one object per line")
                rows.append((f"{file} line {n}", row))
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"cannot read task.path file '{file}' ({first_line(e)}); "
                         "expected UTF-8 JSONL") from None
    return rows


def choose(train: list, test: list | None, cfg, seed: int, source: str) -> tuple[list, list]:
    """Hold out `cfg.test_size` examples if there is no test split, then subsample; file order is kept."""
    if not train:
        raise ValueError(f"'{source}' holds no training examples")
    rng = random.Random(seed)
    if test is None:
        if cfg.test_size >= len(train):
            raise ValueError(f"config key 'task.test_size' must be < the {len(train)} examples in '{source}' "
                             f"(got {cfg.test_size})")
        test, train = _pick(train, cfg.test_size, rng)
    return _pick(train, cfg.max_train or len(train), rng)[0], _pick(test, cfg.max_test or len(test), rng)[0]


def _pick(examples: list, k: int, rng: random.Random) -> tuple[list, list]:
    """(k examples chosen by `rng`, the others), both in their original order."""
    chosen = set(rng.sample(range(len(examples)), k)) if k < len(examples) else set(range(len(examples)))
    return ([x for i, x in enumerate(examples) if i in chosen],
            [x for i, x in enumerate(examples) if i not in chosen])


def first_line(e: Exception) -> str:
    return (str(e).strip().splitlines() or [type(e).__name__])[0]
