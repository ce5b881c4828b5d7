"""A fixed-slot shared-memory ring of trajectory groups: many producers, one consumer, back-pressure when
full.

Each producer (rollout worker) owns a lane of slots that only it fills, so producers never contend and no lock
is shared: a producer killed at any instant holds nothing that could block the others. A slot goes FREE ->
WRITING -> READY in its producer and READY -> FREE in the consumer, each step one 8-byte store by the only
process allowed to make it (or by `reclaim` once that producer is dead). The producer copies the group into
the slot as one byte record, writes its sizes and publish time, then marks it READY; the consumer takes the
READY slot published first (FIFO across lanes), copies the fields out and frees the slot. Only
semaphores cross process boundaries; the data is never pickled. Each process touches the shared tensors
through numpy views: a numpy scalar store or small copy costs a tenth of a torch call, and a group's fixed
cost is a few dozen such calls.

Semaphores count slots (FREE per lane, READY overall) so that waiting never spins, but the states are the
truth: a waiter that wakes to find nothing waits again. After a producer dies, the launcher calls
`reclaim(worker_id)`: the slot it was writing goes back to FREE, the groups it published stay (each is
delivered once), and both semaphores are recounted from the states, which repairs a count the producer took
or never gave because it died between two steps.

Like engines/weights.py, this relies on stores becoming visible in program order (x86-64).
"""
import dataclasses
import functools
import math
import time
from dataclasses import dataclass

import numpy as np
import torch
import torch.multiprocessing as mp

FREE, WRITING, READY = 0, 1, 2
# Columns of the per-slot metadata row.
PROMPT_LEN, WIDTH, PROMPT_INDEX, GROUP_ID, WORKER_ID, PUBLISHED_NS, TURN_WIDTH = range(7)
MAX_TURNS = 64  # turns whose step rewards a slot holds (turn_rewards' columns): env.max_turns at most
# A slot holds one group as a single byte record, so a put and a get each copy it in one call. The int64
# fields come first, then float32, then bool: every field starts aligned for its dtype.
FIELDS = (("prompt_ids", torch.int64), ("completion_ids", torch.int64), ("completion_lens", torch.int64),
          ("versions", torch.int64), ("turn_ids", torch.int64), ("turns", torch.int64),
          ("finish", torch.int64), ("logprobs", torch.float32), ("rewards", torch.float32),
          ("turn_rewards", torch.float32), ("truncated", torch.bool), ("loss_mask", torch.bool))
# Why an episode ended (Group.finish holds the index): its environment said done; it reached env.max_turns;
# its last turn was cut by the episode's token budget (rollout.max_new_tokens); the next observation and a
# turn no longer fit that budget (context); the environment raised; an environment step or the episode ran out
# of time. A one-shot completion ends "done" on a stop token and "budget" at max_new_tokens.
FINISH_REASONS = ("done", "max_turns", "budget", "context", "env_error", "env_timeout")


# Group fields with one entry (or row) per completion
PER_COMPLETION = ("completion_ids", "completion_lens", "logprobs", "versions", "rewards", "truncated",
                  "loss_mask", "turn_ids", "turns", "finish", "turn_rewards")

NUMPY_DTYPES = {torch.int64: np.int64, torch.float32: np.float32, torch.bool: np.bool_}


def _shapes(P: int, K: int, N: int, R: int) -> list[tuple]:
    """The shapes of FIELDS for a prompt of P tokens and K completions of width N and of R turns."""
    return [(P,), (K, N), (K,), (K, N), (K, N), (K,), (K,), (K, N), (K,), (K, R), (K,), (K, N)]


def _sizes(shapes: list[tuple]) -> list[int]:
    return [math.prod(shape) * dtype.itemsize for shape, (_, dtype) in zip(shapes, FIELDS)]


