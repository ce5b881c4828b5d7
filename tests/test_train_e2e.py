"""The real entry point, run in a subprocess on the tiny model."""
import json
import os
import signal
import subprocess
import time

import pytest

from tests.helpers import ROOT, TINY, alive, comm, descendants, run_train, shm_files, train_cmd

KEYS = ("step", "time_s", "reward_mean", "loss", "staleness_mean", "staleness_max", "gen_tokens_per_s",
        "train_tokens_per_s")


def _metrics(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def test_tiny_run_writes_the_contract_outputs(tiny_model_dir, tmp_path):
    before = shm_files()
    result = run_train(tmp_path, f"model.path={tiny_model_dir}", "steps=3", *TINY)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = _metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert all(k in row for k in KEYS), row
        assert all(isinstance(v, (int, float)) for v in row.values())
    assert "eval_pass@1" in rows[-1] and 0 <= rows[-1]["eval_pass@1"] <= 1  # evaluated at the end
    assert (tmp_path / "config.yaml").exists()
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 3
    # the whole run's memory: more than one process's worth, less than the machine
    assert 0 < summary["peak_memory_mb"] < 24 * 1024
    assert shm_files() <= before

    from transformers import AutoModelForCausalLM, AutoTokenizer

    checkpoint = tmp_path / "checkpoints" / "step_3"
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    ids = tokenizer("What is 2 + 2?", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > ids.shape[1]


@pytest.mark.parametrize("eta", [0, 2])
def test_staleness_never_exceeds_the_bound(tiny_model_dir, tmp_path, eta):
    result = run_train(tmp_path, f"model.path={tiny_model_dir}", "steps=6", f"max_staleness={eta}", *TINY)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = _metrics(tmp_path)
    assert len(rows) == 6
    assert max(r["staleness_max"] for r in rows) <= eta
    if eta > 0:  # the tiny model generates faster than it trains, so asynchrony must show up
        assert max(r["staleness_max"] for r in rows) > 0


def test_two_trainer_ranks(tiny_model_dir, tmp_path):
    result = run_train(tmp_path, f"model.path={tiny_model_dir}", "steps=2", "cluster=cpu2", *TINY)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [r["step"] for r in _metrics(tmp_path)] == [1, 2]
    assert (tmp_path / "checkpoints" / "step_2" / "model.safetensors").exists()


def _started_run(run_dir, model_dir):
    """A long run in the background, returned once it has logged its first step."""
    proc = subprocess.Popen(train_cmd(run_dir, f"model.path={model_dir}", "steps=1000", *TINY), cwd=ROOT,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 120
    while not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").read_text():
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise AssertionError(f"the run did not start: {proc.communicate()[1][-2000:]}")
        time.sleep(0.5)
    return proc


def test_killed_rollout_worker_ends_the_run_cleanly(tiny_model_dir, tmp_path):
    before = shm_files()
    proc = _started_run(tmp_path, tiny_model_dir)
    try:
        family = descendants(proc.pid)
        worker = next(p for p in family if comm(p) == "rollout-0")
        os.kill(worker, signal.SIGKILL)
        killed_at = time.time()
        _, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert time.time() - killed_at < 20
    assert proc.returncode != 0
    assert "rollout-0 died (killed by SIGKILL)" in stderr
    time.sleep(0.5)
    assert not [p for p in family if alive(p)], "a child process outlived the run"
    assert shm_files() <= before
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "failed"


@pytest.mark.parametrize("override, message", [
    ("stepz=3", "unknown config key 'stepz'"),
    ("max_staleness=-1", "config key 'max_staleness' must be >= 0"),
    ("algo=grpo algo.clip_eps=3", "config key 'algo.clip_eps' must be in (0, 1)"),
    ("algo=nope", "unknown algo 'nope'"),
    ("train.lr=fast", "config key 'train.lr' must be of type float"),
    ("model.path=/no/such/model", "model.path '/no/such/model' is not a folder"),
    ("cluster=gpu", "cluster=gpu is not built yet"),
])
def test_bad_config_stops_with_one_line(tmp_path, override, message):
    result = run_train(tmp_path, *override.split(), timeout=60)
    assert result.returncode == 2
    lines = [line for line in result.stderr.strip().splitlines() if line]
    assert len(lines) == 1 and message in lines[0], result.stderr


def test_every_rule_runs_in_one_sweep(tiny_model_dir, tmp_path):
    """`algo=` switches the learning rule from the command line; every rule trains with finite losses."""
    import math
    import subprocess
    import sys

    rules = ["tb", "ppo", "grpo", "rloo", "online_dpo"]
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "-m", f"algo={','.join(rules)}",
           f"hydra.sweep.dir={tmp_path}", "hydra.sweep.subdir=${algo.name}", "progress=false",
           f"model.path={tiny_model_dir}", "steps=2", *TINY]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    for rule in rules:
        rows = _metrics(tmp_path / rule)
        assert [r["step"] for r in rows] == [1, 2], rule
        assert all(math.isfinite(r["loss"]) for r in rows), rule
        assert any(k.startswith(("loss/",)) for k in rows[0]), rule
        assert (tmp_path / rule / "curves.png").stat().st_size > 10_000, rule


def test_staleness_sweep_and_its_plot(tiny_model_dir, tmp_path):
    """A two-point Hydra multirun with the default subdirs, then plot.py on the sweep: one figure, a table row
    per run labelled by the swept value."""
    import subprocess
    import sys

    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "-m", "max_staleness=0,2", f"hydra.sweep.dir={tmp_path}",
           "progress=false", f"model.path={tiny_model_dir}", "steps=2", *TINY]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = sorted(p.name for p in tmp_path.iterdir() if p.is_dir() and not p.name.startswith("."))
    assert len(runs) == 2 and runs[0].startswith("0_max_staleness=0,") and runs[1].startswith("1_max_staleness=2,")
    for run in runs:
        assert [r["step"] for r in _metrics(tmp_path / run)] == [1, 2]
    plot = subprocess.run([sys.executable, os.path.join(ROOT, "plot.py"), str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert plot.returncode == 0, plot.stderr[-3000:]
    table = [line for line in plot.stdout.splitlines() if line.startswith("| max_staleness=")]
    assert [line.split("|")[1].strip() for line in table] == ["max_staleness=0", "max_staleness=2"]
    assert (tmp_path / "sweep.png").stat().st_size > 10_000


def test_eval_only_scores_a_checkpoint_without_training(tiny_model_dir, tmp_path):
    result = run_train(tmp_path, f"model.path={tiny_model_dir}", "eval.only=true", "eval.k=2", "task.test_size=5",
                       "rollout.max_new_tokens=4")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "eval_pass@1=" in result.stdout
    (row,) = _metrics(tmp_path)
    assert row["eval_examples"] == 5 and 0 <= row["eval_pass@2"] <= 1
    assert not (tmp_path / "checkpoints").exists()


def test_gsm8k_from_a_local_file_trains(tiny_model_dir, tmp_path):
    data = tmp_path / "gsm8k.jsonl"
    lines = [json.dumps({"question": f"Tom has {i} apples and buys {i + 2} more. How many now?",
                         "answer": f"He has {i} + {i + 2} = {2 * i + 2}.\n#### {2 * i + 2}"}) for i in range(12)]
    data.write_text("\n".join(lines) + "\n")
    run_dir = tmp_path / "run"
    result = run_train(run_dir, f"model.path={tiny_model_dir}", "task=gsm8k", f"task.path={data}", "task.test_size=4",
                       "steps=2", *TINY)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2] and rows[-1]["eval_examples"] == 4


def test_missing_dataset_file_stops_with_one_line(tmp_path):
    result = run_train(tmp_path, "task=gsm8k", f"task.path={tmp_path}/nope.jsonl", timeout=120)
    assert result.returncode == 2
    lines = [line for line in result.stderr.strip().splitlines() if line]
    assert len(lines) == 1 and "nope.jsonl" in lines[0], result.stderr


def test_ctrl_c_stops_everything(tiny_model_dir, tmp_path):
    proc = _started_run(tmp_path, tiny_model_dir)
    try:
        family = descendants(proc.pid)
        os.kill(proc.pid, signal.SIGINT)
        sent = time.time()
        _, stderr = proc.communicate(timeout=30)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert time.time() - sent < 30
    assert proc.returncode == 130 and "interrupted" in stderr
    time.sleep(0.5)
    assert not [p for p in family if alive(p)], "a child process outlived the run"
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "failed"
