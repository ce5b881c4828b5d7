"""GRPO (Shao et al. 2024, DeepSeekMath), with Dr. GRPO (Liu et al. 2025) and DAPO's parts (Yu et al. 2025) as
options; algos/dapo.py is GRPO with DAPO's defaults.

    r_i      <- r_i + R_len(|y_i|)                                   (overlong_buffer_frac > 0, below)
    A_i      = (r_i - mean(r_group)) / std(r_group)                 (Dr. GRPO: no division by std)
    rho_it   = pi_theta(y_it | x, y_<t) / pi_old(y_it | x, y_<t)    pi_old = pi_behav
    l_it     = -min(rho_it * A_i, clip(rho_it, 1 - eps, 1 + eps_high) * A_i)
               (dual_clip c > 1, for A_i < 0: -max(min(...), c * A_i))
    L        = mean_i (1/|y_i|) sum_t l_it                          (Dr. GRPO: sum_t l_it / max_new_tokens;
                                                                     token_mean: sum_it l_it / sum_i |y_i|)

DAPO's soft overlong punishment, with L_max = rollout.max_new_tokens and L_c = overlong_buffer_frac * L_max:
    R_len(l) = 0 for l <= L_max - L_c;  (L_max - L_c - l) / L_c * overlong_penalty up to L_max
l = |y_i| counts the tokens the policy sampled (the mask): a multi-turn episode's observations are not its
length, and a masked sample (env.mask) gets no penalty.
Per-turn credit (turn_credit=return_to_go, algos.TurnCredit): r_ik is the environment's step reward after turn
k of episode i (R_len joins its last turn's), and A_i becomes A_it, the advantage of token t's turn k(t)
(algos.turn_advantages), so a turn is credited only with its own reward and what followed it:
    G_ik     = sum_{k' >= k} gamma^(k' - k) r_ik'                   [n, R] of turn_rewards; gamma = turn_gamma
    A_it     = (G_i,k(t) - mean_j G_j0) / std_j G_j0                [n, T]; k(t) = turn_ids (Dr. GRPO: no std)
               (0 at every token of a group whose G_j0 tie)
The baseline is the group's mean return from turn 0, one constant for every turn, not a later turn's expected
return-to-go: no bias beyond GRPO's own, but a later turn's advantage is offset by about minus the reward
expected before it, noise that the std scaling amplifies where a group's returns nearly agree
(algos.turn_advantages; docs/design.md, "Per-turn credit").
DAPO's clip-higher is clip_eps_high > clip_eps, and its dynamic sampling (groups whose rewards all tie are
dropped and replaced by new ones) is buffer.dynamic_sampling, done where the trainer takes data from the ring.
With algo.correction (algos.PGConfig): pi_old = pi_prox and l_it is weighted by c_it, the correction weight.
Ratios come from log-ratios clamped to +-20 (algos.safe_ratio): masked tokens never make a NaN.
Shapes: logprobs, behav_logprobs, prox_logprobs, mask, turn_ids [n, T]; rewards, turns [n];
turn_rewards [n, R]; n = groups * K.
"""
from dataclasses import dataclass

import torch

from algos import (
    MicroBatch,
    PGConfig,
    PGLoss,
    TurnCredit,
    advantages,
    clip_fractions,
    clipped_objective,
    old_policy,
    safe_ratio,
)
from registry import require


