"""No silent hang: heartbeats (runtime/heartbeat.py), the supervisor's watch of them (launch/supervisor.py),
and what a run does with a stuck process; a full disk at a checkpoint and the out-of-memory killer's kill."""
import errno
import json
import os
import signal
import subprocess
import time

import pytest
import torch

from launch.supervisor import Supervisor
from runtime.heartbeat import PHASES, Allowance, Heartbeats
from tests.helpers import ROOT, TINY, alive, comm, descendants, die_with_parent, shm_files, train_cmd


def test_a_beat_older_than_its_phase_allows_is_stuck():
    hearts = Heartbeats(["rollout-0", "trainer-0"])
    rollout, trainer = hearts.of("rollout-0"), hearts.of("trainer-0")
    rollout.beat("generate")
    trainer.beat("evaluate")
    now = time.monotonic()
    allowance = Allowance(hang_s=10, slow_s=100, start_s=1000)
    assert hearts.stuck(allowance, now=now + 5) == []
    assert [(n, p) for n, p, _ in hearts.stuck(allowance, now=now + 50)] == [("rollout-0", "generate")]
    assert [(n, p) for n, p, _ in hearts.stuck(allowance, now=now + 150)] == [("rollout-0", "generate"),
                                                                                ("trainer-0", "evaluate")]
    hearts.restart("rollout-0")  # a new process: start-up has its own allowance
    assert [n for n, _, _ in hearts.stuck(allowance, now=time.monotonic() + 500)] == ["trainer-0"]
    trainer.beat("done")  # a process that finished is never stuck
    assert hearts.stuck(allowance, now=time.monotonic() + 500) == []
    trainer.post_step(7)
    assert hearts.step("trainer-0") == 7 and hearts.phase("trainer-0") == "done"
    assert set(PHASES) >= {"generate", "wait_gate", "ring_put", "load_weights", "train_step", "publish",
                           "evaluate", "checkpoint", "collective"}


def test_beats_cross_spawn():
    import multiprocessing as mp

    hearts = Heartbeats(["rollout-0"])
    proc = mp.get_context("spawn").Process(target=_beat_once, args=(hearts,))
    proc.start()
    proc.join(60)
    assert proc.exitcode == 0 and hearts.phase("rollout-0") == "ring_put"


def _beat_once(hearts):
    hearts.of("rollout-0").beat("ring_put")


def _beat_then_hang(hearts, name, stop_self):
    hearts.of(name).beat("generate")
    if stop_self:
        os.kill(os.getpid(), signal.SIGSTOP)
        hearts.of(name).beat("ring_put")  # continued: a dumped process must end before it gets here
    _a_function_that_never_returns()


def _a_function_that_never_returns():
    while True:
        time.sleep(1)


@pytest.mark.parametrize("stop_self", [False, True], ids=["sleeping", "SIGSTOPped"])
def test_the_supervisor_names_dumps_and_kills_a_stuck_process(tmp_path, stop_self):
    hearts = Heartbeats(["rollout-0"])
    sup = Supervisor(str(tmp_path / "stacks"), hearts, Allowance(hang_s=2.0, slow_s=30.0, start_s=30.0))
    try:
        sup.start("rollout-0", _beat_then_hang, dict(hearts=hearts, name="rollout-0", stop_self=stop_self), 1,
                  essential=True)
        message = sup.watch()
    finally:
        sup.shutdown()
    assert message.startswith("rollout-0 stuck in generate for ") and "\n" not in message
    seconds = int(message.split(" for ")[1].split(" s")[0])
    assert 2 <= seconds < 30  # judged by the hang allowance since its last beat, not the slow one
    [stack] = os.listdir(tmp_path / "stacks")
    assert stack.startswith("rollout-0-") and stack in message
    assert "in _beat_then_hang" in (tmp_path / "stacks" / stack).read_text()
    # Ended by the dump's own signal, as it wrote its stack: a stopped process did not run on once continued.
    assert sup.procs["rollout-0"].exitcode == -signal.SIGUSR1 and hearts.phase("rollout-0") == "generate"


