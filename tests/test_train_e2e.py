"""The real entry point, run in a subprocess on the tiny model."""
import json
import os
import signal
import subprocess
import time

import pytest

from tests.helpers import (
    ROOT,
    TINY,
    alive,
    comm,
    descendants,
    die_with_parent,
    run_train,
    shm_files,
    train_cmd,
)

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
    assert all(1 <= r["perf/train_threads"] <= len(os.sched_getaffinity(0)) for r in rows)  # runtime/cores.py
    # trainer/peak.py: a fraction of the measured peak
    assert all(0 < r["perf/learner_mfu"] < 1 for r in rows)
    assert rows[-1]["perf/eval_s"] > 0 and "perf/eval_s" not in rows[0]
    # no GPU
    assert all(r["perf/publish_s"] > 0 for r in rows) and "perf/peak_gpu_allocated_gb" not in rows[0]
    assert (tmp_path / "config.yaml").exists()
    # log_samples=4 a step: 2 groups x 2 samples of the step's fresh data, decoded (trainer/samples.py)
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [(s["step"], s["sample"]) for s in samples] \
        == [(step, k) for step in (1, 2, 3) for k in (0, 0, 1, 1)]
    assert all(s["version"] == s["step"] - 1 and "What is" in s["prompt"] and s["completion"]
               for s in samples)
    assert not (tmp_path / "curves.png").exists()  # curves=false (tests/helpers.py); drawn by default: below
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["status"] == "completed" and summary["steps"] == 3
    assert "time_to_reward_0.8" in summary and "step_to_reward_0.9" in summary
    # the whole run's memory: more than one process's worth, less than the machine
    assert 0 < summary["peak_memory_mb"] < 24 * 1024
    # each process's own peak, never below its share when the total peaked
    each, at_peak = summary["peak_memory_each_process_mb"], summary["peak_memory_by_process_mb"]
    assert {"trainer-0", "rollout-0"} <= set(each) and all(each[name] >= mb for name, mb in at_peak.items())
    assert shm_files() <= before

    from transformers import AutoModelForCausalLM, AutoTokenizer

    checkpoint = tmp_path / "checkpoints" / "step_3"
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    ids = tokenizer("What is 2 + 2?", return_tensors="pt").input_ids
    out = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert out.shape[1] > ids.shape[1]


@pytest.mark.slow  # in CI: tests/test_hang.py checks the bound (eta 1) across a worker restart
@pytest.mark.parametrize("eta", [0, 2])
def test_staleness_never_exceeds_the_bound(tiny_model_dir, tmp_path, eta):
    # eta = 2 also runs decoupled PPO with two minibatches a batch and a correction, and its diagnostics
    extra = ("algo=ppo", "train.minibatches=2", "algo.correction=mis_token") if eta else ()
    result = run_train(tmp_path, f"model.path={tiny_model_dir}", "steps=6", f"max_staleness={eta}", *TINY,
                       *extra)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = _metrics(tmp_path)
    assert len(rows) == 6
    assert max(r["staleness_max"] for r in rows) <= eta
    assert all("policy/entropy" in r and 0 < r["offpolicy/ess"] <= 1 + 1e-9 for r in rows)
    if eta > 0:  # the tiny model generates faster than it trains, so asynchrony must show up
        assert max(r["staleness_max"] for r in rows) > 0
        assert any("offpolicy/kl" in r for r in rows)
        assert all("correction/masked_frac" in r and "ppo/clip_frac_high" in r for r in rows)
    else:
        # every batch holds the trainer's own version's samples (tb's replay adds older ones after step 1)
        assert rows[0]["offpolicy/fresh_frac"] == 1.0 and rows[0]["mismatch/kl"] >= 0


def test_two_trainer_ranks(tiny_model_dir, tmp_path):
    result = run_train(tmp_path, f"model.path={tiny_model_dir}", "steps=2", "cluster=cpu2", *TINY)
    assert result.returncode == 0, result.stderr[-3000:]
    assert [r["step"] for r in _metrics(tmp_path)] == [1, 2]
    assert (tmp_path / "checkpoints" / "step_2" / "model.safetensors").exists()


