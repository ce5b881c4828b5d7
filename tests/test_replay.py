"""The replay buffer keeps its promises: FIFO exactly once in order, TBA's fresh/replay mix and reward
softmax, per-prompt capacity, de-duplication, well-formed replayed groups, age stats, config errors."""
import math

import pytest
import torch

from buffer.replay import ReplayBuffer
from buffer.ring import Group
from runtime.schema import BufferConfig


def _buffer(sampler: str = "fifo", seed: int = 0, **changes) -> ReplayBuffer:
    """A buffer with the schema's defaults (buffer section), but for `changes`."""
    cfg = BufferConfig()
    values = dict(recent_prob=cfg.recent_prob, inv_temp=cfg.inv_temp,
                  per_prompt_capacity=cfg.per_prompt_capacity)
    values.update(changes)
    return ReplayBuffer(sampler, values["recent_prob"], values["inv_temp"], values["per_prompt_capacity"],
                        seed)


def make_group(prompt_index: int, completions: list[list[int]], rewards=None, versions=None,
               group_id: int = 0, width: int | None = None) -> Group:
    """Completion i gets logprobs -(i+1)/10 per token and version versions[i] (default 1); padding is 0."""
    k = len(completions)
    width = width or max(1, max(len(c) for c in completions))
    rewards = rewards if rewards is not None else [0.0] * k
    versions = versions if versions is not None else [1] * k
    ids, logprobs, vers = (torch.zeros(k, width, dtype=dt)
                           for dt in (torch.int64, torch.float32, torch.int64))
    for i, c in enumerate(completions):
        ids[i, :len(c)] = torch.tensor(c, dtype=torch.int64)
        logprobs[i, :len(c)] = -(i + 1) / 10
        vers[i, :len(c)] = versions[i]
    lens = torch.tensor([len(c) for c in completions], dtype=torch.int64)
    return Group(prompt_ids=torch.tensor([100 + prompt_index, 7]), completion_ids=ids, completion_lens=lens,
                 logprobs=logprobs, versions=vers, rewards=torch.tensor(rewards, dtype=torch.float32),
                 truncated=lens == width, prompt_index=prompt_index, group_id=group_id, worker_id=3)


def rows(group: Group) -> list[tuple[int, ...]]:
    return [tuple(group.completion_ids[i, :n].tolist()) for i, n in enumerate(group.completion_lens.tolist())]


def test_fifo_returns_each_group_once_in_add_order():
    buf = _buffer("fifo")
    added = [make_group(i % 3, [[i, 1], [i, 2]], group_id=i) for i in range(10)]
    for g in added[:7]:
        buf.add(g, version=0)
    assert len(buf) == 7 and buf.ready(7) and not buf.ready(8)
    got = buf.sample(3, version=1) + buf.sample(4, version=1)
    assert not buf.ready(1) and len(buf) == 0
    with pytest.raises(RuntimeError, match="ready"):
        buf.sample(1, version=1)
    for g in added[7:]:
        buf.add(g, version=1)
    got += buf.sample(3, version=2)
    assert [g.group_id for g in got] == list(range(10))
    assert all(a is b for a, b in zip(got, added))
    assert buf.stats()["buffer/recent_frac"] == 1.0


def test_tba_recent_fraction_matches_recent_prob():
    m, n = 0.3, 2000
    buf = _buffer("tba", recent_prob=m, per_prompt_capacity=8, seed=1)
    for i in range(n):  # more fresh groups than draws, so no recent draw has to fall back
        buf.add(make_group(i % 5, [[i, 1], [i, 2]], group_id=i), version=0)
    got = buf.sample(n, version=0)
    fresh = [g for g in got if g.group_id >= 0]
    sd = math.sqrt(m * (1 - m) / n)
    assert abs(len(fresh) / n - m) < 4 * sd
    assert buf.stats()["buffer/recent_frac"] == len(fresh) / n
    # newest first, each once
    assert [g.group_id for g in fresh] == list(range(n - 1, n - 1 - len(fresh), -1))
    assert len(buf) == n - len(fresh)
    replayed = [g.group_id for g in got if g.group_id < 0]
    assert len(set(replayed)) == len(replayed) and all(g.worker_id == -1 for g in got if g.group_id < 0)


def test_tba_falls_back_both_ways():
    only_recent = _buffer("tba", recent_prob=1.0)
    only_recent.add(make_group(0, [[1], [2]], group_id=5), version=0)
    assert only_recent.ready(3)  # one fresh group, then replay
    assert [g.group_id >= 0 for g in only_recent.sample(3, version=0)] == [True, False, False]
    only_replay = _buffer("tba", recent_prob=0.0)
    # one distinct completion < K: no replay
    only_replay.add(make_group(0, [[1], [1]], group_id=5), version=0)
    assert only_replay.ready(1) and not only_replay.ready(2)
    assert only_replay.sample(1, version=0)[0].group_id == 5


