"""The trajectory ring keeps its promises: exactly-once delivery with intact data, back-pressure, limits,
recovery from a dead producer, no /dev/shm leftovers."""
import gc
import os
import signal
import time

import pytest
import torch
import torch.multiprocessing as mp

import buffer.ring
from buffer.ring import MAX_TURNS, WRITING, Group, TrajectoryRing
from engines.weights import WeightStore
from runtime.schema import EnvConfig

K, MAX_PROMPT, MAX_NEW = 4, 12, 16


def make_group(group_id: int, worker_id: int, k: int = K, prompt_len=None, width=None, turns=None) -> Group:
    """Contents are a pure function of group_id, so the consumer can rebuild what it should have received:
    episodes of up to 1 + group_id % 5 turns, each turn's step reward its own."""
    gen = torch.Generator().manual_seed(group_id)
    P = prompt_len or 1 + group_id % MAX_PROMPT
    N = width or 1 + (group_id * 7) % MAX_NEW
    R = turns or 1 + group_id % 5
    taken = torch.randint(1, R + 1, (k,), generator=gen)
    lens = torch.randint(1, N + 1, (k,), generator=gen)
    valid = torch.arange(N) < lens[:, None]
    return Group(
        prompt_ids=torch.randint(0, 50000, (P,), generator=gen),
        completion_ids=torch.randint(1, 50000, (k, N), generator=gen) * valid,
        completion_lens=lens,
        logprobs=-torch.rand(k, N, generator=gen) * valid,
        versions=torch.randint(0, 5, (k, N), generator=gen) * valid,
        rewards=torch.randn(k, generator=gen),
        truncated=lens == N,
        prompt_index=group_id % 97, group_id=group_id, worker_id=worker_id,
        turns=taken, turn_rewards=torch.randn(k, R, generator=gen) * (torch.arange(R) < taken[:, None]),
    )


def assert_same(got: Group, want: Group):
    for name in ("prompt_ids", "completion_ids", "completion_lens", "logprobs", "versions", "rewards",
                 "truncated", "turns", "turn_rewards"):
        a, b = getattr(got, name), getattr(want, name)
        assert a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b), (name, got.group_id)
        assert a.untyped_storage().nbytes() == a.nbytes, f"{name} is not its own copy: keeping it keeps more"
    assert (got.prompt_index, got.group_id, got.worker_id) \
        == (want.prompt_index, want.group_id, want.worker_id)


def _produce(ring: TrajectoryRing, worker_id: int, count: int):
    for i in range(count):
        assert ring.put(make_group(worker_id * 10_000 + i, worker_id), timeout=60)


def test_many_producers_exactly_once():
    ctx = mp.get_context("spawn")
    ring = TrajectoryRing(num_slots=6, group_size=K, max_prompt_len=MAX_PROMPT, max_new_tokens=MAX_NEW,
                          num_producers=3, ctx=ctx)
    producers = [ctx.Process(target=_produce, args=(ring, w, 200), daemon=True) for w in range(3)]
    for p in producers:
        p.start()
    seen, last_from = set(), {}
    for n in range(600):
        group = ring.get(timeout=60)
        assert group is not None, f"ring ran dry after {n} groups"
        assert_same(group, make_group(group.group_id, group.worker_id))
        assert group.group_id not in seen
        seen.add(group.group_id)
        # One producer's puts complete in order, so FIFO delivery keeps them in order too.
        assert group.group_id > last_from.get(group.worker_id, -1)
        last_from[group.worker_id] = group.group_id
        if n % 4 == 0:
            time.sleep(0.002)  # a slow consumer, so producers hit a full ring
    for p in producers:
        p.join(timeout=30)
        assert p.exitcode == 0
    assert seen == {w * 10_000 + i for w in range(3) for i in range(200)}
    assert len(ring) == 0 and ring.get(timeout=0.05) is None


def test_full_ring_blocks_instead_of_dropping():
    ring = TrajectoryRing(num_slots=3, group_size=K, max_prompt_len=MAX_PROMPT, max_new_tokens=MAX_NEW)
    for i in range(3):
        assert ring.put(make_group(i, 0), timeout=1)
    start = time.monotonic()
    assert ring.put(make_group(3, 0), timeout=0.2) is False
    assert time.monotonic() - start >= 0.19
    assert len(ring) == ring.num_slots == 3
    assert ring.get(timeout=1).group_id == 0
    assert ring.put(make_group(3, 0), timeout=0.2)
    assert [ring.get(timeout=1).group_id for _ in range(3)] == [1, 2, 3]