def test_a_process_stuck_at_start_is_caught_by_the_slow_allowance(tmp_path):
    hearts = Heartbeats(["rollout-0"])
    sup = Supervisor(str(tmp_path / "stacks"), hearts, Allowance(hang_s=1.0, slow_s=1.0, start_s=4.0))
    try:
        # never beats: stays in "start"
        sup.start("rollout-0", _a_function_that_never_returns, {}, 1, essential=True)
        time.sleep(2.0)
        assert not sup.ended()  # start-up may take longer than hang_timeout_s
        assert sup.watch().startswith("rollout-0 stuck in start for ")
    finally:
        sup.shutdown()


def _trainer_that_finishes_then_lingers(hearts, finished, hang_s, worker_pid):
    """Marks the last step taken, then checkpoints (a slow phase) until rollout-0 is stopped and has gone
    without a beat for three times its allowance: long enough for a watch that still checked it to have killed
    it."""
    heart = hearts.of("trainer-0")
    heart.beat("train_step")
    finished.set()
    while True:
        heart.beat("checkpoint")
        ages = {name: age for name, _, age in hearts.stuck(Allowance(hang_s, hang_s, hang_s))}
        pid = int(worker_pid[0])
        if pid and _state(pid) == "T" and ages.get("rollout-0", 0) > 3 * hang_s:
            return
        time.sleep(0.05)


