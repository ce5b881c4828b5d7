"""GSPO (Zheng et al. 2025, Qwen, "Group Sequence Policy Optimization"): GRPO's clip on a sequence-level
ratio.

    A_i    = (r_i - mean(r_group)) / std(r_group)                          (scale_std: false drops the
                                                                           division)
    s_i    = exp((1/|y_i|) sum_t log(pi_theta(y_it) / pi_old(y_it)))      pi_old = pi_behav
    l_i    = -min(s_i * A_i, clip(s_i, 1 - eps, 1 + eps_high) * A_i)
    L      = sum_i l_i / batch_sequences

The gradient flows through s_i (GSPO-token's gradient is the same, the advantage being per sequence): a
sequence the clip cuts trains nothing. The clip range is three orders of magnitude narrower than GRPO's (the
paper's 3e-4 / 4e-4): s_i is a length-normalised geometric mean, so it stays close to 1.
With algo.correction (algos.PGConfig): pi_old = pi_prox and l_i is weighted by the mean of c_it, the
correction weight, over the sequence's tokens, (1/|y_i|) sum_t c_it (the weight itself for mis_seq, which is
per sequence). A sequence's log-ratio mean beyond +-algos.LOG_RATIO_LIMIT is clamped (algos.safe_ratio): no
gradient past it.
Shapes: logprobs, behav_logprobs, prox_logprobs, mask [n, T]; rewards [n]; n = groups * K.
"""
from dataclasses import dataclass

import torch

from algos import MicroBatch, PGConfig, PGLoss, clip_fractions, group_advantages, old_policy, safe_ratio
from registry import require


@dataclass
class Config(PGConfig):
    name: str = "gspo"
    clip_eps: float = 3e-4  # lower clip of the sequence ratio s_i (the paper's value)
    clip_eps_high: float = 4e-4  # upper clip of s_i (the paper's value)
    scale_std: bool = True  # divide group-centred rewards by the group's std

    def check(self):
        require(0 < self.clip_eps < 1, "algo.clip_eps", "must be in (0, 1)", self.clip_eps)
        require(self.clip_eps_high > 0, "algo.clip_eps_high", "must be > 0", self.clip_eps_high)
        self.check_correction()


class Loss(PGLoss):
    def __call__(self, mb: MicroBatch) -> tuple[torch.Tensor, dict]:
        cfg = self.cfg
        adv = group_advantages(mb.rewards, mb.group_size, scale=cfg.scale_std)[:, None]  # [n, 1]
        old, weight, correction = old_policy(cfg, mb)
        lengths = mb.mask.sum(1, keepdim=True)  # [n, 1]
        has_tokens = (lengths > 0).to(mb.mask.dtype)  # [n, 1]: an empty sequence has no ratio and no term
        log_ratio = torch.where(mb.mask > 0, mb.logprobs - old, torch.zeros_like(mb.logprobs))  # [n, T]
        ratio = safe_ratio(log_ratio.sum(1, keepdim=True) / lengths.clamp(min=1), has_tokens)  # s_i [n, 1]
        seq_weight = weight.sum(1, keepdim=True) / lengths.clamp(min=1)  # mean c_it; 1 (0 if empty) with none
        clipped = ratio.clamp(1 - cfg.clip_eps, 1 + cfg.clip_eps_high)
        per_seq = (-torch.min(ratio * adv, clipped * adv) * seq_weight).squeeze(1)  # [n]
        loss = per_seq.sum() / mb.batch_sequences
        with torch.no_grad():
            sequences = has_tokens.sum().clamp(min=1).item()
            sides = clip_fractions(ratio, 1 - cfg.clip_eps, 1 + cfg.clip_eps_high, has_tokens, adv)
            metrics = {
                "loss/gspo": per_seq.mean().item(),
                "gspo/clip_frac": sides["clip_frac_low"] + sides["clip_frac_high"],
                **{f"gspo/{k}": v for k, v in sides.items()},
                "gspo/ratio_mean": (ratio * has_tokens).sum().item() / sequences,
                "gspo/adv_abs_mean": adv.abs().mean().item(),
                **correction,
            }
        return loss, metrics
