"""Staleness, the one place it is defined: how old a group is, when it is too old, and the gate that bounds
how far generation may run ahead of training (AReaL, eta = max_staleness). The learner, the replay buffer and
the launcher's ring sizing ask this module rather than restating the rule.

With B groups per training batch and policy version v (batches trained on: the weights are published once a
batch, however many optimizer steps train.epochs x train.minibatches make of it), at most (eta + v + 1) * B
groups may ever have been started. eta = 0 is synchronous RL: the batch for step v+1 can only be sampled by
policy v. Started groups that will never reach the trainer are handed back with `cancel`, otherwise their
budget would be lost for good and the workers could stall.

A worker may die at any moment (the launcher restarts it), so the gate holds nothing a dead process could
keep: one lock around a check-and-increment of a few microseconds (`recover` frees it if its holder died
inside), and waiting is polling rather than a condition variable, whose bookkeeping of sleepers would make
the next `set_version` wait forever for a waiter that was killed.
"""
import time

import torch
import torch.multiprocessing as mp

STARTED, VERSION = 0, 1


def lag(group, version: int) -> int:
    """How many policy versions the group's oldest token is behind `version` (the learner's, about to
    train)."""
    return version - group.min_version()


def too_old(group, version: int, max_staleness: int) -> bool:
    """Too stale to train on at `version`: its oldest token is more than max_staleness versions old."""
    return lag(group, version) > max_staleness


def started_limit(version: int, max_staleness: int, batch_groups: int) -> int:
    """How many groups may ever have been started once the learner is at `version` (AReaL's bound)."""
    return (max_staleness + version + 1) * batch_groups


def lane_slots(max_staleness: int, batch_groups: int) -> int:
    """Ring slots one rollout worker's lane needs: every group the bound lets it start while the learner has
    not yet taken any, plus the one it may be writing."""
    return started_limit(0, max_staleness, batch_groups) + 1


def engine_slots(max_staleness: int, batch_groups: int, group_size: int, max_batch: int) -> int:
    """Sequences one rollout worker's engine may decode at once: rollout.max_batch, but never more than the
    bound lets be in flight, (max_staleness + 1) * B groups of K. A slot past that would never fill, and its
    KV cache (max_prompt_len + max_new_tokens a slot) would only take memory: 445 MB of GSM8K's 64 slots at
    eta = 0.
    A multi-turn episode's parked slot is one of its group's K."""
    return min(max_batch, started_limit(0, max_staleness, batch_groups) * group_size)


class StalenessGate:
    """AReaL's bound: a worker may start a new group only while
    groups_started + 1 <= started_limit(version)."""

    def __init__(self, batch_groups: int, max_staleness: int, ctx=None, version: int = 0):
        if batch_groups < 1 or max_staleness < 0:
            raise ValueError("need batch_groups >= 1 and max_staleness >= 0, got "
                             f"{batch_groups}, {max_staleness}")
        ctx = ctx or mp.get_context("spawn")
        self.batch_groups, self.max_staleness = batch_groups, max_staleness
        # A resumed run at version v has had exactly v * B groups delivered: that is its starting budget use.
        self._counts = torch.tensor([version * batch_groups, version], dtype=torch.int64).share_memory_()
        self._lock = ctx.Lock()

    @property
    def version(self) -> int:
        return int(self._counts[VERSION])

    @property
    def started(self) -> int:
        return int(self._counts[STARTED])

    def exhausted(self) -> bool:
        """No group may start until the next `set_version`."""
        return not self._has_budget()

    def _has_budget(self) -> bool:
        started, version = self._counts.tolist()
        return started + 1 <= started_limit(version, self.max_staleness, self.batch_groups)

    def try_start(self) -> bool:
        """Atomically check the bound and, if it allows, count one more started group."""
        with self._lock:
            if not self._has_budget():
                return False
            self._counts[STARTED] += 1
            return True

    def wait_start(self, timeout: float) -> bool:
        """Block until a group may start (True, counted) or `timeout` seconds pass (False)."""
        deadline, delay = time.monotonic() + timeout, 0.001
        while not self.try_start():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            time.sleep(min(delay, left))
            delay = min(2 * delay, 0.02)  # a new version is seen within 20 ms
        return True

    def cancel(self, n: int = 1) -> None:
        """n started groups will never be delivered (dropped as too stale, or lost): give their budget
        back."""
        with self._lock:
            if n > int(self._counts[STARTED]):
                raise ValueError(f"cannot cancel {n} groups: only {self.started} were started")
            self._counts[STARTED] -= n

    def count_started(self, n: int) -> None:
        """n groups were started outside this gate's say and will be delivered after all (cluster=ray: a
        generator node fenced for missing its deadline, whose lease was handed back, answered again with
        them): counted, so the budget stays exact. The count may pass the bound for a while; no group
        starts until it is back under."""
        with self._lock:
            self._counts[STARTED] += n

    def set_version(self, version: int) -> None:
        """Called by the trainer (the only writer of the version) once a batch's weights are published."""
        self._counts[VERSION] = version

    def recover(self) -> bool:
        """After a worker died: if it died holding the lock (a few microseconds' window), free the lock.
        Returns whether it had to."""
        if self._lock.acquire(timeout=1.0):
            self._lock.release()
            return False
        # held for a whole second by a section that takes microseconds: its holder is dead
        self._lock.release()
        return True


GRANTED = 1


class LeaseGate(StalenessGate):
    """A generator node's gate (cluster=ray, launch/ray_nodes.py): its rollout workers start groups out of
    starts leased from the trainer node's StalenessGate, so the bound stays exact across nodes. The node's
    agent adds what the trainer node granted (`grant`); a start uses one; `cancel` (a dead worker's unfinished
    groups) gives starts back to the lease, to be used again. The trainer node counts a lease as started
    groups: those never delivered go back to its gate when the node is lost."""

    def __init__(self, ctx=None):
        ctx = ctx or mp.get_context("spawn")
        self._counts = torch.zeros(2, dtype=torch.int64).share_memory_()  # [STARTED, GRANTED]
        self._lock = ctx.Lock()

    @property
    def version(self) -> int:
        raise AttributeError("a generator node's gate has no version: its lease is in starts, not versions")

    @property
    def granted(self) -> int:
        return int(self._counts[GRANTED])

    @property
    def unused(self) -> int:
        """Leased starts not used yet."""
        started, granted = self._counts.tolist()
        return granted - started

    def _has_budget(self) -> bool:
        started, granted = self._counts.tolist()
        return started < granted

    def grant(self, n: int) -> None:
        with self._lock:
            self._counts[GRANTED] += n

    def revoke(self) -> int:
        """Take back every leased start not used yet (a node being drained, or one that was fenced and whose
        lease the trainer node already handed back); how many."""
        with self._lock:
            started, granted = self._counts.tolist()
            self._counts[GRANTED] = started
            return granted - started

    def set_version(self, version: int) -> None:
        raise AttributeError("only the trainer node's gate follows the version")
