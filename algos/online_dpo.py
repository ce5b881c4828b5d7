"""Online DPO as in Asynchronous RLHF (Noukhovitch et al. 2024): best vs worst of each prompt's K samples.

    y_w, y_l = argmax_i r_i, argmin_i r_i           per group (the first of equals), over the samples with
                                                    tokens on the mask (env.mask keeps some out); groups whose
                                                    rewards all tie are skipped
    h        = [log pi_theta(y_w) - log pi_theta(y_l)] - [log pi_ref(y_w) - log pi_ref(y_l)]
    l        = -log sigmoid(beta * h)               (DPO, Rafailov et al. 2023)
             = (h - 1 / (2 * beta))^2               (IPO, Azar et al. 2023)
    L        = sum over non-tied groups of l / batch_groups

log pi(y|x) = sum_t over completion tokens. Shapes: logprobs, ref_logprobs, mask [n, T]; rewards [n];
n = G * K. The loss reads y_w and y_l only, so by default (pack_pairs) the learner receives each group as just
those two (`pair`: K = 2, y_w first), and its forward, backward and reference pass skip the other K - 2
completions.
"""
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from algos import MicroBatch, sequence_logprobs
from registry import require

LOSS_TYPES = ("sigmoid", "ipo")


@dataclass
class Config:
    name: str = "online_dpo"
    beta: float = 0.1  # strength of the implicit KL to the reference (larger: stay closer)
    loss_type: str = "sigmoid"  # sigmoid (DPO) | ipo
    # train on each group's chosen and rejected completions only (the rest add nothing): the same loss and
    # gradient, about K / 2 times fewer completion tokens through the policy and the reference (false: all K,
    # as before)
    pack_pairs: bool = True

    def check(self):
        require(self.beta > 0, "algo.beta", "must be > 0", self.beta)
        require(self.loss_type in LOSS_TYPES, "algo.loss_type", f"must be one of {', '.join(LOSS_TYPES)}",
                self.loss_type)


class Loss:
    needs_reference = True
    needs_proximal = False
    any_policy = True  # its objective holds for data from any policy: buffer.sampler=tba may replay for it
    summed_metrics = ("dpo/skipped_groups",)  # counts: the trainer adds them up over micro-batches and ranks

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.trim_group = pair if cfg.pack_pairs else None  # what the learner is given of each group

    def __call__(self, mb: MicroBatch) -> tuple[torch.Tensor, dict]:
        assert mb.ref_logprobs is not None, "online_dpo needs reference logprobs"
        beta, k = self.cfg.beta, mb.group_size
        r = mb.rewards.view(-1, k)  # [G, K]
        policy = sequence_logprobs(mb.logprobs, mb.mask).view(-1, k)
        ref = sequence_logprobs(mb.ref_logprobs, mb.mask).view(-1, k)
        # a masked sample (no token on the mask) is neither chosen nor rejected
        present = (mb.mask.sum(1) > 0).view(-1, k)
        high, low = r.where(present, -torch.inf), r.where(present, torch.inf)
        kept = high.max(dim=1).values > low.min(dim=1).values  # [G] groups with a preference
        best, worst = high.argmax(dim=1, keepdim=True), low.argmin(dim=1, keepdim=True)  # [G, 1]
        chosen = (policy.gather(1, best) - ref.gather(1, best)).squeeze(1)[kept]  # [G']
        rejected = (policy.gather(1, worst) - ref.gather(1, worst)).squeeze(1)[kept]
        h = chosen - rejected
        if self.cfg.loss_type == "sigmoid":
            per_group = -F.logsigmoid(beta * h)
        else:
            per_group = (h - 1 / (2 * beta)) ** 2
        # + 0 * policy.sum(): a graph (and zero gradient) even when every group ties
        loss = per_group.sum() / (mb.batch_sequences // k) + 0 * policy.sum()
        with torch.no_grad():
            pairs = int(kept.sum())
            metrics = {
                "loss/dpo": per_group.mean().item() if pairs else 0.0,
                "dpo/reward_margin": (beta * h).mean().item() if pairs else 0.0,
                "dpo/chosen_reward": (beta * chosen).mean().item() if pairs else 0.0,
                "dpo/accuracy": (h > 0).float().mean().item() if pairs else 0.0,
                "dpo/skipped_groups": float(r.shape[0] - pairs),
            }
        return loss, metrics


def pair(group):
    """The group as its chosen and rejected completions, in that order (buffer.ring.Group; the same one twice
    when every reward ties, which the loss skips): argmax and argmin of the pair pick them again. Masked
    completions (no sampled token on the loss mask, env.mask) are neither."""
    present = group.sampled().any(1)
    high, low = group.rewards.where(present, -torch.inf), group.rewards.where(present, torch.inf)
    return group.select([int(high.argmax()), int(low.argmin())])