def test_replay_draws_follow_reward_softmax():
    rewards, beta, n = [0.0, 0.5, 1.0, 1.5, 2.0], 1.5, 6000
    buf = _buffer("tba", recent_prob=0.0, inv_temp=beta, seed=2)
    for i, r in enumerate(rewards):  # K = 1: one completion per group
        buf.add(make_group(0, [[10 + i]], rewards=[r]), version=0)
    counts = [0] * len(rewards)
    for g in buf.sample(n, version=0):
        counts[int(g.completion_ids[0, 0]) - 10] += 1
        assert float(g.rewards[0]) == rewards[int(g.completion_ids[0, 0]) - 10]
    z = sum(math.exp(beta * r) for r in rewards)
    for c, r in zip(counts, rewards):
        p = math.exp(beta * r) / z
        assert abs(c / n - p) < 4 * math.sqrt(p * (1 - p) / n), (counts, r)


def test_per_prompt_capacity_keeps_the_newest():
    buf = _buffer("tba", recent_prob=0.0, per_prompt_capacity=4, seed=3)
    for i in range(5):
        buf.add(make_group(0, [[2 * i + 1], [2 * i + 2]]), version=i)  # completions 1..10, oldest first
    seen = set()
    for g in buf.sample(400, version=5)[5:]:  # the first five may be fresh
        if g.group_id < 0:
            seen.update(rows(g))
    assert seen == {(7,), (8,), (9,), (10,)}
    assert buf.stats()["buffer/history"] == 4


def test_duplicates_are_not_stored_and_are_counted():
    buf = _buffer("tba", recent_prob=1.0, seed=4)
    first = make_group(0, [[1, 2], [1, 2], [3]], width=4)
    buf.add(first, version=0)
    # Same text with different padding width is still a duplicate; the same text for another prompt is not.
    buf.add(make_group(0, [[3], [4, 5], [1, 2]], width=2), version=0)
    buf.add(make_group(1, [[1, 2], [3], [6]]), version=0)
    assert buf.stats()["buffer/duplicates_dropped"] == 3.0
    # fresh groups come out whole (newest first), duplicates included
    assert buf.sample(3, version=0)[2] is first
    buf.sample(50, version=0)
    assert buf.stats()["buffer/history"] == 6 and buf.stats()["buffer/prompts"] == 2


def test_a_duplicate_keeps_the_newest_copy_as_tba_does():
    """The same text sampled again later replaces its older copy in the history (the newest policy's
    logprobs, version and reward; TBA's buffer keeps the newest), and counts as the newest for the
    capacity."""
    buf = _buffer("tba", recent_prob=0.0, per_prompt_capacity=3, seed=2)
    buf.add(make_group(0, [[1, 2], [3], [4]], rewards=[0.0, 0.0, 0.0], versions=[1, 1, 1]), version=1)
    buf.add(make_group(0, [[1, 2], [5], [6]], rewards=[1.0, 0.0, 0.0], versions=[4, 4, 4]), version=4)
    history = buf._history[0]
    # capacity 3: the oldest texts, (3,) and (4,), went; (1, 2) was sampled again, so it is among the newest
    assert list(history) == [(1, 2), (5,), (6,)]
    kept = history[(1, 2)]
    assert kept.added_at == 4 and kept.reward == 1.0 and kept.versions.tolist() == [4, 4]
    assert kept.logprobs.tolist() == pytest.approx([-0.1, -0.1])  # the second group's first completion
    assert buf.stats()["buffer/duplicates_dropped"] == 1.0


