"""Where the cores go (runtime/cores.py): the phase table, read across processes, the rule for a step alone,
and a shared step following the workers layer by layer."""
import torch
import torch.multiprocessing as mp

from runtime.cores import ALONE, SHARED, WAITING, Cores, Threads, follow_workers, step_runs_alone


def test_asynchronous_run_moves_cores_with_the_phase():
    cores = Cores(cores=4, workers=1, ranks=1, max_staleness=2)
    cores.trainer_waiting()
    assert (cores.phase, cores.worker_threads()) == (WAITING, 4)  # the trainer waits: generation has them all
    assert cores.trainer_step(alone=True) == 4 and cores.phase == ALONE
    assert cores.trainer_step(alone=False) == 2 and cores.worker_threads() == 2  # side by side: half each
    cores.trainer_step(alone=True)
    # logging/evaluating beside generation
    assert cores.trainer_after_step() == 2 and cores.worker_threads() == 2


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


def test_a_shared_step_takes_the_cores_of_a_worker_that_does_not_decode():
    cores = Cores(cores=4, workers=2, ranks=1, max_staleness=2)
    cores.trainer_step(alone=False)
    assert cores.moves_in_step and cores.trainer_now() == 4  # no worker decodes: every core
    cores.worker_decoding(1, True)
    assert cores.trainer_now() == 1  # one decodes: the step shares (4 // (2 + 1))
    cores.worker_decoding(1, False)
    cores.worker_decoding(0, True)
    assert cores.trainer_now() == 1
    cores.worker_decoding(0, False)
    assert cores.trainer_now() == 4
    cores.worker_decoding(0, True)
    cores.trainer_step(alone=True)
    assert cores.trainer_now() == 4  # a step alone keeps its count whatever the flags say


def test_synchronous_and_fixed_steps_never_move():
    for cores in (Cores(cores=4, workers=1, ranks=1, max_staleness=0),
                  Cores(4, 1, 1, max_staleness=2, fixed=3)):
        assert not cores.moves_in_step
        cores.trainer_step(alone=False)
        expected = cores.trainer_now()
        cores.worker_decoding(0, True)
        assert cores.trainer_now() == expected == (3 if cores.fixed else 4)


def test_follow_workers_sets_threads_before_each_layer_forward_and_backward(monkeypatch):
    """Two layers: their forwards read the flags as they are then, and so do their backwards, in reverse
    order; the flag flipped between forward and backward shows in the backward's counts."""
    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    cores = Cores(cores=2, workers=1, ranks=1, max_staleness=1)
    cores.trainer_step(alone=False)
    threads = Threads()
    threads.current = 1
    layers = [torch.nn.Linear(3, 3), torch.nn.Linear(3, 3)]
    handles = follow_workers(layers, cores, threads)
    x = torch.randn(2, 3)
    out = layers[1](layers[0](x)).sum()
    assert calls == [2]  # no worker decoded: both forwards on 2 threads (set once, then unchanged)
    cores.worker_decoding(0, True)
    out.backward()
    assert calls == [2, 1]  # a worker decodes: the backwards on 1
    for handle in handles:
        handle.remove()
    layers[0](x).sum().backward()
    assert calls == [2, 1]  # hooks removed: nothing set


def test_threads_mean_is_weighted_by_time(monkeypatch):
    monkeypatch.setattr(torch, "set_num_threads", lambda n: None)
    clock = iter([0.0, 0.0, 1.0, 4.0])  # construction, mark, set at 1 s, mean at 4 s
    monkeypatch.setattr("runtime.cores.time.perf_counter", lambda: next(clock))
    threads = Threads()
    threads.current = 2
    threads.mark()
    threads.set(1)
    assert threads.mean() == (2 * 1 + 1 * 3) / 4


def _worker_reads(cores, out):
    out.put(cores.worker_threads())
    cores.worker_decoding(0, True)


def test_the_phase_crosses_spawn():
    cores = Cores(cores=4, workers=1, ranks=1, max_staleness=1)
    cores.trainer_step(alone=False)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    p = ctx.Process(target=_worker_reads, args=(cores, out))
    p.start()
    p.join(60)
    assert out.get(timeout=5) == 2 and cores.phase == SHARED
    assert cores.trainer_now() == 2  # the worker's flag crossed back: it decodes, so the step shares

def test_threads_sets_torch_only_on_a_change(monkeypatch):
    import torch

    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    threads = Threads()
    threads.set(threads.current)
    threads.set(threads.current + 1)
    threads.set(threads.current)
    assert len(calls) == 1
