"""DAPO's dynamic sampling (Yu et al. 2025, `buffer.dynamic_sampling`): which fresh groups the learner drops
because their K rewards all tie (zero advantage, nothing to learn), and what dropping them cost. The trainer
hands each dropped group's budget back to the staleness gate, so a worker generates one more in its place.
"""
import torch


class DynamicSampling:
    """DAPO's dynamic sampling (buffer.dynamic_sampling): rank 0 drops fresh groups whose rewards all tie, at
    most `max_drops` a step (then it trains on them too rather than wait on a solved task), and counts what
    the dropped groups cost."""

    def __init__(self, on: bool, max_drops: int):
        self.on, self.max_drops = on, max_drops
        self.step_tokens = self.gave_up = self.total_drops = self.total_tokens = 0
        self.dropped: list = []  # this step's

    def new_step(self) -> None:
        self.dropped, self.step_tokens = [], 0

    def drops(self, group) -> bool:
        """Whether to drop `group` (all K rewards equal, and drops left this step)."""
        if not self.on or bool(group.rewards.max() > group.rewards.min()):
            return False
        if len(self.dropped) >= self.max_drops:
            self.gave_up += 1
            return False
        tokens = int((torch.arange(group.completion_ids.shape[1]) < group.completion_lens[:, None])
                     .logical_and(group.loss_mask).sum())  # sampled tokens: what generating it cost
        self.dropped.append(group)
        self.step_tokens, self.total_drops, self.total_tokens = (self.step_tokens + tokens,
                                                                 self.total_drops + 1,
                                                                 self.total_tokens + tokens)
        return True

    def metrics(self) -> dict:
        if not self.on:
            return {}
        return {"dynamic/dropped_groups": len(self.dropped), "dynamic/dropped_tokens": self.step_tokens,
                "dynamic/dropped_groups_total": self.total_drops,
                "dynamic/dropped_tokens_total": self.total_tokens, "dynamic/gave_up": self.gave_up}