def test_oversize_groups_are_rejected():
    ring = TrajectoryRing(num_slots=2, group_size=K, max_prompt_len=MAX_PROMPT, max_new_tokens=MAX_NEW)
    with pytest.raises(ValueError, match="max_new_tokens"):
        ring.put(make_group(1, 0, width=MAX_NEW + 1))
    with pytest.raises(ValueError, match="max_prompt_len"):
        ring.put(make_group(1, 0, prompt_len=MAX_PROMPT + 1))
    with pytest.raises(ValueError, match="K="):
        ring.put(make_group(1, 0, k=K + 1))
    with pytest.raises(ValueError, match="num_producers=1"):
        ring.put(make_group(1, 1))
    with pytest.raises(ValueError, match=r"turn_rewards must be \[K=4, R\] with 1 <= R <= MAX_TURNS=64"):
        ring.put(make_group(1, 0, turns=MAX_TURNS + 1))
    with pytest.raises(ValueError, match="config key 'env.max_turns' must be <= 64"):
        EnvConfig(max_turns=MAX_TURNS + 1).check()
    assert len(ring) == 0
    # exactly at the limits
    assert ring.put(make_group(1, 0, prompt_len=MAX_PROMPT, width=MAX_NEW, turns=MAX_TURNS), timeout=1)
    assert_same(ring.get(timeout=1), make_group(1, 0, prompt_len=MAX_PROMPT, width=MAX_NEW, turns=MAX_TURNS))


def test_each_turn_s_reward_survives_the_ring_and_a_one_shot_group_holds_its_reward_on_its_one_turn():
    ring = TrajectoryRing(num_slots=4, group_size=K, max_prompt_len=MAX_PROMPT, max_new_tokens=MAX_NEW)
    for turns in (3, 1, 5):  # a slot's record shrinks and grows with the group's turns
        ring.put(make_group(10 + turns, 0, turns=turns), timeout=1)
        got = ring.get(timeout=1)
        assert got.turn_rewards.shape == (K, turns) and (got.turn_rewards[:, 1:] != 0).any() == (turns > 1)
        assert_same(got, make_group(10 + turns, 0, turns=turns))
    one_shot = make_group(3, 0)
    one_shot.turns, one_shot.turn_rewards = None, None
    one_shot.__post_init__()
    assert one_shot.turns.tolist() == [1] * K
    assert torch.equal(one_shot.turn_rewards, one_shot.rewards[:, None])
    assert ring.put(one_shot, timeout=1)
    assert torch.equal(ring.get(timeout=1).turn_rewards, one_shot.turn_rewards)


def test_min_version_ignores_padding():
    group = make_group(5, 0, width=4)
    group.completion_lens = torch.tensor([2, 4, 1, 3])
    group.versions = torch.tensor([[7, 7, 0, 0], [9, 8, 8, 8], [6, 0, 0, 0], [7, 7, 7, 0]])
    assert group.min_version() == 6


def test_oldest_first_across_lanes_and_a_full_lane_blocks_only_its_producer():
    ring = TrajectoryRing(num_slots=4, group_size=K, max_prompt_len=MAX_PROMPT, max_new_tokens=MAX_NEW,
                          num_producers=2)
    assert ring.lane_slots == 2
    for group_id, worker in [(1, 1), (2, 0), (3, 1)]:
        assert ring.put(make_group(group_id, worker), timeout=1)
    assert ring.put(make_group(4, 1), timeout=0.1) is False  # lane 1 is full...
    assert ring.put(make_group(5, 0), timeout=0.1)  # ...lane 0 is not
    assert [ring.get(timeout=1).group_id for _ in range(4)] == [1, 2, 3, 5]


def _die_while_writing(ring: TrajectoryRing, worker_id: int, published: int):
    """Publish `published` groups, then die by SIGKILL inside the next put, after its data, before READY."""
    clock_reads = iter(range(published + 1))

    def monotonic_ns():  # put reads this clock once per group, right before it publishes
        if next(clock_reads) == published:
            os.kill(os.getpid(), signal.SIGKILL)
        return time.monotonic_ns()

    buffer.ring.time = type("Clock", (), {"monotonic": staticmethod(time.monotonic),
                                          "monotonic_ns": staticmethod(monotonic_ns)})
    for i in range(published + 1):
        ring.put(make_group(worker_id * 10_000 + i, worker_id), timeout=60)