@functools.lru_cache(maxsize=4096)
def _layout(P: int, K: int, N: int, R: int) -> tuple[list[tuple], list[int]]:
    """Shapes and byte sizes of FIELDS for one group, cached: a run sees few distinct (P, N, R)."""
    shapes = _shapes(P, K, N, R)
    return shapes, _sizes(shapes)


def _as_bytes(tensor: torch.Tensor, dtype: torch.dtype) -> np.ndarray:
    """The tensor's values in `dtype` as a flat numpy byte array (a view when no cast or copy is needed)."""
    if tensor.dtype != dtype or not tensor.is_contiguous():
        tensor = tensor.to(dtype).contiguous()
    return tensor.numpy().reshape(-1).view(np.uint8)


@dataclass
class Group:
    """One prompt and its K sampled completions; a completion is an episode, everything after the prompt: the
    policy's turns and, between them, the environment's (observations: tokens the policy did not sample)."""

    prompt_ids: torch.Tensor  # int64 [P], true prompt length, no padding
    completion_ids: torch.Tensor  # int64 [K, N], right-padded with 0
    completion_lens: torch.Tensor  # int64 [K]
    # float32 [K, N], behaviour logprobs; 0 in padding and where the policy sampled nothing
    logprobs: torch.Tensor
    # int64 [K, N], the policy version that sampled each token; -1 where none, 0 in padding
    versions: torch.Tensor
    rewards: torch.Tensor  # float32 [K]
    truncated: torch.Tensor  # bool [K], hit max_new_tokens without a stop token
    prompt_index: int
    group_id: int
    worker_id: int  # the producer's lane in the ring
    # bool [K, N], True on tokens the policy sampled (None: every valid token)
    loss_mask: torch.Tensor | None = None
    turn_ids: torch.Tensor | None = None  # int64 [K, N], the turn (0, 1, ...) each token belongs to (None: 0)
    turns: torch.Tensor | None = None  # int64 [K], policy turns in the episode (None: 1)
    finish: torch.Tensor | None = None  # int64 [K], index into FINISH_REASONS (None: from `truncated`)
    # float32 [K, R]: each policy turn's step reward, 0 past an episode's turns; R >= 1 (None: the reward on
    # the episode's last turn, as a one-shot completion's and an agent episode's are)
    turn_rewards: torch.Tensor | None = None

    def __post_init__(self):
        k, width = self.completion_ids.shape
        if self.loss_mask is None:
            self.loss_mask = torch.arange(width) < self.completion_lens[:, None]
        if self.turn_ids is None:
            self.turn_ids = torch.zeros(k, width, dtype=torch.int64)
        if self.turns is None:
            self.turns = torch.ones(k, dtype=torch.int64)
        if self.finish is None:
            self.finish = torch.where(self.truncated, FINISH_REASONS.index("budget"), 0).to(torch.int64)
        if self.turn_rewards is None:
            last = (self.turns - 1).clamp(min=0)[:, None]
            self.turn_rewards = torch.zeros(k, int(last.max()) + 1).scatter_(
                1, last, self.rewards[:, None].to(torch.float32))

    def select(self, index: list[int]) -> "Group":
        """The same group with only the completions at `index`, in that order (a rule that reads a few of
        them)."""
        rows = torch.tensor(index, dtype=torch.long)
        return dataclasses.replace(self, **{f: getattr(self, f)[rows] for f in PER_COMPLETION})

    def sampled(self) -> torch.Tensor:
        """bool [K, N]: the tokens the policy sampled (within each completion's length, on the loss mask)."""
        return (torch.arange(self.completion_ids.shape[1]) < self.completion_lens[:, None]) & self.loss_mask

    def min_version(self) -> int:
        """Oldest policy version among the tokens the policy sampled: the group's staleness is its oldest
        sampled token's. A group whose every episode is masked (env.mask: no token on the loss mask) trains
        nothing; its age is its recorded tokens' (version -1: none sampled), so it is not taken for stale.
        0 if there are none."""
        sampled = self.sampled()
        if not sampled.any():
            within = torch.arange(self.completion_ids.shape[1]) < self.completion_lens[:, None]
            sampled = within & (self.versions >= 0)
        return int(self.versions[sampled].min()) if sampled.any() else 0


