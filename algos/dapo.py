"""DAPO (Yu et al. 2025): GRPO with clip-higher, a token-level loss, soft overlong punishment and dynamic
sampling.

    A_i   = (r_i + R_len(|y_i|) - mean_group) / std_group                    R_len: algos/grpo.py,
                                                                              overlong shaping
    l_it  = -min(rho_it A_i, clip(rho_it, 1 - eps_low, 1 + eps_high) A_i)     eps_low 0.2, eps_high 0.28
    L     = sum_{i,t} l_it / sum_i |y_i|                                      one mean over the batch's tokens
    dynamic sampling: groups whose K rewards all tie are dropped and replaced by new ones (conf/algo/dapo.yaml
    sets buffer.dynamic_sampling=true; the trainer drops them as it takes data from the ring)

The maths is algos/grpo.py's; this file only sets DAPO's defaults (the paper's eps_high = 0.28 and an overlong
buffer of 4k of 20k tokens, 0.2 of the budget), so `algo=dapo` runs the recipe and `algo.<knob>=` ablates it.
"""
from dataclasses import dataclass

from algos import grpo


@dataclass
class Config(grpo.Config):
    name: str = "dapo"
    clip_eps_high: float = 0.28  # clip-higher: room for low-probability tokens to grow
    token_mean: bool = True  # token-level loss: long completions weigh by their length
    overlong_buffer_frac: float = 0.2  # the last 20% of max_new_tokens is penalised linearly, down to -1


Loss = grpo.Loss
