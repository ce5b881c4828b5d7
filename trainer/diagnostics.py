"""How far the engine's sampling policy is from the trainer's: one batch's off-policy diagnostics.

For each completion token, with pi_behav the engine's logprob when it sampled it and pi_train the trainer's at
the weights it holds before the batch's first update (w = pi_train / pi_behav):
    abs_logprob_diff = mean |log pi_behav - log pi_train|
    kl               = mean (w - 1 - log w)         k3 estimate of KL(behav || train) on behav's samples, >= 0
Under `mismatch/` for the tokens sampled by the very version the trainer holds: both sides are the same
weights, so what is left is numerics (a bf16 engine against an autocast trainer) or a sampling mismatch
(temperature, top-p); under `offpolicy/` for the older tokens, where the weights differ as well. Over all
tokens:
    offpolicy/ess    = (sum w)^2 / (N sum w^2)      effective sample size of w, as a fraction of N tokens
    policy/entropy   = mean over tokens of -sum_v pi_train(v) log pi_train(v)
Sums gather over micro-batches and ranks before the division; a key whose tokens are absent this step is left
out.
"""
import torch
import torch.distributed as dist

# the sums, in this order: fresh count, |diff|, k3; old count, |diff|, k3; all count, w, w^2, entropy
_SIZE = 10


class OffPolicyStats:
    """Add one micro-batch at a time (`add`), then `metrics()` once per batch (a collective past one rank)."""

    def __init__(self, version: int):
        self.version = version
        self.sums = torch.zeros(_SIZE, dtype=torch.float64)

    def add(self, train_logprobs: torch.Tensor, behav_logprobs: torch.Tensor, mask: torch.Tensor,
            versions: torch.Tensor, entropy: torch.Tensor) -> None:
        """[n, T] each: the trainer's logprobs (no grad), the engine's, the completion mask, the sampling
        version of each token, the trainer's entropy."""
        with torch.no_grad():
            log_w = (train_logprobs.double() - behav_logprobs.double()) * mask
            w = log_w.exp() * mask
            k3, diff = (w - 1 - log_w) * mask, log_w.abs()
            fresh = mask * (versions == self.version)
            old = mask - fresh
            parts = [fresh.sum(), (diff * fresh).sum(), (k3 * fresh).sum(), old.sum(), (diff * old).sum(),
                     (k3 * old).sum(), mask.sum(), w.sum(), (w * w).sum(), (entropy.double() * mask).sum()]
            self.sums += torch.stack([p.double().cpu() for p in parts])

    def metrics(self, world_size: int = 1, device: torch.device = torch.device("cpu")) -> dict:
        sums = self.sums
        if world_size > 1:
            sums = sums.to(device)  # NCCL reduces GPU tensors only
            dist.all_reduce(sums)
            sums = sums.cpu()
        fresh, fresh_diff, fresh_k3, old, old_diff, old_k3, tokens, w, w2, entropy = sums.tolist()
        out = {}
        if fresh:
            out.update({"mismatch/abs_logprob_diff": fresh_diff / fresh, "mismatch/kl": fresh_k3 / fresh})
        if old:
            out.update({"offpolicy/abs_logprob_diff": old_diff / old, "offpolicy/kl": old_k3 / old})
        if tokens:
            out.update({"offpolicy/fresh_frac": fresh / tokens, "offpolicy/ess": w * w / (tokens * w2),
                        "policy/entropy": entropy / tokens})
        return out