def _state(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return ""


def _worker_that_stops_after_the_last_step(hearts, finished, stop, worker_pid):
    worker_pid[0] = os.getpid()
    heart = hearts.of("rollout-0")
    while not finished.is_set():
        heart.beat("generate")
        time.sleep(0.01)
    os.kill(os.getpid(), signal.SIGSTOP)  # stopped after the last step, before it could exit
    while not stop.is_set():  # continued by the shutdown: it stops as asked
        time.sleep(0.01)


def test_after_the_last_step_a_stopped_worker_is_neither_dumped_nor_killed_nor_restarted(tmp_path):
    hearts = Heartbeats(["rollout-0", "trainer-0"])
    sup = Supervisor(str(tmp_path / "stacks"), hearts, Allowance(hang_s=1.0, slow_s=60.0, start_s=60.0))
    failures = []
    worker_pid = torch.zeros(1, dtype=torch.long).share_memory_()
    try:
        sup.start("rollout-0", _worker_that_stops_after_the_last_step,
                  dict(hearts=hearts, finished=sup.finished, stop=sup.stop, worker_pid=worker_pid), 1)
        sup.start("trainer-0", _trainer_that_finishes_then_lingers,
                  dict(hearts=hearts, finished=sup.finished, hang_s=1.0, worker_pid=worker_pid),
                  1, essential=True)
        outcome = sup.watch(on_failure=lambda name, message: failures.append(message))
    finally:
        late = sup.shutdown(grace=20)
    assert outcome is None and failures == []
    assert not (tmp_path / "stacks").exists()
    assert late is None and sup.procs["rollout-0"].exitcode == 0  # continued, it saw the stop and exited


def _ignores_the_stop(hearts):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    hearts.of("rollout-0").beat("generate")
    _a_function_that_never_returns()


def test_the_shutdown_names_what_it_had_to_kill():
    hearts = Heartbeats(["rollout-0"])
    sup = Supervisor(hearts=hearts)
    try:
        sup.start("rollout-0", _ignores_the_stop, dict(hearts=hearts), 1)
        while hearts.phase("rollout-0") != "generate":  # SIGTERM ignored from here on
            assert sup.procs["rollout-0"].exitcode is None
            time.sleep(0.01)
    finally:
        late = sup.shutdown(grace=0.5)
    assert late == "rollout-0 did not stop within 0.5 s of being asked to; killed"
    assert sup.procs["rollout-0"].exitcode == -signal.SIGKILL


def test_the_shutdown_removes_the_cuda_ipc_files_its_processes_leave(tmp_path):
    """A process that shared CUDA memory leaves the driver's cuda.shm.<n>.<pid in hex>.<n> even after a clean
    exit, and torch's torch_<pid>_<n>_<n> after an exit without teardown (both seen on an H200,
    scripts/gpu_check.py): the shutdown removes those of the processes it started, killed ones too, and nobody
    else's."""
    sup = Supervisor()
    other = f"cuda.shm.0.{os.getpid():x}.1"  # this process is alive: its file is not the shutdown's to remove
    open(f"/dev/shm/{other}", "w").close()
    try:
        sup.start("trainer-0", _leave_cuda_ipc_files, {}, 1, essential=True)
        assert sup.watch() is None
        sup.start("rollout-0", _leave_cuda_ipc_files_and_hang, {}, 1)
        while len([n for n in shm_files() if f".{sup.procs['rollout-0'].pid:x}." in n]) < 1:
            assert sup.procs["rollout-0"].exitcode is None
            time.sleep(0.01)
        left = {n for n in shm_files() for p in sup.pids if f".{p:x}." in n or n.startswith(f"torch_{p}_")}
        assert len(left) == 3
    finally:
        sup.shutdown(grace=0.5)
        kept = other in shm_files()
        os.unlink(f"/dev/shm/{other}")
    assert sup.procs["rollout-0"].exitcode == -signal.SIGTERM
    assert not left & shm_files() and kept


def _leave_cuda_ipc_files():
    for name in (f"cuda.shm.0.{os.getpid():x}.1", f"torch_{os.getpid()}_1751493123_0"):
        open(f"/dev/shm/{name}", "w").close()


def _leave_cuda_ipc_files_and_hang():
    open(f"/dev/shm/cuda.shm.0.{os.getpid():x}.1", "w").close()
    while True:
        time.sleep(1)


def test_a_kill_nobody_asked_for_is_reported_as_probably_out_of_memory():
    sup = Supervisor()
    sup.peak_mb = 5915.0
    try:
        sup.start("rollout-0", _a_function_that_never_returns, {}, 1, essential=True)
        time.sleep(0.5)
        os.kill(sup.procs["rollout-0"].pid, signal.SIGKILL)
        message = sup.watch()
    finally:
        sup.shutdown()
    assert message == ("rollout-0 died (killed by SIGKILL: probably the kernel's out-of-memory killer; "
                       "the run's processes used up to 5,915 MB)")


def test_a_full_disk_at_a_checkpoint_is_one_line_and_keeps_the_previous_one(tiny_model_dir, tmp_path,
                                                                            monkeypatch):
    import torch
    from transformers import AutoModelForCausalLM

    import trainer.checkpoint as checkpoint

    class Policy:
        lm = AutoModelForCausalLM.from_pretrained(tiny_model_dir)

    monkeypatch.setattr(checkpoint, "gathered_weights", lambda policy: dict(policy.lm.state_dict()))
    monkeypatch.setattr(checkpoint.dist, "get_rank", lambda: 0)
    state = {"step": 1, "time_s": 1.0, "next_group": {}}
    checkpoint.save_checkpoint(Policy(), tiny_model_dir, str(tmp_path), 1, state)

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full)
    with pytest.raises(OSError) as info:
        checkpoint.save_checkpoint(Policy(), tiny_model_dir, str(tmp_path), 2, dict(state, step=2))
    assert info.value.errno == errno.ENOSPC and "\n" not in str(info.value)
    assert str(info.value).startswith("no space left on the device for checkpoint step_2")
    assert sorted(os.listdir(tmp_path / "checkpoints")) == ["step_1"]  # no half-written one
    assert checkpoint.latest_resumable(str(tmp_path))[0] == 1
    AutoModelForCausalLM.from_pretrained(tmp_path / "checkpoints" / "step_1")