def test_reclaim_after_a_producer_is_killed_mid_write():
    ctx = mp.get_context("spawn")
    ring = TrajectoryRing(num_slots=8, group_size=K, max_prompt_len=MAX_PROMPT, max_new_tokens=MAX_NEW,
                          num_producers=2, ctx=ctx)
    survivor = ctx.Process(target=_produce, args=(ring, 0, 100), daemon=True)
    victim = ctx.Process(target=_die_while_writing, args=(ring, 1, 6), daemon=True)
    survivor.start()
    victim.start()
    seen = []
    while survivor.is_alive() or victim.is_alive() or len(ring):
        group = ring.get(timeout=0.1)
        if group is not None:
            assert_same(group, make_group(group.group_id, group.worker_id))
            seen.append(group.group_id)
    survivor.join(10)
    victim.join(10)
    assert survivor.exitcode == 0 and victim.exitcode == -signal.SIGKILL
    assert ring.reclaim(1) == 1  # the group it was writing; the six it published were delivered
    assert ring.get(timeout=0.1) is None
    assert sorted(seen) == list(range(100)) + [10_000 + i for i in range(6)]

    for i in range(ring.lane_slots):  # a restarted worker 1 gets its whole lane back
        assert ring.put(make_group(20_000 + i, 1), timeout=1)
    assert ring.put(make_group(20_000 + ring.lane_slots, 1), timeout=0.1) is False
    assert ([ring.get(timeout=1).group_id for _ in range(ring.lane_slots)]
            == [20_000 + i for i in range(ring.lane_slots)])


def test_reclaim_repairs_every_step_a_producer_can_die_between():
    """Worker 3's lane after each way of dying (a process dies once; reclaim repairs them all at once)."""
    ring = TrajectoryRing(num_slots=16, group_size=K, max_prompt_len=MAX_PROMPT, max_new_tokens=MAX_NEW,
                          num_producers=4)
    assert ring.lane_slots == 4
    assert ring.put(make_group(30_000, 3), timeout=1)
    assert ring._ready.acquire(timeout=1)  # died after marking slot 0 READY, before counting it
    assert ring.put(make_group(30_001, 3), timeout=1)  # slot 1: a normal publish
    assert ring._free[3].acquire(timeout=1)  # died after taking a free count, before claiming a slot
    assert ring._free[3].acquire(timeout=1)
    ring._state[3 * ring.lane_slots + 2] = WRITING  # died while writing slot 2
    assert ring.reclaim(3) == 1
    assert [ring.get(timeout=1).group_id for _ in range(2)] == [30_000, 30_001]
    assert ring.get(timeout=0.1) is None
    for i in range(ring.lane_slots):  # the whole lane is free again, and no more than that
        assert ring.put(make_group(30_002 + i, 3), timeout=1)
    assert ring.put(make_group(30_009, 3), timeout=0.1) is False
    assert ring.reclaim(3) == 0  # nothing was being written: reclaiming a healthy lane changes nothing
    assert ([ring.get(timeout=1).group_id for _ in range(ring.lane_slots)]
            == [30_002 + i for i in range(ring.lane_slots)])
    assert ring.get(timeout=0.1) is None


def _hold_and_wait(ring: TrajectoryRing, store: WeightStore, ready):
    ring.put(make_group(42, 1), timeout=10)
    store.read_into({"w": torch.empty(1000)})
    ready.set()
    time.sleep(600)


def _ours(names: set[str], pids: list[int], semaphores: list[str]) -> set[str]:
    """Entries attributable to this test (other test runs may share /dev/shm)."""
    return {n for n in names if any(n.startswith(f"torch_{pid}_") for pid in pids) or n in semaphores}


def test_no_dev_shm_leftovers_after_sigkill():
    before = set(os.listdir("/dev/shm"))
    ctx = mp.get_context("spawn")
    ring = TrajectoryRing(num_slots=2, group_size=K, max_prompt_len=MAX_PROMPT, max_new_tokens=MAX_NEW,
                          num_producers=2, ctx=ctx)
    store = WeightStore({"w": (torch.Size([1000]), torch.float32)})
    store.publish([("w", torch.ones(1000))], version=1)
    ready = ctx.Event()
    child = ctx.Process(target=_hold_and_wait, args=(ring, store, ready), daemon=True)
    child.start()
    assert ready.wait(60)
    os.kill(child.pid, signal.SIGKILL)
    child.join(10)
    assert child.exitcode == -signal.SIGKILL
    assert_same(ring.get(timeout=1), make_group(42, 1))  # the dead child's data survives in the parent

    semaphores = ["sem." + s._semlock.name.lstrip("/") for s in (*ring._free, ring._ready)]
    pids = [os.getpid(), child.pid]
    # torch's file_descriptor strategy unlinks its segments at once: none has a name, even while in use.
    assert not _ours(set(os.listdir("/dev/shm")) - before, pids, []), "named torch segment in /dev/shm"
    del ring, store, ready, child
    gc.collect()
    # The spawn semaphores are named; they must go with their objects.
    assert not _ours(set(os.listdir("/dev/shm")) - before, pids, semaphores)
