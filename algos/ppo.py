"""Decoupled PPO (AReaL, Fu et al. 2025); standard PPO when the proximal policy is the behaviour policy.

    A_i    = (r_i - mean(r_group)) / std(r_group)                (scale_std: false drops the division)
             (turn_credit=return_to_go: A_it of token t's turn, algos.turn_advantages, as in algos/grpo.py)
    w_it   = pi_prox(y_it) / pi_behav(y_it)                      behaviour importance weight, no grad
    rho_it = pi_theta(y_it) / pi_prox(y_it)
    l_it   = -w_it * min(rho_it * A_i, clip(rho_it, 1 - eps, 1 + eps_high) * A_i)
             (dual_clip c > 1, for A_i < 0: -w_it * max(min(...), c * A_i); Ye et al. 2020)
    L      = sum_{it: w_it <= cap} l_it / batch_tokens           tokens with w_it > cap are masked out

pi_prox: the weights before this batch's first update (mb.prox_logprobs; with train.minibatches = 1, in the
first of train.epochs, the current weights); decoupled: false sets pi_prox = pi_behav (w = 1).
algo.correction (algos.PGConfig) replaces w_it and the cap's masking with its own weight c_it. Ratios come
from log-ratios clamped to +-20 (algos.safe_ratio), so a masked token's garbage never turns into
inf * 0 = NaN.

No trust region at train.minibatches = 1 and train.epochs = 1: the ratio's pi_prox is then the forward's own
detached logprobs, so rho = 1 and the clip never acts (l = -w A, decoupled PPO's importance-weighted policy
gradient). The clip bites from the second minibatch on (train.minibatches > 1), as in AReaL's runs, or from
the second epoch (train.epochs > 1, PPO's own); the default keeps one of each, the fastest to reward here
(docs/benchmarks.md, "Time to reward"), and the behaviour weight's cap still bounds how far stale data can
pull.
Shapes: logprobs, behav_logprobs, prox_logprobs, mask, turn_ids [n, T]; rewards, turns [n];
turn_rewards [n, R]; n = G * K.
"""
from dataclasses import dataclass

import torch

from algos import (
    MicroBatch,
    PGConfig,
    TurnCredit,
    advantages,
    clip_fractions,
    clipped_objective,
    correction_weights,
    safe_ratio,
)
from registry import require


@dataclass
class Config(TurnCredit, PGConfig):
    name: str = "ppo"
    clip_eps: float = 0.2  # lower clip of the ratio pi/pi_prox
    clip_eps_high: float = 0.2  # upper clip (clip-higher when larger than clip_eps)
    behav_weight_cap: float = 5.0  # tokens with pi_prox/pi_behav above this are masked out (correction: none)
    decoupled: bool = True  # proximal policy separate from behaviour (false: standard PPO)
    scale_std: bool = True  # divide group-centred rewards by the group's std
    dual_clip: float = 0.0  # c > 1: a negative advantage's loss is capped at -c * A (0: off)

    def check(self):
        require(0 < self.clip_eps < 1, "algo.clip_eps", "must be in (0, 1)", self.clip_eps)
        require(self.clip_eps_high > 0, "algo.clip_eps_high", "must be > 0", self.clip_eps_high)
        require(self.behav_weight_cap > 1, "algo.behav_weight_cap", "must be > 1", self.behav_weight_cap)
        require(self.dual_clip == 0 or self.dual_clip > 1, "algo.dual_clip", "must be 0 (off) or > 1",
                self.dual_clip)
        self.check_correction()
        self.check_turn_credit()
        require(self.correction == "none" or self.decoupled, "algo.correction",
                "must be none for standard PPO (it weights pi_prox / pi_behav, which only decoupled PPO "
                "has): set algo.decoupled=true", self.correction)


class Loss:
    needs_reference = False

    def __init__(self, cfg: Config):
        self.cfg = cfg
        self.needs_proximal = cfg.decoupled
        self.tied_groups_learn_nothing = cfg.ties_learn_nothing()  # A = 0 on a tie, and every token's term

    def __call__(self, mb: MicroBatch) -> tuple[torch.Tensor, dict]:
        cfg = self.cfg
        if cfg.decoupled:
            assert mb.prox_logprobs is not None, "decoupled ppo needs proximal logprobs"
            prox = mb.prox_logprobs
        else:
            prox = mb.behav_logprobs
        adv, credit = advantages(cfg, mb, scale=cfg.scale_std)  # [n, 1], or [n, T] per turn
        correction = {}
        if cfg.correction == "none":
            weight = safe_ratio(prox - mb.behav_logprobs, mb.mask).detach()  # [n, T]
            kept = mb.mask * (weight <= cfg.behav_weight_cap)  # [n, T]
        else:
            weight, correction = correction_weights(cfg, prox, mb.behav_logprobs, mb.mask)
            kept = mb.mask * (weight > 0)
        ratio = safe_ratio(mb.logprobs - prox, kept)
        objective, dual = clipped_objective(ratio, adv, cfg.clip_eps, cfg.clip_eps_high, cfg.dual_clip)
        per_token = -weight * objective * kept
        loss = per_token.sum() / max(mb.batch_tokens, 1)  # 0 when every sample is masked
        with torch.no_grad():
            tokens = mb.mask.sum().clamp(min=1).item()
            kept_tokens = kept.sum().clamp(min=1).item()
            log_ratio = torch.where(kept > 0, mb.logprobs - prox, 0.0)
            sides = clip_fractions(ratio, 1 - cfg.clip_eps, 1 + cfg.clip_eps_high, kept, adv)
            metrics = {
                "loss/ppo": per_token.sum().item() / tokens,
                "ppo/clip_frac": sides["clip_frac_low"] + sides["clip_frac_high"],  # tokens the clip cut
                **{f"ppo/{k}": v for k, v in sides.items()},
                **({"ppo/dual_clip_frac": (dual * kept).sum().item() / kept_tokens} if cfg.dual_clip else {}),
                "ppo/behav_weight_masked_frac": (mb.mask - kept).sum().item() / tokens,
                "ppo/behav_weight_mean": (weight * kept).sum().item() / kept_tokens,
                "ppo/approx_kl": (((ratio - 1) - log_ratio) * kept).sum().item() / kept_tokens,
                **{f"ppo/{k}": v for k, v in credit.items()},
                **correction,
            }
        return loss, metrics
