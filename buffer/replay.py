"""What the learner samples from: FIFO (AReaL) or TBA's mix of fresh groups and reward-weighted replay.

fifo: every added group is returned exactly once, oldest first.
tba (Trajectory Balance with Asynchrony): each returned group is, with probability `recent_prob`, the newest
unused fresh group (TBA's on-policy share; fresh groups arrive faster than `recent_prob` x B a step leave, so
oldest first would serve the backlog at the staleness limit), otherwise a replayed group: a prompt drawn
uniformly among those whose history holds at least K distinct completions, then K of those drawn without
replacement with probability proportional to exp(inv_temp * reward). Either kind falls back to the other when
it has nothing to give.

One process, no shared memory: rank 0 drains the ring into `add`, then calls `sample` for each batch.
"""
import math
import random
from collections import deque
from dataclasses import dataclass

import torch

from buffer.ring import Group
from buffer.staleness import lag, too_old

SAMPLERS = ("fifo", "tba")


@dataclass
class Completion:
    """One stored completion of a prompt, without padding."""

    token_ids: torch.Tensor  # int64 [L]
    logprobs: torch.Tensor  # float32 [L], behaviour logprobs
    versions: torch.Tensor  # int64 [L], policy version that sampled each token
    reward: float
    truncated: bool
    added_at: int  # learner version when its group was added
    loss_mask: torch.Tensor | None = None  # bool [L], tokens the policy sampled (None: all)
    turn_ids: torch.Tensor | None = None  # int64 [L]
    turns: int = 1
    finish: int = 0
    turn_rewards: torch.Tensor | None = None  # float32 [turns], step rewards (None: older checkpoints)