def test_replayed_groups_are_well_formed():
    gen = torch.Generator().manual_seed(0)
    buf = _buffer("tba", recent_prob=0.0, per_prompt_capacity=16, seed=5)
    truth = {}  # (prompt, tokens) -> (reward, logprob per token, version)
    for j in range(12):
        prompt, comps, rewards, versions = j % 3, [], [], []
        for i in range(3):
            length = int(torch.randint(1, 7, (), generator=gen))
            comps.append([1000 * j + 10 * i + t for t in range(length)])
            rewards.append(float(torch.randn((), generator=gen)))
            versions.append(j)
        group = make_group(prompt, comps, rewards, versions, width=8)
        buf.add(group, version=j)
        for i, c in enumerate(comps):
            truth[(prompt, tuple(c))] = (float(group.rewards[i]), -(i + 1) / 10, j)
    replayed = buf.sample(200, version=20)
    for g in replayed:
        k, width = g.completion_ids.shape
        assert k == 3 and width == int(g.completion_lens.max())
        assert g.logprobs.shape == g.versions.shape == (k, width)
        assert g.completion_lens.shape == g.rewards.shape == g.truncated.shape == (k,)
        assert g.completion_ids.dtype == g.versions.dtype == torch.int64 and g.logprobs.dtype == torch.float32
        assert torch.equal(g.prompt_ids, torch.tensor([100 + g.prompt_index, 7]))
        assert len(set(rows(g))) == k  # drawn without replacement
        pad = torch.arange(width) >= g.completion_lens[:, None]
        assert not g.completion_ids[pad].any() and not g.logprobs[pad].any() and not g.versions[pad].any()
        for i, tokens in enumerate(rows(g)):
            reward, logprob, version = truth[(g.prompt_index, tokens)]
            n = len(tokens)
            assert float(g.rewards[i]) == reward
            assert torch.allclose(g.logprobs[i, :n], torch.full((n,), logprob))
            assert torch.equal(g.versions[i, :n], torch.full((n,), version))
            assert not g.truncated[i]  # none filled the width-8 original
    assert len({g.group_id for g in replayed}) == len(replayed) and max(g.group_id for g in replayed) < 0


def test_age_stats():
    buf = _buffer("fifo")
    # padding versions (0) don't count
    buf.add(make_group(0, [[1, 2], [3]], versions=[3, 5], width=4), version=5)
    buf.add(make_group(1, [[4], [5]], versions=[6, 5]), version=6)
    buf.sample(2, version=7)
    stats = buf.stats()
    assert (stats["buffer/age_mean"], stats["buffer/age_max"]) == (3.0, 4.0)  # ages 7-3=4 and 7-5=2
    replay = _buffer("tba", recent_prob=0.0, per_prompt_capacity=2)
    replay.add(make_group(0, [[1], [2]], versions=[4, 6]), version=6)
    replay.sample(1, version=9)
    assert (replay.stats()["buffer/age_mean"], replay.stats()["buffer/age_max"]) == (5.0, 5.0)
    assert replay.stats()["buffer/recent_frac"] == 0.0


def test_same_seed_same_draws():
    def draws(seed):
        buf = _buffer("tba", recent_prob=0.5, seed=seed)
        for i in range(20):
            buf.add(make_group(i % 4, [[i], [i + 100]], rewards=[i / 10, -i / 10], group_id=i), version=0)
        return [(g.group_id, rows(g)) if g.group_id >= 0 else rows(g) for g in buf.sample(40, version=0)]
    assert draws(7) == draws(7)
    assert draws(7) != draws(8)


@pytest.mark.parametrize("kwargs, option", [
    ({"sampler": "lifo"}, "sampler"),
    ({"recent_prob": 1.5}, "recent_prob"),
    ({"recent_prob": -0.1}, "recent_prob"),
    ({"inv_temp": -1.0}, "inv_temp"),
    ({"inv_temp": float("nan")}, "inv_temp"),
    ({"per_prompt_capacity": 0}, "per_prompt_capacity"),
])
def test_bad_config_raises_naming_the_option(kwargs, option):
    with pytest.raises(ValueError, match=option):
        _buffer(**kwargs)


def test_bad_groups_raise():
    small = _buffer("tba", per_prompt_capacity=2)
    with pytest.raises(ValueError, match="per_prompt_capacity"):
        small.add(make_group(0, [[1], [2], [3]]), version=0)
    buf = _buffer("fifo")
    buf.add(make_group(0, [[1], [2]]), version=0)
    with pytest.raises(ValueError, match="2 completions"):
        buf.add(make_group(0, [[1], [2], [3]]), version=0)


def test_expire_fresh_drops_only_old_groups_and_keeps_their_history():
    buf = _buffer("tba", recent_prob=1.0, per_prompt_capacity=8, seed=0)
    old = make_group(0, [[1, 2], [3]], versions=[0, 0], group_id=1)
    new = make_group(1, [[4], [5, 6]], versions=[3, 3], group_id=2)
    buf.add(old, 3)
    buf.add(new, 3)
    assert buf.expire_fresh(version=3, max_staleness=2) == 1
    assert len(buf) == 1
    assert buf.sample(1, 3)[0].group_id == 2
    assert buf.ready(1)  # the expired group's completions can still be replayed