# The real entry point: a process stopped by the operating system mid-run.

HANG = ("cluster.hang_timeout_s=5", "eval.every=0", "progress=false")


def _start(run_dir, model_dir, *overrides, steps=1000, first_row=True):
    proc = subprocess.Popen(train_cmd(run_dir, f"model.path={model_dir}", f"steps={steps}", *TINY, *HANG,
                                      *overrides),
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=die_with_parent)
    if first_row:
        _wait_rows(proc, run_dir, 1)
    return proc


def _wait_rows(proc, run_dir, n: int, timeout: float = 300) -> None:
    """Until metrics.jsonl has `n` rows (polled often: what a test does next must land close behind)."""
    deadline = time.time() + timeout
    path = run_dir / "metrics.jsonl"
    while not (path.exists() and path.read_text().count("\n") >= n):
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise AssertionError(f"no row {n}: {proc.communicate()[1][-2000:]}")
        time.sleep(0.005)


def _process(proc, name: str, timeout: float = 120) -> int:
    deadline = time.time() + timeout
    while time.time() < deadline:
        found = [p for p in descendants(proc.pid) if comm(p) == name]
        if found:
            return found[0]
        time.sleep(0.05)
    proc.kill()
    raise AssertionError(f"no {name} process")


def _signal(pid: int, name: str, sig) -> None:
    """Send `sig` to `pid` if it is still `name`'s process (it may have exited, and its pid been reused)."""
    if comm(pid) == name:
        try:
            os.kill(pid, sig)
        except ProcessLookupError:
            pass


def _rows(run_dir):
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line) for line in f]


def _stderr_at_end(proc, timeout: float = 120) -> str:
    """The run's stderr once it ends; a run still going after `timeout` seconds is killed."""
    try:
        return proc.communicate(timeout=timeout)[1]
    finally:
        if proc.poll() is None:
            proc.kill()


def _summary(run_dir):
    return json.loads((run_dir / "summary.json").read_text())


def test_a_stopped_rollout_worker_is_named_dumped_replaced_and_the_run_finishes(tiny_model_dir, tmp_path):
    """The stop lands where the run cannot finish without a restart, whatever this machine's speed: trainer-0
    is held while rollout-0 is stopped, so the rows written then bound what the worker can have started (the
    gate: (max_staleness + version + 1) * B groups, version <= rows + 1), hence the steps the trainer can
    take."""
    steps, eta = 10, 1
    proc = _start(tmp_path, tiny_model_dir, f"max_staleness={eta}", "cluster.max_restarts=1", steps=steps,
                  first_row=False)
    worker, trainer = _process(proc, "rollout-0"), _process(proc, "trainer-0")
    _wait_rows(proc, tmp_path, 1)
    os.kill(trainer, signal.SIGSTOP)
    os.kill(worker, signal.SIGSTOP)
    stopped, rows_then = time.time(), len(_rows(tmp_path))
    os.kill(trainer, signal.SIGCONT)
    assert eta + rows_then + 2 < steps, f"the stop landed too late to force a restart ({rows_then} rows)"
    stderr = _stderr_at_end(proc, timeout=240)
    assert proc.returncode == 0, stderr[-3000:]
    line = next(line for line in stderr.splitlines() if "rollout-0 stuck in" in line)
    assert "restarting it (1/1)" in line
    seconds = int(line.split(" for ")[1].split(" s")[0])
    assert 5 <= seconds < 60  # hang_timeout_s, plus the watch's rounds; far below slow_timeout_s
    [stack] = os.listdir(tmp_path / "stacks")
    assert os.path.getmtime(tmp_path / "stacks" / stack) - stopped < 60
    assert "File " in (tmp_path / "stacks" / stack).read_text()
    rows = _rows(tmp_path)
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    assert max(r["staleness_max"] for r in rows) <= eta and rows[-1]["rollout/restarts"] == 1
    summary = _summary(tmp_path)
    assert summary["rollout/restarts"] == 1 \
        and summary["rollout/lost_groups"] == rows[-1]["rollout/lost_groups"]


