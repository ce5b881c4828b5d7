"""REINFORCE Leave-One-Out (Ahmadian et al. 2024), as compared in Asynchronous RLHF (Noukhovitch et al. 2024).

    r_i   <- r_i - kl_coef * sum_t (log pi_behav(y_it) - log pi_ref(y_it))     (only when kl_coef > 0;
                                                                              no grad)
    A_i   = r_i - (1 / (K - 1)) sum_{j != i} r_j                               leave-one-out baseline
    L     = -sum_i A_i * sum_t c_it log pi_theta(y_it) / batch_sequences        over completion tokens

c_it = 1, or with algo.correction (algos.PGConfig) the correction weight of pi_prox / pi_behav.
Shapes: logprobs, behav_logprobs, ref_logprobs, prox_logprobs, mask [n, T]; rewards [n]; n = G * K.
"""
from dataclasses import dataclass

import torch

from algos import MicroBatch, PGConfig, correction_weights, sequence_logprobs
from registry import require


@dataclass
class Config(PGConfig):
    name: str = "rloo"
    kl_coef: float = 0.0  # KL penalty folded into the reward (> 0 needs a reference forward)

    def check(self):
        require(self.kl_coef >= 0, "algo.kl_coef", "must be >= 0", self.kl_coef)
        self.check_correction()


class Loss:
    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.needs_reference = cfg.kl_coef > 0
        self.needs_proximal = cfg.correction != "none"
        self.tied_groups_learn_nothing = cfg.kl_coef == 0  # the KL penalty can untie a group's rewards

    def __call__(self, mb: MicroBatch) -> tuple[torch.Tensor, dict]:
        k = mb.group_size
        rewards = mb.rewards.detach()
        metrics = {}
        if self.needs_reference:
            assert mb.ref_logprobs is not None, "rloo with kl_coef > 0 needs reference logprobs"
            kl = sequence_logprobs(mb.behav_logprobs - mb.ref_logprobs, mb.mask).detach()  # [n]
            rewards = rewards - self.cfg.kl_coef * kl
            metrics["rloo/kl"] = kl.mean().item()
        weight = mb.mask
        if self.needs_proximal:
            assert mb.prox_logprobs is not None, "rloo with a correction needs proximal logprobs"
            weight, correction = correction_weights(self.cfg, mb.prox_logprobs, mb.behav_logprobs, mb.mask)
            metrics.update(correction)
        r = rewards.view(-1, k)  # [G, K]
        adv = (r - (r.sum(dim=1, keepdim=True) - r) / (k - 1)).reshape(-1)  # [n]
        per_seq = -adv * sequence_logprobs(mb.logprobs, weight)
        loss = per_seq.sum() / mb.batch_sequences
        metrics["loss/rloo"] = per_seq.mean().item()
        metrics["rloo/adv_abs_mean"] = adv.abs().mean().item()
        return loss, metrics