def _started_run(run_dir, model_dir, *overrides, steps=1000):
    """A run in the background, returned once it has logged its first step."""
    proc = subprocess.Popen(train_cmd(run_dir, f"model.path={model_dir}", f"steps={steps}", *TINY,
                                      *overrides),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=die_with_parent)
    deadline = time.time() + 120
    while not (run_dir / "metrics.jsonl").exists() or not (run_dir / "metrics.jsonl").read_text():
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise AssertionError(f"the run did not start: {proc.communicate()[1][-2000:]}")
        time.sleep(0.5)
    return proc


def _signal_and_wait(proc, pid: int, sig, timeout: float) -> tuple[str, float]:
    """Send `sig` to `pid` (the run or one of its processes); the run's stderr and the seconds it took to
    end."""
    try:
        os.kill(pid, sig)
        sent = time.time()
        _, stderr = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            proc.kill()
    return stderr, time.time() - sent


def _resume_one_more_step(run_dir) -> int:
    """`resume=` from the latest checkpoint for one more step; returns that checkpoint's step."""
    from trainer.checkpoint import latest_resumable

    step, _ = latest_resumable(run_dir)
    resumed = subprocess.run(train_cmd(run_dir, f"resume={run_dir}", f"steps={step + 1}"), cwd=ROOT,
                             capture_output=True, text=True, timeout=300)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    return step


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().replace(b"\0", b" ").decode().strip()
    except OSError:
        return ""


@pytest.mark.slow  # tests/test_hang.py finds rollout-0 and trainer-0 by these names, in CI
def test_processes_carry_readable_names(tiny_model_dir, tmp_path):
    proc = _started_run(tmp_path, tiny_model_dir)
    try:
        family = descendants(proc.pid)
        assert {_cmdline(p) for p in family} >= {"ringrl:rollout-0", "ringrl:trainer-0"}
        assert {comm(p) for p in family} >= {"rollout-0", "trainer-0"}  # what `top` shows
    finally:
        proc.kill()
        proc.communicate()
        for p in family:  # the launcher was SIGKILLed: its children follow it (PR_SET_PDEATHSIG)
            deadline = time.time() + 10
            while alive(p) and time.time() < deadline:
                time.sleep(0.1)


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def test_a_killed_launcher_leaves_neither_its_forkserver_nor_its_processes(tiny_model_dir, tmp_path):
    """On the CPU the processes are forked by a forkserver, the launcher's child (launch/forkserver.py): a
    SIGKILL to the launcher takes the forkserver with it (PR_SET_PDEATHSIG), and the processes with the
    forkserver."""
    proc = _started_run(tmp_path, tiny_model_dir)
    family = descendants(proc.pid)
    workers = [p for p in family if _cmdline(p) in ("ringrl:rollout-0", "ringrl:trainer-0")]
    forkservers = {_parent(p) for p in workers}
    assert len(workers) == 2 and len(forkservers) == 1, [_cmdline(p) for p in family]
    forkserver = forkservers.pop()
    assert _parent(forkserver) == proc.pid and "multiprocessing.forkserver" in _cmdline(forkserver)
    proc.kill()
    proc.communicate()
    deadline = time.time() + 10
    while any(alive(p) for p in family) and time.time() < deadline:
        time.sleep(0.1)
    assert not [_cmdline(p) for p in family if alive(p)], "outlived the launcher"


@pytest.mark.slow  # tests/test_hang.py replaces a stuck worker mid-run through the same path, in CI
def test_killed_rollout_worker_is_restarted_and_the_run_finishes(tiny_model_dir, tmp_path):
    # 60 steps: after the kill (at step 1) the run needs the replacement's groups for almost all of them
    proc = _started_run(tmp_path, tiny_model_dir, "max_staleness=1", "cluster.max_restarts=1", "eval.every=0",
                        steps=60)
    try:
        worker = next(p for p in descendants(proc.pid) if _cmdline(p) == "ringrl:rollout-0")
    except BaseException:
        proc.kill()
        raise
    stderr, _ = _signal_and_wait(proc, worker, signal.SIGKILL, 240)
    assert proc.returncode == 0, stderr[-3000:]
    assert "rollout-0 died (killed by SIGKILL" in stderr and "restarting it (1/1)" in stderr
    rows = _metrics(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, 61))
    assert rows[-1]["rollout/restarts"] == 1 and rows[-1]["rollout/lost_groups"] >= 0
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "completed"


