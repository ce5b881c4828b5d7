"""Where the cores go (launch/cores.py): the phase table, read across processes, and the rule for a step alone."""
import torch.multiprocessing as mp

from launch.cores import ALONE, SHARED, WAITING, Cores, Threads, step_runs_alone


def test_asynchronous_run_moves_cores_with_the_phase():
    cores = Cores(cores=4, workers=1, ranks=1, max_staleness=2)
    cores.trainer_waiting()
    assert (cores.phase, cores.worker_threads()) == (WAITING, 4)  # the trainer waits: generation has them all
    assert cores.trainer_step(alone=True) == 4 and cores.phase == ALONE
    assert cores.trainer_step(alone=False) == 2 and cores.worker_threads() == 2  # side by side: half each
    cores.trainer_step(alone=True)
    assert cores.trainer_after_step() == 2 and cores.worker_threads() == 2  # logging/evaluating beside generation


def test_synchronous_run_keeps_full_counts_whatever_the_state():
    """eta = 0: training and generation never overlap, so neither count ever changes (reproducible)."""
    cores = Cores(cores=2, workers=1, ranks=1, max_staleness=0)
    for call in (cores.trainer_waiting, lambda: cores.trainer_step(alone=False), cores.trainer_after_step):
        call()
        assert cores.worker_threads() == 2
    assert cores.trainer_step(alone=False) == 2 and cores.trainer_after_step() == 2


def test_several_processes_a_side_split_that_side_s_cores():
    cores = Cores(cores=8, workers=2, ranks=4, max_staleness=1)
    assert (cores.most("worker"), cores.most("trainer"), cores.share) == (4, 2, 1)
    assert cores.trainer_step(alone=False) == 1 and cores.trainer_step(alone=True) == 2


def test_a_fixed_count_never_moves():
    cores = Cores(cores=8, workers=1, ranks=1, max_staleness=2, fixed=3)
    cores.trainer_waiting()
    assert cores.worker_threads() == 3 and cores.trainer_step(alone=True) == 3 and cores.most("worker") == 3


def test_a_step_runs_alone_only_when_nothing_can_generate():
    assert step_runs_alone(gate_exhausted=True, in_flight=0)
    assert not step_runs_alone(gate_exhausted=True, in_flight=1)  # a group is still being generated or scored
    assert not step_runs_alone(gate_exhausted=False, in_flight=0)  # the gate would let a new one start


def _worker_reads(cores, out):
    out.put(cores.worker_threads())


def test_the_phase_crosses_spawn():
    cores = Cores(cores=4, workers=1, ranks=1, max_staleness=1)
    cores.trainer_step(alone=False)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=_worker_reads, args=(cores, out))
    p.start()
    p.join(60)
    assert out.get(timeout=5) == 2 and cores.phase == SHARED


def test_threads_sets_torch_only_on_a_change(monkeypatch):
    import torch

    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    threads = Threads()
    threads.set(threads.current)
    threads.set(threads.current + 1)
    threads.set(threads.current)
    assert len(calls) == 1