def test_state_dict_round_trip_continues_identically(tmp_path):
    # a buffer saved, loaded (weights_only, as a checkpoint is) and continued samples what the original does
    import torch

    def fill(buf):
        for i in range(6):
            buf.add(make_group(i % 3, [[i, j] for j in range(4)], rewards=[float(j % 2) for j in range(4)],
                               group_id=i), i)

    a = _buffer("tba", recent_prob=0.3, seed=5)
    fill(a)
    a.sample(2, 6)
    torch.save(a.state_dict(), tmp_path / "s.pt")
    b = _buffer("tba", recent_prob=0.3, seed=99)
    b.load_state_dict(torch.load(tmp_path / "s.pt", weights_only=True))
    for step in range(5):
        ga, gb = a.sample(3, 7 + step), b.sample(3, 7 + step)
        assert [g.prompt_index for g in ga] == [g.prompt_index for g in gb]
        assert all(torch.equal(x.completion_ids, y.completion_ids) for x, y in zip(ga, gb))
    assert a.stats() == b.stats()


@pytest.mark.parametrize("recent_prob", [0.5, 0.95])
def test_tba_recent_draws_are_the_newest_groups_at_max_staleness_4(recent_prob):
    """The regression: B = 4 fresh groups a step arrive faster than recent_prob * B leave. Oldest first, the
    backlog grew until expiry and every recent draw sat at lag 4 (from step 8 at 0.5, from step 55 at 0.95);
    newest first, each recent draw is a group generated by the current policy, and the backlog expires
    (counted)."""
    b, eta, buf = 4, 4, _buffer("tba", seed=1, recent_prob=recent_prob)
    recent_lags, served = [], set()
    for version in range(80):
        for j in range(b):
            gid = version * b + j
            buf.add(make_group(gid % 7, [[gid, 1], [gid, 2]], versions=[version, version], group_id=gid),
                    version)
        for g in buf.sample(b, version):
            if g.group_id >= 0:  # a fresh group (replayed ones are assembled, with negative ids)
                recent_lags.append(version - g.group_id // b)
                assert g.group_id not in served
                served.add(g.group_id)
        buf.expire_fresh(version, eta)
    assert len(recent_lags) > 80 and set(recent_lags) == {0}
    assert buf.stats()["buffer/expired"] > 0  # the unserved backlog grew too old, and is counted


def test_a_replayed_completion_keeps_its_turns_rewards_and_an_older_history_its_reward_on_its_last_turn():
    buf = _buffer("tba", recent_prob=0.0, seed=6)
    group = make_group(0, [[1, 2], [3], [4, 5, 6]], rewards=[1.5, 0.0, 0.25])
    group.turns = torch.tensor([2, 1, 3])
    group.turn_rewards = torch.tensor([[0.5, 1.0, 0.0], [0.0, 0.0, 0.0], [0.0, 0.0, 0.25]])
    buf.add(group, version=0)
    state = buf.state_dict()
    for stored in state["history"][0]:
        del stored["turn_rewards"]  # a checkpoint from before turn rewards were kept
    old = _buffer("tba", recent_prob=0.0, seed=6)
    old.load_state_dict(state)
    source = rows(group)
    for g in buf.sample(5, version=0):  # the three completions, in some order, each with its turns' rewards
        assert g.turn_rewards.shape == (3, 3)
        for i, c in enumerate(rows(g)):
            assert torch.equal(g.turn_rewards[i], group.turn_rewards[source.index(c)])
    for g in old.sample(5, version=0):
        for i, c in enumerate(rows(g)):
            j = source.index(c)
            assert g.turn_rewards[i].tolist() == [float(group.rewards[j]) if k == group.turns[j] - 1 else 0.0
                                                  for k in range(3)]


def test_the_tba_sampler_is_refused_for_rules_written_for_data_within_the_bound():
    """buffer.sampler=tba replays groups past max_staleness, chosen by reward: a policy-gradient rule would
    train on them unawares (before, it was accepted); tb and online_dpo, whose objectives hold for any
    sampling policy, take it."""
    from launch.config import compose, parse

    for name in ("grpo", "ppo", "rloo", "dapo", "gspo", "cispo"):
        with pytest.raises(ValueError, match=f"buffer.sampler=tba replays groups older than max_staleness, "
                                             f"which algo={name} is not written for"):
            parse(compose([f"algo={name}", "buffer.sampler=tba"]))
    for name in ("tb", "online_dpo"):
        assert parse(compose([f"algo={name}", "buffer.sampler=tba"])).buffer.sampler == "tba"
    assert parse(compose(["algo=grpo", "buffer.sampler=fifo"])).buffer.sampler == "fifo"