@dataclass
class Config(TurnCredit, PGConfig):
    name: str = "grpo"
    clip_eps: float = 0.2  # lower clip of the ratio
    clip_eps_high: float = 0.2  # upper clip (clip-higher when larger than clip_eps)
    dr_grpo: bool = False  # Dr. GRPO: no std scaling, constant length normaliser
    token_mean: bool = False  # DAPO: one mean over every token of the batch instead of a mean per sequence
    dual_clip: float = 0.0  # c > 1: a negative advantage's loss is capped at -c * A (0: off)
    overlong_buffer_frac: float = 0.0  # DAPO: the last fraction of max_new_tokens that is penalised (0: off)
    overlong_penalty: float = 1.0  # DAPO: the penalty at max_new_tokens

    def check(self):
        require(0 < self.clip_eps < 1, "algo.clip_eps", "must be in (0, 1)", self.clip_eps)
        require(self.clip_eps_high > 0, "algo.clip_eps_high", "must be > 0", self.clip_eps_high)
        require(not (self.dr_grpo and self.token_mean), "algo.token_mean",
                "must be false with algo.dr_grpo=true (each sets the loss's normaliser)", self.token_mean)
        require(self.dual_clip == 0 or self.dual_clip > 1, "algo.dual_clip", "must be 0 (off) or > 1",
                self.dual_clip)
        require(0 <= self.overlong_buffer_frac < 1, "algo.overlong_buffer_frac", "must be in [0, 1)",
                self.overlong_buffer_frac)
        require(self.overlong_penalty >= 0, "algo.overlong_penalty", "must be >= 0", self.overlong_penalty)
        self.check_correction()
        self.check_turn_credit()


def overlong_shaping(lengths: torch.Tensor, max_new_tokens: int, buffer_frac: float,
                     penalty: float) -> torch.Tensor:
    """DAPO's soft overlong punishment [n] for completion lengths [n] (module docstring)."""
    cache = buffer_frac * max_new_tokens
    if cache <= 0:
        return torch.zeros_like(lengths, dtype=torch.float64)
    start = max_new_tokens - cache
    return -penalty * ((lengths.double() - start) / cache).clamp(min=0, max=1)


class Loss(PGLoss):
    def __init__(self, cfg: Config):
        super().__init__(cfg)
        # the length shaping, or a discount of later turns, can untie a group
        self.tied_groups_learn_nothing = cfg.overlong_buffer_frac == 0 and cfg.ties_learn_nothing()

    def __call__(self, mb: MicroBatch) -> tuple[torch.Tensor, dict]:
        cfg = self.cfg
        penalty, shaping = None, {}
        if cfg.overlong_buffer_frac > 0:
            penalty = overlong_shaping(mb.mask.sum(1), mb.max_new_tokens, cfg.overlong_buffer_frac,
                                       cfg.overlong_penalty).to(mb.rewards.dtype)
            shaping = {"overlong_penalty_mean": penalty.mean().item(),
                       "overlong_frac": (penalty < 0).float().mean().item()}
        adv, credit = advantages(cfg, mb, scale=not cfg.dr_grpo, bonus=penalty)  # [n, 1], or [n, T] per turn
        old, weight, correction = old_policy(cfg, mb)
        ratio = safe_ratio(mb.logprobs - old, mb.mask)  # [n, T]
        objective, dual = clipped_objective(ratio, adv, cfg.clip_eps, cfg.clip_eps_high, cfg.dual_clip)
        per_token = -objective * weight  # [n, T]
        if cfg.token_mean:
            # so that L = sum_it l_it / tokens
            per_seq = per_token.sum(1) * mb.batch_sequences / max(mb.batch_tokens, 1)
        elif cfg.dr_grpo:
            per_seq = per_token.sum(1) / mb.max_new_tokens
        else:
            per_seq = per_token.sum(1) / mb.mask.sum(1).clamp(min=1)
        loss = per_seq.sum() / mb.batch_sequences
        with torch.no_grad():
            tokens = mb.mask.sum().clamp(min=1)
            sides = clip_fractions(ratio, 1 - cfg.clip_eps, 1 + cfg.clip_eps_high, mb.mask, adv)
            metrics = {
                "loss": per_seq.mean().item(),
                "clip_frac": sides["clip_frac_low"] + sides["clip_frac_high"],  # tokens the clip cut
                **sides,
                "ratio_mean": (ratio * mb.mask).sum().item() / tokens.item(),
                **credit,
                **({"dual_clip_frac": (dual * mb.mask).sum().item() / tokens.item()} if cfg.dual_clip
                   else {}),
                **shaping,
            }
            # grpo/<key> (dapo/<key> under algos/dapo.py), loss/<rule>
            metrics = {"loss/" + cfg.name if k == "loss" else f"{cfg.name}/{k}": v
                       for k, v in metrics.items()}
        return loss, {**metrics, **correction}
