"""Trajectory Balance with a VarGrad log Z (TBA, Bartoldson et al. 2025).

    target    pi*(y|x) ∝ pi_ref(y|x) exp(r(x,y) / beta)
    delta_i   = log pi_theta(y_i|x) - log pi_ref(y_i|x) - r_i / beta            [n]
    log Z(x)  = stop_grad(-(1/K) sum_i delta_i)    over the K samples of x       [G]
    L         = mean_i (log Z(x) + delta_i)^2                                    (sum / batch_sequences)
              x beta^2 / 2 with normalize (the default): see below
    beta      = beta_start -> beta_end, linearly over beta_steps optimizer steps

log pi(y|x) = sum_t log pi(y_t|x, y_<t) over completion tokens (divided by |y| with length_normalize). A
sample with no token on the mask (env.mask kept it out of the loss) has no log-ratio: the mean that gives
log Z is over the group's other samples, and it adds no term to L.
Shapes: logprobs, ref_logprobs, mask [n, T]; rewards [n]; n = G * K.

The scale of the gradient. Before learning, delta's spread within a group is the rewards' divided by beta, so
the raw gradient is 2/beta times the reward deviation times grad log pi(y|x), a sum over tokens: at beta 0.1
it is about 300 in norm on the default task, against 3-9 for grpo, and `train.grad_clip` (1) cut it every
step. `normalize` multiplies L by beta^2 / 2, which turns the gradient into beta * (reward deviation -
beta * (log-ratio deviation)) * grad log pi: a REINFORCE step's size, clipped only when it is one. TBA's own
code (bbartoldson/TBA, src/tba_trainer_gsm8k.py) clips nothing. Under AdamW a constant factor cancels, so this
changes only which steps the clip shortens; see docs/benchmarks.md, "Time to reward", for what it measured.
"""
from dataclasses import dataclass

import torch

from algos import MicroBatch, sequence_logprobs
from registry import require


@dataclass
class Config:
    name: str = "tb"
    # reward temperature at step 0 (smaller: sharper target, weaker pull to pi_ref). 0.02: faster to reward
    # than 0.1 on the default task (bench/time_to_reward.py); TBA's GSM8K runs anneal 0.014 -> 0.004
    beta_start: float = 0.02
    beta_end: float = 0.02  # reward temperature after beta_steps
    beta_steps: int = 0  # optimizer steps of the linear beta schedule (0: beta_end from the start)
    length_normalize: bool = False  # divide sequence log-ratios by completion length
    # scale the loss by beta^2 / 2: a REINFORCE-sized gradient that grad_clip leaves alone
    normalize: bool = True

    def check(self):
        require(self.beta_start > 0, "algo.beta_start", "must be > 0", self.beta_start)
        require(self.beta_end > 0, "algo.beta_end", "must be > 0", self.beta_end)
        require(self.beta_steps >= 0, "algo.beta_steps", "must be >= 0", self.beta_steps)


def beta_at(cfg: Config, step: int) -> float:
    if cfg.beta_steps == 0:
        return cfg.beta_end
    frac = min(step / cfg.beta_steps, 1.0)
    return cfg.beta_start + (cfg.beta_end - cfg.beta_start) * frac


class Loss:
    needs_reference = True
    needs_proximal = False
    sampler = "tba"  # TB is off-policy: it learns from replayed history as well as fresh data
    any_policy = True  # its objective holds for data from any policy: buffer.sampler=tba may replay for it

    def __init__(self, cfg: Config):
        self.cfg = cfg

    def __call__(self, mb: MicroBatch) -> tuple[torch.Tensor, dict]:
        assert mb.ref_logprobs is not None, "tb needs reference logprobs"
        beta = beta_at(self.cfg, mb.step)
        norm = self.cfg.length_normalize
        log_ratio = (sequence_logprobs(mb.logprobs, mb.mask, norm)
                     - sequence_logprobs(mb.ref_logprobs, mb.mask, norm))
        delta = (log_ratio - mb.rewards / beta).view(-1, mb.group_size)  # [G, K]
        present = (mb.mask.sum(1) > 0).view(-1, mb.group_size)  # [G, K] False: a masked sample (env.mask)
        if present.all():
            log_z = -delta.detach().mean(dim=1, keepdim=True)  # [G, 1] VarGrad: no learned log Z
            per_seq = (log_z + delta) ** 2  # [G, K]
        else:
            # a masked sample has no log-ratio: it takes no part in log Z and adds no residual
            kept = present.to(delta.dtype)
            log_z = -(delta.detach() * kept).sum(1, keepdim=True) / kept.sum(1, keepdim=True).clamp(min=1)
            per_seq = (log_z + delta) ** 2 * kept
        loss = per_seq.sum() / mb.batch_sequences
        if self.cfg.normalize:
            loss = loss * (beta * beta / 2)
        with torch.no_grad():
            metrics = {
                "loss/tb": per_seq.mean().item(),
                "tb/log_z": log_z.mean().item(),
                "tb/beta": beta,
                "tb/delta_std": delta.std().item() if delta.numel() > 1 else 0.0,
            }
        return loss, metrics
