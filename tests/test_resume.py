"""Checkpoints and resume: a run stopped and resumed reproduces the uninterrupted one exactly (eta = 0), the
same seed gives the same metrics, a crash mid-write keeps the previous checkpoint, `keep` prunes."""
import json
import os
import subprocess
import sys

from helpers import TINY, run_train, train_cmd


def _rows(run_dir):
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def _values(rows):
    keys = ("step", "loss", "reward_mean", "reward/batch_mean", "train/grad_norm", "staleness_mean")
    return [{k: r.get(k) for k in keys} for r in rows]


SYNC = ("max_staleness=0", "eval.every=0", "task.reward=tests.toy_rewards:length_parity")


def test_same_seed_same_metrics_and_resume_is_exact(tiny_model_dir, tmp_path):
    """Run c's first two steps reproduce run a's (the same seed, the same metrics), and its three resumed
    steps continue exactly as a did without the stop. Run a also keeps one checkpoint (step_2 pruned) and none
    at the end: checkpointing changes no metric."""
    a, c = tmp_path / "a", tmp_path / "c"
    result = run_train(a, f"model.path={tiny_model_dir}", "steps=5", "checkpoint.every=2",
                       "checkpoint.keep=1", "checkpoint.at_end=false", *SYNC, *TINY)
    assert result.returncode == 0, result.stderr[-3000:]
    assert sorted(os.listdir(a / "checkpoints")) == ["step_4"]  # step_2 pruned, no step_5
    assert len({r["loss"] for r in _rows(a)}) > 1  # not trivially equal
    # synchronous: every step has the cores to itself (runtime/cores.py), so the count never moves
    assert {r["perf/train_threads"] for r in _rows(a)} == {len(os.sched_getaffinity(0))}

    first = run_train(c, f"model.path={tiny_model_dir}", "steps=2", *SYNC, *TINY)
    assert first.returncode == 0, first.stderr[-3000:]
    assert _values(_rows(c)) == _values(_rows(a))[:2]  # reproducible
    with open(c / "samples.jsonl", "a") as f:  # as a run killed after step 2's checkpoint would leave it
        f.write(json.dumps({"step": 3, "completion": "written after the checkpoint"}) + "\n")
    resumed = subprocess.run(train_cmd(c, f"resume={c}", "steps=5"), capture_output=True, text=True,
                             timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert _values(_rows(c)) == _values(_rows(a))  # exact
    # the same completions, once each
    assert (c / "samples.jsonl").read_text() == (a / "samples.jsonl").read_text()
    assert sorted(os.listdir(c / "checkpoints")) == ["step_2", "step_5"]


def test_resume_errors_are_one_line(tiny_model_dir, tmp_path):
    empty = tmp_path / "empty"
    empty.mkdir()
    result = subprocess.run(train_cmd(tmp_path / "x", f"resume={empty}"), capture_output=True, text=True,
                            timeout=120)
    assert result.returncode == 2 and "has no config.yaml" in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1


CRASH = """
import sys, time
import torch.distributed as dist
from transformers import AutoModelForCausalLM
sys.path.insert(0, {root!r})
import trainer.checkpoint as c
from trainer.policy import TokenLogprobs
dist.init_process_group("gloo", init_method="file://{run}/store", rank=0, world_size=1)
policy = TokenLogprobs(AutoModelForCausalLM.from_pretrained({model!r}))
state = {{"step": 1, "time_s": 0.0, "next_group": {{}}}}
c.save_checkpoint(policy, {model!r}, {run!r}, 1, state)
orig = c._fsync_dir
def slow(path):
    if ".tmp-step_2" in path:
        print("writing", flush=True)
        time.sleep(120)
    orig(path)
c._fsync_dir = slow
c.save_checkpoint(policy, {model!r}, {run!r}, 2, dict(state, step=2))
"""


def test_a_crash_mid_checkpoint_keeps_the_previous_one(tiny_model_dir, tmp_path):
    from helpers import ROOT

    code = CRASH.format(root=ROOT, run=str(tmp_path), model=str(tiny_model_dir))
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        line = proc.stdout.readline()
        assert line.strip() == b"writing", proc.stderr.read().decode()[-3000:]
        assert (tmp_path / "checkpoints" / ".tmp-step_2" / "model.safetensors").exists()  # killed mid-write
        proc.kill()
    finally:
        proc.wait(timeout=30)
        proc.stdout.close()
        proc.stderr.close()
    from transformers import AutoModelForCausalLM

    from trainer.checkpoint import checkpoints, latest_resumable

    assert [s for s, _ in checkpoints(tmp_path)] == [1]
    assert latest_resumable(tmp_path)[0] == 1
    AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoints" / "step_1")