def test_killed_rollout_worker_past_max_restarts_ends_the_run_cleanly(tiny_model_dir, tmp_path):
    before = shm_files()
    proc = _started_run(tmp_path, tiny_model_dir, "cluster.max_restarts=0")
    try:
        family = descendants(proc.pid)
        worker = next(p for p in family if comm(p) == "rollout-0")
    except BaseException:
        proc.kill()
        raise
    stderr, took = _signal_and_wait(proc, worker, signal.SIGKILL, 30)
    assert took < 20
    assert proc.returncode != 0
    assert "rollout-0 died (killed by SIGKILL" in stderr
    time.sleep(0.5)
    assert not [p for p in family if alive(p)], "a child process outlived the run"
    assert shm_files() <= before
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "failed"
    assert (tmp_path / "checkpoints").exists()  # what was learned before the failure is kept


@pytest.mark.slow  # tests/test_hang.py stops a run for a stuck trainer; test_ctrl_c resumes one, in CI
def test_killed_trainer_stops_the_run_and_resume_continues(tiny_model_dir, tmp_path):
    proc = _started_run(tmp_path, tiny_model_dir, "checkpoint.every=1", steps=1000)
    try:
        deadline = time.time() + 60
        while not (tmp_path / "checkpoints" / "step_1" / "trainer_state.pt").exists() \
                and time.time() < deadline:
            time.sleep(0.1)
        family = descendants(proc.pid)
        trainer = next(p for p in family if _cmdline(p) == "ringrl:trainer-0")
    except BaseException:
        proc.kill()
        raise
    stderr, _ = _signal_and_wait(proc, trainer, signal.SIGKILL, 60)
    assert proc.returncode == 1 and "trainer-0 died (killed by SIGKILL" in stderr
    time.sleep(0.5)
    assert not [p for p in family if alive(p)], "a child process outlived the run"
    step = _resume_one_more_step(tmp_path)
    assert [r["step"] for r in _metrics(tmp_path)] == list(range(1, step + 2))


# One bad value per stage of the launcher that can refuse it, run through train.py: the command line's check
# (before Hydra), the schema's ranges, the task's data, the model, the device plan, the engine, resume and the
# prompt budget. Every other key's message is checked in-process by tests/test_config.py (TYPOS, RANGES),
# where it costs milliseconds instead of a Python start-up.
BAD_CONFIGS = [  # (overrides, what the one line must say); {tmp} is the test's scratch folder
    ("stepz=3", "unknown config key 'stepz'"),
    ("algo=tb algo.beta=1", "unknown config key 'algo.beta' for algo=tb (known: beta_end, beta_start,"),
    ("max_staleness=-1", "config key 'max_staleness' must be >= 0"),
    ("model.path=/no/such/model", "model.path '/no/such/model' is not a folder"),
    ("task=gsm8k task.path={tmp}/nope.jsonl", "nope.jsonl"),
    ("task=gsm8k task.path={tmp}/garbage.jsonl", "garbage.jsonl"),
    ("rollout.max_prompt_len=3", "config key 'rollout.max_prompt_len' (3) is below every training prompt"),
    ("train.freeze_layers=99", "train.freeze_layers=99: the model has"),
    ("resume={tmp}", "has no config.yaml"),
    ("cluster=gpu8", "cluster.plan=gpu needs CUDA GPUs and torch sees none"),
    ("rollout.engine=sglang",
     "rollout.engine=sglang needs the GPU plan (CUDA GPUs); use rollout.engine=builtin"),
]


@pytest.mark.parametrize("override, message", BAD_CONFIGS, ids=[o for o, _ in BAD_CONFIGS])
def test_bad_config_stops_with_one_line_before_any_process(tmp_path, override, message):
    (tmp_path / "garbage.jsonl").write_text("this is not json\n{\"question\": 1}\n")
    result = run_train(tmp_path / "run", *override.format(tmp=tmp_path).split(), timeout=120)
    assert result.returncode == 2, result.stderr[-2000:]
    lines = [line for line in result.stderr.strip().splitlines() if line]
    assert len(lines) == 1 and message in lines[0], result.stderr
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # nothing ran


@pytest.mark.slow  # a long end-to-end run: CI's suite must stay under 15 minutes on 2 cores
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