def _shared(*shape, dtype):
    return torch.zeros(*shape, dtype=dtype).share_memory_()


class TrajectoryRing:
    def __init__(self, num_slots: int, group_size: int, max_prompt_len: int, max_new_tokens: int,
                 num_producers: int = 1, ctx=None):
        """Allocate every slot: `num_slots` split into one lane per producer (rounded up), so one producer can
        hold at most ceil(num_slots / num_producers) unread groups. Call in the launcher before spawning; pass
        the ring to children as a Process arg."""
        if min(num_slots, group_size, max_prompt_len, max_new_tokens, num_producers) < 1:
            raise ValueError("TrajectoryRing sizes and num_producers must all be >= 1")
        ctx = ctx or mp.get_context("spawn")
        self.num_producers, self.lane_slots = num_producers, math.ceil(num_slots / num_producers)
        self.num_slots, self.group_size = num_producers * self.lane_slots, group_size
        self.max_prompt_len, self.max_new_tokens = max_prompt_len, max_new_tokens
        S = self.num_slots
        record_bytes = sum(_sizes(_shapes(max_prompt_len, group_size, max_new_tokens, MAX_TURNS)))
        # every record 8-byte aligned
        self._records = _shared(S, math.ceil(record_bytes / 8) * 8, dtype=torch.uint8)
        self._meta = _shared(S, 7, dtype=torch.int64)
        self._state = _shared(S, dtype=torch.int64)
        # a full lane blocks its producer
        self._free = [ctx.Semaphore(self.lane_slots) for _ in range(num_producers)]
        self._ready = ctx.Semaphore(0)  # the consumer blocks here while nothing is READY
        self._views()

    def _views(self) -> None:
        self._records_np, self._meta_np, self._state_np = (t.numpy()
                                                           for t in (self._records, self._meta, self._state))

    def __getstate__(self) -> dict:
        # numpy arrays pickle by value: a child gets the shared tensors and makes its own views of them.
        return {k: v for k, v in self.__dict__.items() if not k.endswith("_np")}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._views()

    def __len__(self) -> int:
        return int((self._state == READY).sum())

    def put(self, group: Group, timeout: float | None = None) -> bool:
        """Write one group into its producer's lane (`group.worker_id`); blocks while the lane is full (never
        drops). False only if `timeout` ran out. One process per worker id."""
        self._check(group)
        lane = self._lane(group.worker_id)
        parts = [_as_bytes(getattr(group, name), dtype) for name, dtype in FIELDS]
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if not self._free[group.worker_id].acquire(timeout=_left(deadline)):
                return False
            free = np.flatnonzero(self._state_np[lane] == FREE)
            if len(free):
                break
        slot = lane.start + int(free[0])
        self._state_np[slot] = WRITING
        record, offset = self._records_np[slot], 0
        for part in parts:
            record[offset:offset + len(part)] = part
            offset += len(part)
        P, N, R = group.prompt_ids.shape[0], group.completion_ids.shape[1], group.turn_rewards.shape[1]
        # CLOCK_MONOTONIC is one clock for all processes, so publish times order groups across lanes.
        self._meta_np[slot] = (P, N, group.prompt_index, group.group_id, group.worker_id, time.monotonic_ns(),
                               R)
        self._state_np[slot] = READY
        self._ready.release()
        return True

    def get(self, timeout: float | None = None) -> Group | None:
        """Take the oldest published group (single consumer). Its tensors are copies; the slot is freed at
        once."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            if not self._ready.acquire(timeout=_left(deadline)):
                return None
            ready = np.flatnonzero(self._state_np == READY)
            if len(ready):
                break
        slot = int(ready[self._meta_np[ready, PUBLISHED_NS].argmin()])
        P, N, prompt_index, group_id, worker_id, _, R = self._meta_np[slot].tolist()
        # A copy per field: one shared buffer would let any field kept alone (the replay buffer keeps prompts)
        # hold, and checkpoint, the whole group.
        record, offset, fields = self._records_np[slot], 0, {}
        for (name, dtype), shape, size in zip(FIELDS, *_layout(P, self.group_size, N, R)):
            data = record[offset:offset + size].view(NUMPY_DTYPES[dtype]).reshape(shape)
            fields[name] = torch.from_numpy(data.copy())
            offset += size
        group = Group(**fields, prompt_index=prompt_index, group_id=group_id, worker_id=worker_id)
        self._state_np[slot] = FREE
        self._free[slot // self.lane_slots].release()
        return group

    def free_slots(self, worker_id: int) -> int:
        """Free slots in producer `worker_id`'s lane: how many groups it can put without blocking."""
        return int((self._state_np[self._lane(worker_id)] == FREE).sum())

    def reclaim(self, worker_id: int) -> int:
        """After producer `worker_id` died (call only once its process is gone, before a replacement starts):
        free the slots it was writing, keep the groups it published. Returns how many partial groups were
        dropped."""
        lane = self._state[self._lane(worker_id)]
        writing = lane == WRITING
        lane[writing] = FREE
        _recount(self._free[worker_id], lambda: int((lane == FREE).sum()))
        _recount(self._ready, lambda: len(self))
        return int(writing.sum())

    def _lane(self, worker_id: int) -> slice:
        if not 0 <= worker_id < self.num_producers:
            raise ValueError(f"worker_id={worker_id} has no lane: "
                             f"the ring was built for num_producers={self.num_producers}")
        return slice(worker_id * self.lane_slots, (worker_id + 1) * self.lane_slots)

    def _check(self, group: Group) -> None:
        K, N = self.group_size, group.completion_ids.shape[-1]
        if group.completion_ids.dim() != 2 or group.completion_ids.shape[0] != K:
            raise ValueError(f"completion_ids must be [K={K}, N], got {tuple(group.completion_ids.shape)}")
        if N > self.max_new_tokens:
            raise ValueError(f"completions of {N} tokens exceed the ring's "
                             f"max_new_tokens={self.max_new_tokens}")
        if group.prompt_ids.dim() != 1 or group.prompt_ids.shape[0] > self.max_prompt_len:
            raise ValueError(f"prompt of shape {tuple(group.prompt_ids.shape)} "
                             f"exceeds max_prompt_len={self.max_prompt_len}")
        for name in ("logprobs", "versions", "loss_mask", "turn_ids"):
            if getattr(group, name).shape != group.completion_ids.shape:
                raise ValueError(f"{name} must have the shape of completion_ids "
                                 f"{tuple(group.completion_ids.shape)}")
        for name in ("completion_lens", "rewards", "truncated", "turns", "finish"):
            if getattr(group, name).shape != (K,):
                raise ValueError(f"{name} must have shape [K={K}], got {tuple(getattr(group, name).shape)}")
        R = group.turn_rewards.shape[-1]
        if group.turn_rewards.dim() != 2 or group.turn_rewards.shape[0] != K or not 1 <= R <= MAX_TURNS:
            raise ValueError(f"turn_rewards must be [K={K}, R] with 1 <= R <= MAX_TURNS={MAX_TURNS} "
                             f"(buffer/ring.py), got {tuple(group.turn_rewards.shape)}")
        lens = group.completion_lens.tolist()  # K numbers: cheaper in Python than as tensor ops
        if min(lens) < 0 or max(lens) > N:
            raise ValueError(f"completion_lens must lie in [0, N={N}], got {lens}")


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


def _recount(semaphore, count) -> None:
    """Set a semaphore to count(): drain it first, so a count given meanwhile is seen in the states (at worst
    one extra, which its waiter absorbs by finding nothing and waiting again)."""
    while semaphore.acquire(block=False):
        pass
    for _ in range(count()):
        semaphore.release()
