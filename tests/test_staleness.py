"""The staleness gate enforces AReaL's bound exactly, across processes, and wakes waiting workers."""
import threading
import time

import torch
import torch.multiprocessing as mp

from buffer.staleness import StalenessGate


def starts_until_refused(gate: StalenessGate) -> int:
    n = 0
    while gate.try_start():
        n += 1
    return n


def test_synchronous_bound_eta0():
    gate = StalenessGate(batch_groups=3, max_staleness=0)
    assert starts_until_refused(gate) == 3  # exactly one batch for version 0
    gate.set_version(1)
    assert gate.version == 1 and starts_until_refused(gate) == 3
    assert gate.started == 6
    gate.cancel(2)
    assert gate.started == 4 and starts_until_refused(gate) == 2


def test_eta2_runs_three_batches_ahead():
    gate = StalenessGate(batch_groups=2, max_staleness=2)
    assert starts_until_refused(gate) == 6  # (2 + 0 + 1) * 2
    gate.set_version(3)
    assert starts_until_refused(gate) == 6 and gate.started == 12  # (2 + 3 + 1) * 2
    gate.cancel()
    assert gate.try_start() and not gate.try_start()


def _hammer(gate: StalenessGate, successes: torch.Tensor, index: int, stop):
    while not stop.is_set():
        if gate.try_start():
            successes[index] += 1


def wait_until(condition, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not condition() and time.monotonic() < deadline:
        time.sleep(0.001)


def test_bound_holds_under_contention():
    ctx = mp.get_context("spawn")
    B, eta, workers = 4, 1, 3
    gate = StalenessGate(batch_groups=B, max_staleness=eta, ctx=ctx)
    successes = torch.zeros(workers, dtype=torch.int64).share_memory_()
    stop = ctx.Event()
    procs = [ctx.Process(target=_hammer, args=(gate, successes, i, stop), daemon=True)
             for i in range(workers)]
    for p in procs:
        p.start()
    try:
        for version in range(1, 16):
            bound = (eta + gate.version + 1) * B
            wait_until(lambda: gate.started >= bound)
            time.sleep(0.01)  # let the hammering workers try to overshoot
            assert gate.started == bound
            if version % 5 == 0:
                gate.cancel(2)  # freed budget is taken again by the workers
                wait_until(lambda: gate.started >= bound)
                assert gate.started == bound
            gate.set_version(version)
        time.sleep(0.05)
    finally:
        stop.set()  # also on failure, so no worker outlives the test
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    assert gate.started == (eta + 15 + 1) * B
    # No increment was lost or doubled: every success the workers saw is counted once.
    assert int(successes.sum()) == gate.started + 2 * 3


def _wait_and_report(gate: StalenessGate, result: torch.Tensor, waiting):
    waiting.set()
    result[1] = float(gate.wait_start(timeout=20))
    result[0] = 1  # done


def test_wait_start_wakes_on_set_version_and_cancel():
    ctx = mp.get_context("spawn")
    gate = StalenessGate(batch_groups=1, max_staleness=0, ctx=ctx)
    assert gate.try_start()
    start = time.monotonic()
    assert gate.wait_start(timeout=0.1) is False
    assert time.monotonic() - start >= 0.09

    result, waiting = torch.zeros(2).share_memory_(), ctx.Event()  # [done, succeeded]
    waiter = ctx.Process(target=_wait_and_report, args=(gate, result, waiting), daemon=True)
    waiter.start()
    assert waiting.wait(60)
    time.sleep(0.3)
    assert result[0] == 0 and gate.started == 1, "wait_start returned while the gate was closed"
    woken_at = time.monotonic()
    gate.set_version(1)
    waiter.join(20)
    assert result.tolist() == [1, 1] and time.monotonic() - woken_at < 5, \
        "wait_start did not wake on set_version"
    assert gate.started == 2

    threading.Timer(0.2, gate.cancel).start()  # a cancelled group frees a start and wakes the waiter
    start = time.monotonic()
    assert gate.wait_start(timeout=10) is True and gate.started == 2
    assert 0.15 < time.monotonic() - start < 5


def _hold_the_lock_and_die(gate: StalenessGate):
    gate._lock.acquire()
    import os
    import signal

    os.kill(os.getpid(), signal.SIGKILL)


def _wait_forever(gate: StalenessGate):
    gate.wait_start(timeout=60)


def test_a_worker_killed_anywhere_cannot_wedge_the_gate():
    ctx = mp.get_context("spawn")
    gate = StalenessGate(batch_groups=1, max_staleness=0, ctx=ctx)
    assert gate.try_start()
    # a worker killed while waiting for budget: set_version must not wait for it to wake
    waiter = ctx.Process(target=_wait_forever, args=(gate,), daemon=True)
    waiter.start()
    time.sleep(1.0)
    waiter.kill()
    waiter.join()
    start = time.monotonic()
    gate.set_version(1)
    assert time.monotonic() - start < 1.0
    assert gate.try_start()
    # a worker killed inside the lock: recover() frees it for the others
    holder = ctx.Process(target=_hold_the_lock_and_die, args=(gate,), daemon=True)
    holder.start()
    holder.join()
    assert gate.recover() is True
    gate.set_version(2)
    assert gate.try_start() and gate.recover() is False


# ---- the rule itself: lag, too old, and the ring's lane size ----

def _group_with_versions(versions: list[int]):
    from tests.test_replay import make_group

    return make_group(0, [[5, 6]] * len(versions), versions=versions)


def test_lag_is_counted_from_the_oldest_token():
    from buffer.staleness import lag, too_old

    group = _group_with_versions([4, 2, 3])
    assert lag(group, 5) == 3 and lag(group, 2) == 0
    assert not too_old(group, 5, max_staleness=3) and too_old(group, 5, max_staleness=2)
    assert not too_old(group, 2, max_staleness=0)


def test_a_lane_holds_every_group_the_gate_lets_one_worker_start():
    from buffer.staleness import lane_slots, started_limit

    for eta, b in [(0, 1), (0, 8), (2, 8), (4, 3)]:
        gate = StalenessGate(batch_groups=b, max_staleness=eta)
        assert starts_until_refused(gate) == started_limit(0, eta, b) == (eta + 1) * b
        # plus the one being written
        assert lane_slots(eta, b) == starts_until_refused(StalenessGate(b, eta)) + 1


def test_an_engine_gets_the_slots_of_every_sequence_the_gate_lets_be_in_flight_and_no_more():
    from buffer.staleness import engine_slots

    k = 8
    for eta, b, max_batch in [(0, 4, 64), (2, 4, 64), (1, 2, 64), (0, 1, 8), (4, 3, 16)]:
        in_flight = starts_until_refused(StalenessGate(b, eta)) * k  # every group started, none delivered yet
        slots = engine_slots(eta, b, k, max_batch)
        assert slots == min(max_batch, in_flight)
    assert engine_slots(0, 4, 8, 64) == 32  # GSM8K's tb run: half the KV cache it had
