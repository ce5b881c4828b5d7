"""CISPO (MiniMax-M1, 2025): clip the importance-sampling weight, not the update; every token keeps its
gradient.

    A_i    = (r_i - mean(r_group)) / std(r_group)                  (scale_std: false drops the division)
             (turn_credit=return_to_go: A_it of token t's turn, algos.turn_advantages, as in algos/grpo.py)
    r_it   = pi_theta(y_it | x, y_<t) / pi_old(y_it | x, y_<t)     pi_old = pi_behav
    w_it   = sg[clip(r_it, 1 - eps, 1 + eps_high)]                 sg: stop-gradient
                                                                   (the weight is a constant)
    l_it   = -w_it * A_i * log pi_theta(y_it | x, y_<t)
    L      = sum_it l_it / batch_tokens                            token-level mean over the whole batch

The paper sets no lower bound on the weight (eps large) and tunes only the upper one: the defaults eps = 1
(a lower bound of 0, which a ratio never goes below) and eps_high = 4, our choice: the paper gives no value,
and peers differ (Trinity-RFT's default is 0.28, DAPO's clip-higher). Unlike PPO/GRPO's min(), a token whose
ratio is clipped still trains, with its weight held at the bound.
With algo.correction (algos.PGConfig): pi_old = pi_prox and l_it is weighted by c_it, the correction weight.
Shapes: logprobs, behav_logprobs, prox_logprobs, mask, turn_ids [n, T]; rewards, turns [n];
turn_rewards [n, R]; n = groups * K.
"""
from dataclasses import dataclass

import torch

from algos import MicroBatch, PGConfig, PGLoss, TurnCredit, advantages, old_policy, safe_ratio
from registry import require


@dataclass
class Config(TurnCredit, PGConfig):
    name: str = "cispo"
    clip_eps: float = 1.0  # lower clip of the weight, 1 - eps (1: no lower bound, as in the paper)
    clip_eps_high: float = 4.0  # upper clip of the weight, 1 + eps_high (the one bound the paper tunes)
    scale_std: bool = True  # divide group-centred rewards by the group's std

    def check(self):
        require(0 < self.clip_eps <= 1, "algo.clip_eps", "must be in (0, 1]", self.clip_eps)
        require(self.clip_eps_high > 0, "algo.clip_eps_high", "must be > 0", self.clip_eps_high)
        self.check_correction()
        self.check_turn_credit()


class Loss(PGLoss):
    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.tied_groups_learn_nothing = cfg.ties_learn_nothing()  # discounting later turns can untie one

    def __call__(self, mb: MicroBatch) -> tuple[torch.Tensor, dict]:
        cfg = self.cfg
        adv, credit = advantages(cfg, mb, scale=cfg.scale_std)  # [n, 1], or [n, T] per turn
        old, weight, correction = old_policy(cfg, mb)
        low, high = 1 - cfg.clip_eps, 1 + cfg.clip_eps_high
        with torch.no_grad():
            ratio = safe_ratio(mb.logprobs.detach() - old, mb.mask)  # r_it [n, T], 1 on padding
            is_weight = ratio.clamp(low, high)  # w_it, a constant
        # padding: no term, no grad
        logprobs = torch.where(mb.mask > 0, mb.logprobs, torch.zeros_like(mb.logprobs))
        per_token = -is_weight * adv * logprobs * weight  # [n, T]
        loss = per_token.sum() / max(mb.batch_tokens, 1)  # 0 when every sample is masked
        with torch.no_grad():
            tokens = mb.mask.sum().clamp(min=1).item()
            metrics = {
                "loss/cispo": per_token.sum().item() / tokens,
                "cispo/weight_clipped_frac": (((ratio - high) > 1e-6).float() * mb.mask).sum().item()
                                             / tokens,
                "cispo/weight_clipped_low_frac": (((low - ratio) > 1e-6).float() * mb.mask).sum().item()
                                                 / tokens,
                "cispo/weight_mean": (is_weight * mb.mask).sum().item() / tokens,
                **{f"cispo/{k}": v for k, v in credit.items()},
                **correction,
            }
        return loss, metrics
