"""Preference tuning (TL;DR-style): summarise a post; the reward is a reward model's score of the summary.

`task.path` is a .jsonl/.parquet file or folder (read as in tasks/gsm8k.py) whose rows hold the text to
summarise in `prompt`, or Reddit TL;DR's `post` (with optional `subreddit` and `title`).
`task.reward_model` is any Hugging Face sequence-classification model folder or hub id.
"""
from dataclasses import dataclass

from registry import require
from tasks import Example, Task
from tasks.gsm8k import check_sizes, choose, read_path

INSTRUCTION = "Summarize the post above in one sentence."


@dataclass
class Config:
    name: str = "preference"
    path: str = ""  # local .jsonl/.parquet file or folder with `prompt` or `post` (required)
    reward_model: str = ""  # sequence-classification reward model: folder or hub id (required)
    label: int = 0  # with a multi-label classifier: the label whose probability is the reward
    max_train: int = 0  # training examples kept, chosen by the seed (0: all)
    max_test: int = 0  # test examples kept, chosen by the seed (0: all)
    test_size: int = 100  # examples held out as the test split when the data has none

    def check(self):
        check_sizes(self)
        require(bool(self.path), "task.path",
                "is required for task=preference (a .jsonl/.parquet file or folder)", self.path)
        require(bool(self.reward_model), "task.reward_model",
                "is required for task=preference (a reward model path)", self.reward_model)


def build(cfg: Config, seed: int) -> Task:
    train, test = read_path(cfg.path)
    train = [_example(where, row) for where, row in train]
    test = [_example(where, row) for where, row in test] if test is not None else None
    train, test = choose(train, test, cfg, seed, cfg.path)
    return Task(reward="reward_model", train=train, test=test,
                reward_options={"model_path": cfg.reward_model, "label": cfg.label})


def _example(where: str, row: dict) -> Example:
    if "prompt" in row:
        post = str(row["prompt"])
    elif "post" in row:
        head = " ".join(str(row[k]) for k in ("subreddit", "title") if row.get(k))
        post = f"{head}\n{row['post']}" if head else str(row["post"])
    else:
        raise ValueError(f"{where}: expected a 'prompt' or 'post' field (got "
                         f"{', '.join(sorted(row)) or 'none'})")
    # The reward model sees the post and the summary; the policy sees them with the instruction.
    return Example(question=f"{post}\n\n{INSTRUCTION}", answer=post)
