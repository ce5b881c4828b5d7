"""Competition math (MATH, Hendrycks et al. 2021): the final answer goes in `\\boxed{}`, scored by the "math"
reward.

`task.path` empty downloads `EleutherAI/hendrycks_math` through `datasets`: one config per subject (those in
`task.subjects`, else all seven), each with train (7,500 in all) and test (5,000) splits and the fields
`problem`, `level` ("Level 3"), `type` ("Counting & Probability") and `solution` (ending in `\\boxed{...}`).
A local copy is read as in tasks/gsm8k.py: a .jsonl or .parquet file, or a folder of files with "train" and
"test" in their names (a copy of the hub repository works as is). A row needs `problem` and either `answer`
(preferred when present, as in HuggingFaceH4/MATH-500) or a `solution` holding a `\\boxed{...}`; the reward
takes the last box of a solution. The level filter reads `level`; the subject filter reads `type` or
`subject`.
"""
import re
from dataclasses import dataclass, field

from registry import require
from tasks import Example, Task
from tasks.gsm8k import check_sizes, choose, read_hub, read_path, text

HUB_ID = "EleutherAI/hendrycks_math"
SUBJECTS = ("algebra", "counting_and_probability", "geometry", "intermediate_algebra", "number_theory",
            "prealgebra", "precalculus")
INSTRUCTION = "Reason briefly, then put the final answer in \\boxed{}."


@dataclass
class Config:
    name: str = "math"
    # local .jsonl/.parquet file or folder; empty: download EleutherAI/hendrycks_math (internet)
    path: str = ""
    max_train: int = 0  # training examples kept, chosen by the seed (0: all)
    max_test: int = 0  # test examples kept, chosen by the seed (0: all)
    test_size: int = 100  # examples held out as the test split when the data has none (a single file)
    levels: list[int] = field(default_factory=list)  # keep only these difficulty levels, 1..5 (empty: all)
    subjects: list[str] = field(default_factory=list)  # keep only these subjects, e.g. [algebra] (empty: all)

    def check(self):
        check_sizes(self)
        require(isinstance(self.levels, list) and all(type(x) is int and 1 <= x <= 5 for x in self.levels),
                "task.levels", "must be a list of levels 1..5", self.levels)
        require(isinstance(self.subjects, list) and all(s in SUBJECTS for s in self.subjects),
                "task.subjects", f"must be a list of {', '.join(SUBJECTS)}", self.subjects)


def build(cfg: Config, seed: int) -> Task:
    if cfg.path:
        train, test = read_path(cfg.path)
    else:
        train, test = read_hub(HUB_ID, [s for s in SUBJECTS if not cfg.subjects or s in cfg.subjects])
    train = [_example(w, row) for w, row in train if _kept(w, row, cfg.levels, cfg.subjects)]
    test = (None if test is None
            else [_example(w, row) for w, row in test if _kept(w, row, cfg.levels, cfg.subjects)])
    if not train and (cfg.levels or cfg.subjects):
        raise ValueError(f"no training example in '{cfg.path or HUB_ID}' is of task.levels={cfg.levels} "
                         f"and task.subjects={cfg.subjects}; widen the filters")
    train, test = choose(train, test, cfg, seed, cfg.path or HUB_ID)
    return Task(reward="math", train=train, test=test)


def _example(where: str, row: dict) -> Example:
    expected = "fields 'problem' and 'solution' or 'answer'"
    problem = text(row, where, "problem", expected)
    if "answer" in row:
        reference = text(row, where, "answer", expected)
    else:
        reference = text(row, where, "solution", expected)
        if not re.search(r"\\(?:boxed|fbox)\s*\{", reference):
            raise ValueError(f"{where}: the solution has no \\boxed{{...}} answer (or give "
                             "an 'answer' field)")
    return Example(f"{problem.strip()}\n{INSTRUCTION}", reference)


def _kept(where: str, row: dict, levels: list[int], subjects: list[str]) -> bool:
    if levels:
        level = re.search(r"\d+", text(row, where, "level", "field 'level' for task.levels"))
        if not level or int(level[0]) not in levels:  # MATH has a few "Level ?" problems: never kept
            return False
    if subjects:
        key = "type" if "type" in row else "subject"
        subject = text(row, where, key, "field 'type' or 'subject' for task.subjects")
        return re.sub(r"\W+", "_", subject.lower().replace("&", "and")) in subjects
    return True
