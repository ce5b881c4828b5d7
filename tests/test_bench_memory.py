"""bench/memory.py's pieces that need no training run: its GSM8K-shaped data and its reading of a run."""
import json
import os

import pytest

from bench import memory
from tasks.gsm8k import Config, build


def test_the_gsm8k_shaped_file_reads_as_gsm8k_with_checkable_answers(tmp_path):
    path = str(tmp_path / "gsm8k_like.jsonl")
    memory.write_gsm8k_like(path, count=50)
    task = build(Config(path=path, test_size=10), seed=0)
    assert len(task.train) == 40 and len(task.test) == 10
    for example in task.train:
        words = len(example.question.split())
        assert 45 <= words <= 75, words  # about GSM8K's question length, with the instruction
        shown = example.answer.split("####")[-1].strip()
        first = example.answer.split(" = ")[-1].split()[0]
        assert shown == first  # the worked answer's last product is the '#### n' line


def test_a_run_is_read_into_its_peak_split_and_step_time(tmp_path):
    rows = [{"step": i, "time_s": 10.0 * i + 5, "perf/completion_len": 100.0 * i} for i in (1, 2, 3)]
    (tmp_path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    (tmp_path / "summary.json").write_text(json.dumps(
        {"status": "completed", "peak_memory_mb": 7000, "peak_memory_by_process_mb": {"trainer0": 5000}}))
    got = memory.read(str(tmp_path))
    assert got == {"peak": 7000, "parts": {"trainer0": 5000}, "s_per_step": 10.0, "completion_len": 200.0}
    assert memory.parse_vary(["short=rollout.max_new_tokens=256"]) \
        == {"short": ["rollout.max_new_tokens=256"]}
    with pytest.raises(SystemExit, match="--vary"):
        memory.parse_vary(["before=x=1"])
    assert os.path.basename(memory.ROOT) != "bench"
