"""The bundle every process shares: named worker counters, and what the launcher frees when a worker dies."""
import pytest

from buffer.ring import TrajectoryRing
from buffer.staleness import StalenessGate
from runtime.shared import Finish, Shared, StopFlag, WorkerCounters
from tests.test_ring import MAX_NEW, MAX_PROMPT, K, make_group


def test_counters_are_per_worker_and_summed_by_name():
    counters = WorkerCounters(3)
    counters.add(0, "tokens", 5)
    counters.add(2, "tokens", 7)
    counters.add(2, "groups")
    counters.set(1, "next_group", 4)
    assert (counters.get(0, "tokens"), counters.get(1, "tokens"), counters.get(2, "tokens")) == (5, 0, 7)
    assert counters.total("tokens") == 12 and counters.total("groups") == 1 \
        and counters.get(1, "next_group") == 4
    assert len(counters) == 3
    with pytest.raises(KeyError):
        counters.add(0, "tokenz")


def test_reclaiming_a_dead_worker_drops_only_what_it_had_not_delivered():
    """Worker 1 started 5 groups and delivered 2 (still in the ring) before it died: the 3 others are lost,
    their gate budget comes back, the 2 delivered stay, and a replacement starts at its next group."""
    ring = TrajectoryRing(2 * 8, K, MAX_PROMPT, MAX_NEW, num_producers=2)
    gate = StalenessGate(batch_groups=4, max_staleness=1)  # 8 groups may start before the first step
    shared = Shared(ring, gate, weights=None, counters=WorkerCounters(2), stop=StopFlag())
    c = shared.counters
    for _ in range(5):
        assert gate.try_start()
        c.add(1, "started")
    c.set(1, "next_group", 5)
    for g in range(2):
        assert ring.put(make_group(g * 2 + 1, worker_id=1))
        c.add(1, "groups")
    assert gate.started == 5

    assert shared.reclaim(1) == 3
    assert gate.started == 2 and c.get(1, "started") == 2 and c.get(1, "lost_groups") == 3
    assert c.get(1, "restarts") == 1 and c.get(1, "next_group") == 5
    assert [ring.get(timeout=1).group_id for _ in range(2)] == [1, 3]  # delivered groups are kept, once
    assert ring.get(timeout=0.1) is None
    assert shared.reclaim(1) == 0 and c.get(1, "restarts") == 2 and c.get(1, "lost_groups") == 3
    assert not shared.stop.is_set()
    shared.stop.set()
    assert shared.stop.is_set()


def test_after_the_last_step_a_dead_worker_is_not_reclaimed_and_the_last_row_counts_every_restart():
    """Rank 0 marks its last step and reads the counters under the lock the launcher's restart bookkeeping
    takes: a restart before it is in the row, none happens after it."""
    ring = TrajectoryRing(8, K, MAX_PROMPT, MAX_NEW, num_producers=1)
    gate = StalenessGate(batch_groups=2, max_staleness=1)
    shared = Shared(ring, gate, weights=None, counters=WorkerCounters(1), stop=StopFlag())
    assert gate.try_start()
    shared.counters.add(0, "started")
    assert not shared.rollouts_over()
    assert shared.reclaim(0) == 1  # before the last step: reclaimed, counted
    assert shared.finish.set(lambda: shared.counters.total("restarts")) == 1
    assert shared.rollouts_over() and not shared.stop.is_set()
    assert gate.try_start()
    shared.counters.add(0, "started")
    assert shared.reclaim(0) is None  # after it: untouched, no restart to count
    assert (shared.counters.total("restarts"), shared.counters.get(0, "started"), gate.started) == (1, 1, 1)


def test_the_finish_lock_orders_a_restart_against_the_last_row():
    """While the launcher holds the lock for a restart, rank 0 cannot mark the end; and once marked, the
    launcher sees it."""
    import threading

    finish = Finish()
    marked = threading.Event()
    with finish.unless_set() as finished:
        assert not finished
        threading.Thread(target=lambda: (finish.set(), marked.set()), daemon=True).start()
        assert not marked.wait(0.3) and not finish.is_set()
    assert marked.wait(10) and finish.is_set()
    with finish.unless_set() as finished:
        assert finished


def _exit_soon():
    import time

    time.sleep(0.2)


def test_a_stop_flag_can_trip_when_a_process_ends():
    """For publishers whose engine runs in an unsupervised child (GPU tests, benchmarks): its death ends the
    wait for acks at once."""
    import multiprocessing as mp
    import time

    from runtime.shared import stop_when_dead

    child = mp.get_context("spawn").Process(target=_exit_soon)
    child.start()
    stop = stop_when_dead(child)
    child.join(60)
    deadline = time.monotonic() + 10
    while not stop.is_set() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert stop.is_set() and child.exitcode == 0