@pytest.mark.slow  # a long end-to-end run: CI's suite must stay under 15 minutes on 2 cores
def test_staleness_sweep_and_its_plot(tiny_model_dir, tmp_path):
    """A two-point Hydra multirun with the default subdirs, then plot.py on the sweep: one figure, a table row
    per run labelled by the swept value."""
    import subprocess
    import sys

    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "-m", "max_staleness=0,2",
           f"hydra.sweep.dir={tmp_path}", "progress=false", f"model.path={tiny_model_dir}", "steps=2", *TINY]
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    runs = sorted(p.name for p in tmp_path.iterdir() if p.is_dir() and not p.name.startswith("."))
    assert len(runs) == 2 and runs[0].startswith("0_max_staleness=0,") \
        and runs[1].startswith("1_max_staleness=2,")
    for run in runs:
        assert [r["step"] for r in _metrics(tmp_path / run)] == [1, 2]
    plot = subprocess.run([sys.executable, os.path.join(ROOT, "plot.py"), str(tmp_path)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)
    assert plot.returncode == 0, plot.stderr[-3000:]
    table = [line for line in plot.stdout.splitlines() if line.startswith("| max_staleness=")]
    assert [line.split("|")[1].strip() for line in table] == ["max_staleness=0", "max_staleness=2"]
    assert (tmp_path / "sweep.png").stat().st_size > 10_000


def test_eval_only_scores_a_checkpoint_without_training(tiny_model_dir, tmp_path):
    result = run_train(tmp_path, f"model.path={tiny_model_dir}", "eval.only=true", "eval.k=2",
                       "task.test_size=5", "rollout.max_new_tokens=4")
    assert result.returncode == 0, result.stderr[-3000:]
    assert "eval_pass@1=" in result.stdout
    (row,) = _metrics(tmp_path)
    assert row["eval_examples"] == 5 and 0 <= row["eval_pass@2"] <= 1
    assert not (tmp_path / "checkpoints").exists()


def test_gsm8k_from_a_local_file_trains(tiny_model_dir, tmp_path):
    data = tmp_path / "gsm8k.jsonl"
    lines = [json.dumps({"question": f"Tom has {i} apples and buys {i + 2} more. How many now?",
                         "answer": f"He has {i} + {i + 2} = {2 * i + 2}.\n#### {2 * i + 2}"})
             for i in range(12)]
    data.write_text("\n".join(lines) + "\n")
    run_dir = tmp_path / "run"
    result = run_train(run_dir, f"model.path={tiny_model_dir}", "task=gsm8k", f"task.path={data}",
                       "task.test_size=4", "steps=2", *TINY)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = _metrics(run_dir)
    assert [r["step"] for r in rows] == [1, 2] and rows[-1]["eval_examples"] == 4


def _forkservers_of(launcher: int) -> list[int]:
    """Live processes started as `launcher`'s forkserver (launch/forkserver.py marks their environment)."""
    mark, found = f"RINGRL_FORKSERVER_LAUNCHER={launcher}".encode(), []
    for entry in os.listdir("/proc"):
        if entry.isdigit() and alive(int(entry)):
            try:
                with open(f"/proc/{entry}/environ", "rb") as f:
                    if mark in f.read().split(b"\0"):
                        found.append(int(entry))
            except OSError:
                continue
    return found


def test_missing_dataset_file_stops_with_one_line(tmp_path):
    # stderr to a file, not a pipe: a pipe would wait for the forkserver, which holds it too, to end
    with open(tmp_path / "stderr.txt", "w+") as err:
        proc = subprocess.Popen(train_cmd(tmp_path, "task=gsm8k", f"task.path={tmp_path}/nope.jsonl"),
                                cwd=ROOT, stdout=subprocess.DEVNULL, stderr=err, preexec_fn=die_with_parent)
        proc.wait(timeout=120)
        err.seek(0)
        stderr = err.read()
    assert proc.returncode == 2
    lines = [line for line in stderr.strip().splitlines() if line]
    assert len(lines) == 1 and "nope.jsonl" in lines[0], stderr
    # the forkserver had started and was still importing: it went with the launcher, not seconds later
    time.sleep(0.5)
    assert _forkservers_of(proc.pid) == []


def test_ctrl_c_stops_everything(tiny_model_dir, tmp_path):
    proc = _started_run(tmp_path, tiny_model_dir)
    family = descendants(proc.pid)
    stderr, took = _signal_and_wait(proc, proc.pid, signal.SIGINT, 30)
    assert took < 30
    assert proc.returncode == 130 and "interrupted" in stderr
    time.sleep(0.5)
    assert not [p for p in family if alive(p)], "a child process outlived the run"
    assert json.loads((tmp_path / "summary.json").read_text())["status"] == "failed"
    # Ctrl-C wrote a checkpoint of the last finished step, and `resume=` continues from it
    step = _resume_one_more_step(tmp_path)
    assert step >= 1
    assert [r["step"] for r in _metrics(tmp_path)][-2:] == [step, step + 1]


@pytest.mark.parametrize("mode", ["skip", pytest.param("truncate", marks=pytest.mark.slow)])
def test_prompts_over_the_budget_are_skipped_or_cut_and_counted(tiny_model_dir, tmp_path, mode):
    data = tmp_path / "gsm8k.jsonl"
    padding = " Think about it carefully, step by step, before you answer the question." * 6
    rows = [{"question": f"What is {i} plus 2?" + (padding if i % 2 else ""), "answer": f"#### {i + 2}"}
            for i in range(16)]
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    run_dir = tmp_path / "run"
    result = run_train(run_dir, f"model.path={tiny_model_dir}", "task=gsm8k", f"task.path={data}",
                       "task.test_size=2", "steps=2", "rollout.max_prompt_len=60",
                       f"rollout.long_prompts={mode}", *TINY)
    assert result.returncode == 0, result.stderr[-3000:]
    last = _metrics(run_dir)[-1]
    assert last[f"rollout/prompts_{'skipped' if mode == 'skip' else 'truncated'}"] >= 1
    assert last[f"rollout/prompts_{'truncated' if mode == 'skip' else 'skipped'}"] == 0


@pytest.mark.slow  # the sinks themselves are tested in tests/test_logger.py
@pytest.mark.parametrize("backend", ["tensorboard", "wandb"])
def test_logger_backends_in_a_real_run(tiny_model_dir, tmp_path, monkeypatch, backend):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    result = run_train(tmp_path, f"model.path={tiny_model_dir}", "steps=2", f"logger={backend}", *TINY)
    assert result.returncode == 0, result.stderr[-3000:]
    if backend == "tensorboard":
        from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

        events = EventAccumulator(str(tmp_path / "tensorboard"))
        events.Reload()
        assert [e.step for e in events.Scalars("reward_mean")] == [1, 2]
    else:
        import glob

        assert len(glob.glob(str(tmp_path / "wandb" / "offline-run-*" / "run-*.wandb"))) == 1


@pytest.mark.parametrize("algo", ["gspo", "cispo", "online_dpo"])
def test_new_rules_run_end_to_end(tiny_model_dir, tmp_path, algo):
    result = run_train(tmp_path, f"model.path={tiny_model_dir}", "steps=2", f"algo={algo}", *TINY)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = _metrics(tmp_path)
    name = {"online_dpo": "dpo"}.get(algo, algo)
    assert [r["step"] for r in rows] == [1, 2] and all(f"loss/{name}" in r for r in rows)


def test_dapo_dynamic_sampling_drops_tied_groups_and_the_run_goes_on(tiny_model_dir, tmp_path):
    """The tiny random model scores 0 on (almost) every sample: groups tie. Each tied group is dropped (its
    budget back to the gate, so a worker generates another) until the step's allowance, 1 x batch_groups here,
    is spent; then the step trains on tied groups rather than wait forever, and says so."""
    result = run_train(tmp_path, f"model.path={tiny_model_dir}", "steps=3", "algo=dapo", "max_staleness=1",
                       "buffer.dynamic_max_drops=1", *TINY)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = _metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2, 3] and all("loss/dapo" in r for r in rows)
    dropped = [r["dynamic/dropped_groups"] for r in rows]
    assert all(n <= 2 for n in dropped)  # batch_groups=2 in TINY: the allowance each step
    assert rows[-1]["dynamic/dropped_groups_total"] == sum(dropped) > 0 and rows[-1]["dynamic/gave_up"] > 0
    assert all(r["dynamic/dropped_tokens"] > 0 for r, n in zip(rows, dropped) if n)  # their generation's cost
    assert max(r["staleness_max"] for r in rows) <= 1
