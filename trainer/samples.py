"""What the policy wrote: a few of each step's fresh completions, decoded, one JSON line each in
`<run_dir>/samples.jsonl` (`log_samples` a step; 0: no file).

    {"step": 3, "group": 17, "sample": 0, "version": 2, "reward": 1.0, "finish": "done", "turns": 1,
     "prompt": "<|im_start|>system ... What is 3 + 4? ...<|im_start|>assistant\n",
     "completion": "3 + 4 = 7<|im_end|>"}

`version`: the policy version that sampled the completion's oldest token; `finish`: why it ended
(buffer.ring's FINISH_REASONS: "budget" is cut at rollout.max_new_tokens). Special tokens are kept, so a
completion shows whether it stopped on its own; a multi-turn completion includes the environment's turns. The
rows are spread over the step's groups: sample 0 of each group in turn, then sample 1, ... Rank 0 writes them
after the step's metrics row; a resumed run first drops the rows past its checkpoint, as metrics.jsonl's.
"""
import json
import os

from buffer.ring import FINISH_REASONS, Group
from trainer.logger import truncate_metrics

FILE = "samples.jsonl"


def picks(groups: list[Group], count: int) -> list[tuple[Group, int]]:
    """`count` (group, sample) pairs, sample 0 of every group first, then sample 1, ...; fewer if the groups
    hold fewer completions."""
    if not groups:
        return []
    spread = [(groups[j % len(groups)], j // len(groups)) for j in range(count)]
    return [(group, k) for group, k in spread if k < group.completion_ids.shape[0]]


class SampleLog:
    def __init__(self, run_dir: str, tokenizer, per_step: int, start_step: int = 0):
        self.tokenizer, self.per_step = tokenizer, per_step
        path = os.path.join(run_dir, FILE)
        truncate_metrics(path, start_step)  # rows past a resumed run's checkpoint
        self.file = open(path, "a") if per_step else None

    def write(self, step: int, groups: list[Group]) -> None:
        if self.file is None:
            return
        for group, k in picks(groups, self.per_step):
            length, sampled = int(group.completion_lens[k]), group.sampled()[k]
            version = int(group.versions[k][sampled].min()) if sampled.any() else None
            row = {"step": step, "group": group.group_id, "sample": k, "version": version,
                   "reward": float(group.rewards[k]), "finish": FINISH_REASONS[int(group.finish[k])],
                   "turns": int(group.turns[k]),
                   "prompt": self.tokenizer.decode(group.prompt_ids.tolist()),
                   "completion": self.tokenizer.decode(group.completion_ids[k, :length].tolist())}
            self.file.write(json.dumps(row) + "\n")
        self.file.flush()

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
