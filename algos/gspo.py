"""GSPO (Zheng et al. 2025, Qwen, "Group Sequence Policy Optimization"): GRPO's clip on a sequence-level
ratio, taken against the proximal policy.

    A_i    = (r_i - mean(r_group)) / std(r_group)                          (scale_std: false drops the
                                                                           division)
    s_i    = exp((1/|y_i|) sum_t log(pi_theta(y_it) / pi_prox(y_it)))     pi_prox: the trainer's weights
                                                                           before this batch's first update
    s_it   = sg[s_i] * pi_theta(y_it) / sg[pi_theta(y_it)]                 (GSPO-token: the value s_i, the
                                                                           gradient of token t)
    l_i    = -(1/|y_i|) sum_t c_it * min(s_it * A_i, clip(s_it, 1 - eps, 1 + eps_high) * A_i)
    L      = sum_i l_i / batch_sequences

The ratio is taken against pi_prox, the trainer's own logprobs at the weights that start the batch (verl's
old_log_prob), never the engine's: on the first update s_i is 1 up to numerics, so GSPO's narrow clip (the
paper's 3e-4 / 4e-4: s_i is a length-normalised geometric mean) cuts sequences for what the policy moved, not
for the engine-trainer mismatch, which alone put a third of the sequences outside it (gspo/clip_frac 0.31 at
max_staleness=0 on the default task, 2026-12-05). c_it is 1 on the sampled tokens without algo.correction;
with one (algos.PGConfig), the correction weight of each token: tis and mis_token weight (or drop) tokens one
by one, so a token mis_token drops gets no gradient, while the clip still decides per sequence (s_it's value
is s_i); mis_seq's weight is one per sequence. Without a correction (c_it = 1) the gradient is GSPO's
sequence-level one, (1/|y_i|) sum_t s_i grad log pi_theta(y_it) where unclipped. A sequence's log-ratio mean
beyond +-algos.LOG_RATIO_LIMIT is clamped (algos.safe_ratio): no gradient past it.
Shapes: logprobs, behav_logprobs, prox_logprobs, mask [n, T]; rewards [n]; n = groups * K.
"""
from dataclasses import dataclass

import torch

from algos import (
    MicroBatch,
    PGConfig,
    PGLoss,
    clip_fractions,
    correction_weights,
    group_advantages,
    safe_ratio,
)
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
    def __init__(self, cfg: Config):
        super().__init__(cfg)
        self.needs_proximal = True  # the ratio's denominator, with or without a correction

    def __call__(self, mb: MicroBatch) -> tuple[torch.Tensor, dict]:
        cfg = self.cfg
        assert mb.prox_logprobs is not None, "gspo needs proximal logprobs"
        adv = group_advantages(mb.rewards, mb.group_size, scale=cfg.scale_std)[:, None]  # [n, 1]
        weight, correction = (mb.mask, {}) if cfg.correction == "none" else \
            correction_weights(cfg, mb.prox_logprobs, mb.behav_logprobs, mb.mask)  # c_it [n, T]
        lengths = mb.mask.sum(1, keepdim=True)  # [n, 1]
        has_tokens = (lengths > 0).to(mb.mask.dtype)  # [n, 1]: an empty sequence has no ratio and no term
        log_ratio = torch.where(mb.mask > 0, mb.logprobs - mb.prox_logprobs, torch.zeros_like(mb.logprobs))
        ratio = safe_ratio(log_ratio.sum(1, keepdim=True) / lengths.clamp(min=1), has_tokens)  # s_i [n, 1]
        # s_it: s_i's value, token t's gradient (0 where masked: no gradient reaches padding)
        own = torch.where(mb.mask > 0, mb.logprobs, torch.zeros_like(mb.logprobs))
        token_ratio = ratio.detach() * (own - own.detach()).exp()  # [n, T]
        clipped = token_ratio.clamp(1 - cfg.clip_eps, 1 + cfg.clip_eps_high)
        per_token = -torch.min(token_ratio * adv, clipped * adv) * weight  # [n, T]
        per_seq = per_token.sum(1) / lengths.clamp(min=1).squeeze(1)  # [n]
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