def test_a_worker_stopped_after_the_last_step_is_not_restarted_and_the_counts_agree(tiny_model_dir, tmp_path):
    """Once the last row is written, rollout-0 is stopped (if it has not already exited, as it does once the
    trainer is done) and trainer-0 is held past the hang allowance: the shutdown, not the watchdog, deals with
    the worker. Whether the launcher would have acted can only be seen after its allowance has passed: hence
    the one wait for time here, which on a slow machine can only make the test pass less strictly."""
    steps = 3
    proc = _start(tmp_path, tiny_model_dir, "max_staleness=1", "cluster.max_restarts=3", steps=steps,
                  first_row=False)
    worker, trainer = _process(proc, "rollout-0"), _process(proc, "trainer-0")
    _wait_rows(proc, tmp_path, steps)
    _signal(trainer, "trainer-0", signal.SIGSTOP)
    _signal(worker, "rollout-0", signal.SIGSTOP)
    time.sleep(5 + 4)  # cluster.hang_timeout_s, and a few of the watch's 1-second rounds
    _signal(trainer, "trainer-0", signal.SIGCONT)
    stderr = _stderr_at_end(proc)
    assert proc.returncode == 0, stderr[-3000:]
    assert "stuck" not in stderr and "restarting" not in stderr, stderr[-3000:]
    assert not (tmp_path / "stacks").exists()
    last, summary = _rows(tmp_path)[-1], _summary(tmp_path)
    assert summary["status"] == "completed" and summary["steps"] == steps
    assert {k: summary[k] for k in ("rollout/restarts", "rollout/lost_groups")} == \
        {k: last[k] for k in ("rollout/restarts", "rollout/lost_groups")} == {"rollout/restarts": 0,
                                                                           "rollout/lost_groups": 0}


def test_a_stopped_trainer_stops_the_run_in_one_line_and_keeps_its_checkpoint(tiny_model_dir, tmp_path):
    before = shm_files()
    # slow phases (a checkpoint every step here) get 8 s: the stop may land in one
    proc = _start(tmp_path, tiny_model_dir, "checkpoint.every=1", "cluster.slow_timeout_s=8")
    _wait_rows(proc, tmp_path, 2)  # step_1's checkpoint is written before row 2
    family = descendants(proc.pid)
    os.kill(_process(proc, "trainer-0"), signal.SIGSTOP)
    stderr = _stderr_at_end(proc)
    assert proc.returncode == 1
    errors = [line for line in stderr.splitlines() if line.startswith("error:")]
    assert len(errors) == 1 and errors[0].startswith("error: trainer-0 stuck in "), stderr[-3000:]
    time.sleep(0.5)
    assert not [p for p in family if alive(p)], "a child process outlived the run"
    assert shm_files() <= before
    from transformers import AutoModelForCausalLM

    from trainer.checkpoint import latest_resumable
    step, path = latest_resumable(str(tmp_path))
    assert step >= 1
    AutoModelForCausalLM.from_pretrained(path)


def test_a_worker_stuck_before_its_first_group_stops_the_run_and_is_not_restarted(tiny_model_dir, tmp_path):
    proc = _start(tmp_path, tiny_model_dir, "cluster.start_timeout_s=10", "cluster.max_restarts=3",
                  first_row=False)
    os.kill(_process(proc, "rollout-0"), signal.SIGSTOP)  # at once: still loading its tokenizer, task, engine
    stderr = _stderr_at_end(proc)
    assert proc.returncode == 1
    # in `start` unless this machine got it through start-up before the stop landed; never restarted either
    # way
    assert "error: rollout-0 stuck in " in stderr and "restarting" not in stderr, stderr[-3000:]
    assert not (tmp_path / "metrics.jsonl").exists() or not _rows(tmp_path)
