"""GRPO (Shao et al. 2024, DeepSeekMath), with Dr. GRPO (Liu et al. 2025) as an option.

    A_i      = (r_i - mean(r_group)) / std(r_group)                 (Dr. GRPO: no division by std)
    rho_it   = pi_theta(y_it | x, y_<t) / pi_old(y_it | x, y_<t)    pi_old = pi_behav
    l_it     = -min(rho_it * A_i, clip(rho_it, 1 - eps, 1 + eps_high) * A_i)
    L        = mean_i (1/|y_i|) sum_t l_it                          (Dr. GRPO: sum_t l_it / max_new_tokens)

With algo.correction (algos.PGConfig): pi_old = pi_prox and l_it is weighted by c_it, the correction weight.
Shapes: logprobs, behav_logprobs, prox_logprobs, mask [n, T]; rewards [n]; n = groups * K.
"""
from dataclasses import dataclass

import torch

from algos import MicroBatch, PGConfig, clip_fractions, correction_weights, group_advantages
from registry import require


@dataclass
class Config(PGConfig):
    name: str = "grpo"
    clip_eps: float = 0.2  # lower clip of the ratio
    clip_eps_high: float = 0.2  # upper clip (clip-higher when larger than clip_eps)
    dr_grpo: bool = False  # Dr. GRPO: no std scaling, constant length normaliser

    def check(self):
        require(0 < self.clip_eps < 1, "algo.clip_eps", "must be in (0, 1)", self.clip_eps)
        require(self.clip_eps_high > 0, "algo.clip_eps_high", "must be > 0", self.clip_eps_high)
        self.check_correction()


class Loss:
    needs_reference = False

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.needs_proximal = cfg.correction != "none"

    def __call__(self, mb: MicroBatch) -> tuple[torch.Tensor, dict]:
        cfg = self.cfg
        adv = group_advantages(mb.rewards, mb.group_size, scale=not cfg.dr_grpo)[:, None]  # [n, 1]
        weight, correction = mb.mask, {}
        old = mb.behav_logprobs
        if self.needs_proximal:
            assert mb.prox_logprobs is not None, "grpo with a correction needs proximal logprobs"
            old = mb.prox_logprobs
            weight, correction = correction_weights(cfg, old, mb.behav_logprobs, mb.mask)
        ratio = torch.exp(mb.logprobs - old)  # [n, T]
        clipped = ratio.clamp(1 - cfg.clip_eps, 1 + cfg.clip_eps_high)
        per_token = -torch.min(ratio * adv, clipped * adv) * weight  # [n, T]
        if cfg.dr_grpo:
            per_seq = per_token.sum(1) / mb.max_new_tokens
        else:
            per_seq = per_token.sum(1) / mb.mask.sum(1).clamp(min=1)
        loss = per_seq.sum() / mb.batch_sequences
        with torch.no_grad():
            tokens = mb.mask.sum().clamp(min=1)
            sides = clip_fractions(ratio, 1 - cfg.clip_eps, 1 + cfg.clip_eps_high, mb.mask)
            metrics = {
                "loss/grpo": per_seq.mean().item(),
                "grpo/clip_frac": (((ratio - clipped).abs() > 1e-6).float() * mb.mask).sum().item() / tokens.item(),
                **{f"grpo/{k}": v for k, v in sides.items()},
                "grpo/ratio_mean": (ratio * mb.mask).sum().item() / tokens.item(),
                "grpo/adv_abs_mean": adv.abs().mean().item(),
                **correction,
            }
        return loss, metrics