class ReplayBuffer:
    def __init__(self, sampler: str, recent_prob: float, inv_temp: float, per_prompt_capacity: int,
                 seed: int):
        if sampler not in SAMPLERS:
            raise ValueError(f"sampler={sampler!r} is unknown; use one of: {', '.join(SAMPLERS)}")
        if not 0.0 <= recent_prob <= 1.0:
            raise ValueError(f"recent_prob={recent_prob} must lie in [0, 1]")
        if not (math.isfinite(inv_temp) and inv_temp >= 0):
            raise ValueError(f"inv_temp={inv_temp} must be finite and >= 0 (0 replays uniformly)")
        if per_prompt_capacity < 1:
            raise ValueError(f"per_prompt_capacity={per_prompt_capacity} must be >= 1")
        self.sampler, self.recent_prob, self.inv_temp = sampler, recent_prob, inv_temp
        self.per_prompt_capacity = per_prompt_capacity
        self._rng = random.Random(seed)
        self._gen = torch.Generator().manual_seed(seed)
        self._group_size: int | None = None  # K, fixed by the first group
        self._fresh: deque[Group] = deque()
        self._prompt_ids: dict[int, torch.Tensor] = {}
        # Per prompt, completions keyed by their token ids; dicts keep insertion order, so the first is the
        # oldest.
        self._history: dict[int, dict[tuple[int, ...], Completion]] = {}
        # prompts holding >= K completions; never shrinks since capacity >= K
        self._replayable: list[int] = []
        self._next_id = -1
        self._duplicates = 0
        # fresh groups that grew too old before they were sampled (tba keeps them as history)
        self._expired = 0
        self._last: dict[str, float] = dict.fromkeys(
            ("buffer/size", "buffer/age_mean", "buffer/age_max", "buffer/recent_frac", "buffer/prompts",
             "buffer/history"), 0.0)

    @classmethod
    def from_config(cls, buffer, sampler: str, seed: int) -> "ReplayBuffer":
        """From the config's buffer section; `sampler`: fifo or tba, `buffer.sampler=auto` already
        resolved."""
        return cls(sampler, buffer.recent_prob, buffer.inv_temp, buffer.per_prompt_capacity, seed)

    def __len__(self) -> int:
        """Fresh groups not yet returned (both samplers); the replay history is counted in stats()."""
        return len(self._fresh)

    def add(self, group: Group, version: int) -> None:
        k = group.completion_ids.shape[0]
        if self._group_size is None:
            if self.sampler == "tba" and self.per_prompt_capacity < k:
                raise ValueError(f"per_prompt_capacity={self.per_prompt_capacity} is below the group size "
                                 f"{k}; replay could never fill a group, raise it")
            self._group_size = k
        elif k != self._group_size:
            raise ValueError(f"every group must hold {self._group_size} completions, got one with {k}")
        self._fresh.append(group)
        if self.sampler == "tba":
            self._remember(group, version)

    def expire_fresh(self, version: int, max_staleness: int) -> int:
        """Forget, as fresh, groups too old to train on at `version` (tba keeps them in its history). Returns
        how many were expired."""
        before = len(self._fresh)
        self._fresh = deque(g for g in self._fresh if not too_old(g, version, max_staleness))
        self._expired += before - len(self._fresh)
        return before - len(self._fresh)

    def _remember(self, group: Group, version: int) -> None:
        history = self._history.setdefault(group.prompt_index, {})
        self._prompt_ids.setdefault(group.prompt_index, group.prompt_ids)
        before = len(history)
        for i, n in enumerate(group.completion_lens.tolist()):
            key = tuple(group.completion_ids[i, :n].tolist())
            if key in history:
                # The same text twice would double its replay weight and teach nothing new: the newest copy is
                # kept (its logprobs and version are the latest policy's, as TBA keeps it), moved to the
                # newest end, so that the capacity drops the oldest text first
                self._duplicates += 1
                del history[key]
            history[key] = Completion(
                token_ids=group.completion_ids[i, :n].clone(), logprobs=group.logprobs[i, :n].clone(),
                versions=group.versions[i, :n].clone(), reward=float(group.rewards[i]),
                truncated=bool(group.truncated[i]), added_at=version,
                loss_mask=group.loss_mask[i, :n].clone(), turn_ids=group.turn_ids[i, :n].clone(),
                turns=int(group.turns[i]), finish=int(group.finish[i]),
                turn_rewards=group.turn_rewards[i, :max(int(group.turns[i]), 1)].clone())
            if len(history) > self.per_prompt_capacity:
                del history[next(iter(history))]
        if before < self._group_size <= len(history):
            self._replayable.append(group.prompt_index)

    def ready(self, n: int) -> bool:
        """True when sample(n) can be served now: n fresh groups, or (tba) any prompt to replay from.

        With replayable history tba is always ready; a learner that wants fresh data must wait on len()
        itself.
        """
        return len(self._fresh) >= n or (self.sampler == "tba" and bool(self._replayable))

    def sample(self, n: int, version: int) -> list[Group]:
        """n groups for one batch at policy `version` (used for the age stats only)."""
        if n < 1:
            raise ValueError(f"sample(n={n}) needs n >= 1")
        if not self.ready(n):
            raise RuntimeError(f"sample({n}) cannot be served: {len(self._fresh)} fresh groups; "
                               "check ready(n) first")
        groups, fresh = [], 0
        for _ in range(n):
            want_fresh = self.sampler == "fifo" or self._rng.random() < self.recent_prob
            if self._fresh and (want_fresh or not self._replayable):
                groups.append(self._fresh.popleft() if self.sampler == "fifo" else self._fresh.pop())
                fresh += 1
            else:
                groups.append(self._replay())
        ages = [lag(g, version) for g in groups]
        held = self._history.keys() if self.sampler == "tba" else {g.prompt_index for g in self._fresh}
        self._last = {
            "buffer/size": float(len(self._fresh)),
            "buffer/age_mean": sum(ages) / n,
            "buffer/age_max": float(max(ages)),
            "buffer/recent_frac": fresh / n,
            "buffer/prompts": float(len(held)),
            "buffer/history": float(sum(len(h) for h in self._history.values())),
        }
        return groups

    def _replay(self) -> Group:
        prompt = self._rng.choice(self._replayable)
        stored = list(self._history[prompt].values())
        k = self._group_size
        logits = self.inv_temp * torch.tensor([c.reward for c in stored], dtype=torch.float64)
        # Gumbel top-k has the law of k successive draws without replacement with p ~ exp(logit), and
        # unlike softmax + multinomial it cannot underflow to too few non-zero weights at high inv_temp.
        gumbel = -torch.log(-torch.log(torch.rand(len(stored), generator=self._gen, dtype=torch.float64)))
        picked = [stored[i] for i in (logits + gumbel).topk(k).indices.tolist()]
        lens = [len(c.token_ids) for c in picked]
        width = max(lens)

        def padded(name: str, dtype: torch.dtype, missing=0) -> torch.Tensor:
            out = torch.zeros(k, width, dtype=dtype)
            for row, (c, length) in enumerate(zip(picked, lens)):
                value = getattr(c, name)
                # None: a checkpoint from before masks
                out[row, :length] = missing if value is None else value
            return out

        turn_rewards = None  # a checkpoint from before them: each reward on its last turn (Group's default)
        if all(c.turn_rewards is not None for c in picked):
            turn_rewards = torch.zeros(k, max(len(c.turn_rewards) for c in picked))
            for row, c in enumerate(picked):
                turn_rewards[row, :len(c.turn_rewards)] = c.turn_rewards
        group = Group(
            prompt_ids=self._prompt_ids[prompt],
            completion_ids=padded("token_ids", torch.int64),
            completion_lens=torch.tensor(lens, dtype=torch.int64),
            logprobs=padded("logprobs", torch.float32),
            versions=padded("versions", torch.int64),
            rewards=torch.tensor([c.reward for c in picked], dtype=torch.float32),
            truncated=torch.tensor([c.truncated for c in picked], dtype=torch.bool),
            prompt_index=prompt, group_id=self._next_id, worker_id=-1,  # negative ids mark assembled groups
            loss_mask=padded("loss_mask", torch.bool, True), turn_ids=padded("turn_ids", torch.int64),
            turns=torch.tensor([c.turns for c in picked]), finish=torch.tensor([c.finish for c in picked]),
            turn_rewards=turn_rewards,
        )
        self._next_id -= 1
        return group

    def state_dict(self) -> dict:
        """Everything needed to continue exactly: tensors and plain values only (safe for weights_only
        loads)."""
        return {
            "rng": self._rng.getstate(), "gen": self._gen.get_state(), "group_size": self._group_size,
            "fresh": [vars(g).copy() for g in self._fresh], "prompt_ids": dict(self._prompt_ids),
            "history": {p: [vars(c).copy() for c in h.values()] for p, h in self._history.items()},
            "replayable": list(self._replayable), "next_id": self._next_id, "duplicates": self._duplicates,
            "expired": self._expired, "last": dict(self._last),
        }

    def load_state_dict(self, state: dict) -> None:
        self._rng.setstate(_as_tuples(state["rng"]))
        self._gen.set_state(state["gen"])
        self._group_size = state["group_size"]
        self._fresh = deque(Group(**g) for g in state["fresh"])
        self._prompt_ids = dict(state["prompt_ids"])
        self._history = {p: {tuple(c["token_ids"].tolist()): Completion(**c) for c in h}
                         for p, h in state["history"].items()}
        self._replayable = list(state["replayable"])
        self._next_id, self._duplicates, self._last = (state["next_id"], state["duplicates"],
                                                       dict(state["last"]))
        self._expired = state.get("expired", 0)  # a checkpoint from before the count

    def stats(self) -> dict[str, float]:
        """About the last sample() (zeros before the first); duplicates_dropped and expired count since
        construction."""
        return {**self._last, "buffer/duplicates_dropped": float(self._duplicates),
                "buffer/expired": float(self._expired)}


def _as_tuples(value):
    """random.setstate wants the nested tuples that getstate gave, whatever a round trip turned them into."""
    return tuple(_as_tuples(v) for v in value) if isinstance(value, (list, tuple)) else value
