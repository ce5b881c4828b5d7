"""samples.jsonl: a few of each step's fresh completions, decoded (trainer/samples.py)."""
import json

import torch
from transformers import AutoTokenizer

from buffer.ring import Group
from trainer.samples import FILE, SampleLog, picks


def _group(tokenizer, group_id: int, texts: list[str], rewards: list[float], truncated: list[bool]) -> Group:
    rows = [tokenizer.encode(t, add_special_tokens=False) for t in texts]
    width = max(len(r) for r in rows) + 2  # right padding
    ids = torch.zeros(len(rows), width, dtype=torch.int64)
    for k, r in enumerate(rows):
        ids[k, :len(r)] = torch.tensor(r)
    lens = torch.tensor([len(r) for r in rows])
    versions = torch.full((len(rows), width), 3, dtype=torch.int64)
    return Group(prompt_ids=torch.tensor(tokenizer.encode(f"What is {group_id}?", add_special_tokens=False)),
                 completion_ids=ids, completion_lens=lens, logprobs=torch.zeros(len(rows), width),
                 versions=versions, rewards=torch.tensor(rewards), truncated=torch.tensor(truncated),
                 prompt_index=group_id, group_id=group_id, worker_id=0)


def _rows(path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_each_step_writes_its_picks_decoded_spread_over_the_groups(tokenizer_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    a = _group(tokenizer, 7, ["3 + 4 = 7<|im_end|>", "It is eight", "7"], [1.0, 0.0, 1.0],
               [False, True, False])
    b = _group(tokenizer, 8, ["Nine.<|im_end|>", "9<|im_end|>", "nine"], [0.0, 1.0, 0.0],
               [False, False, True])
    # a multi-turn completion: the environment's tokens were not sampled (mask off, version -1), an older turn
    # was
    a.loss_mask[0, 3:] = False
    a.versions[0, 3:] = -1
    a.versions[0, :2] = 1
    assert [(g.group_id, k) for g, k in picks([a, b], 5)] == [(7, 0), (8, 0), (7, 1), (8, 1), (7, 2)]
    assert len(picks([a, b], 10)) == 6 and picks([], 3) == []

    log = SampleLog(str(tmp_path), tokenizer, per_step=3)
    log.write(1, [a, b])
    log.write(2, [b])
    log.close()
    rows = _rows(tmp_path / FILE)
    assert [(r["step"], r["group"], r["sample"]) for r in rows] == [(1, 7, 0), (1, 8, 0), (1, 7, 1),
                                                                    (2, 8, 0), (2, 8, 1), (2, 8, 2)]
    first = rows[0]
    # special tokens kept
    assert first["completion"] == "3 + 4 = 7<|im_end|>" and first["prompt"] == "What is 7?"
    # oldest
    assert (first["reward"], first["finish"], first["turns"], first["version"]) == (1.0, "done", 1, 1)
    assert rows[2]["completion"] == "It is eight" and rows[2]["finish"] == "budget" \
        and rows[2]["version"] == 3
    assert rows[5]["completion"] == "nine" and rows[5]["reward"] == 0.0


def test_a_resumed_run_drops_the_rows_past_its_checkpoint_and_zero_writes_no_file(tokenizer_dir, tmp_path):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    g = _group(tokenizer, 1, ["2", "3"], [1.0, 0.0], [False, False])
    log = SampleLog(str(tmp_path), tokenizer, per_step=1)
    for step in (1, 2, 3):
        log.write(step, [g])
    log.close()
    with open(tmp_path / FILE, "a") as f:
        f.write('{"step": 4, "group": 1, "compl')  # a crash mid-line
    log = SampleLog(str(tmp_path), tokenizer, per_step=1, start_step=2)  # resumed from step_2
    log.write(3, [g])
    log.close()
    assert [r["step"] for r in _rows(tmp_path / FILE)] == [1, 2, 3]

    off = tmp_path / "off"
    off.mkdir()
    log = SampleLog(str(off), tokenizer, per_step=0)
    log.write(1, [g])
    log.close()
    assert not (off / FILE).exists()
