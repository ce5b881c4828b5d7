"""What a step's metrics row says beyond the learner's own figures: the rollout workers' counters, the fresh
groups' staleness and episodes, the groups kept and dropped, and a GPU's peak memory. Pure functions of what
the loop hands them (trainer/loop.py)."""
import torch

from buffer.ring import FINISH_REASONS
from buffer.staleness import lag
from runtime.shared import SANDBOX_KILLS, Shared

# logged as rollout/<name>
WORKER_COUNTERS = ("restarts", "lost_groups", "prompts_truncated", "prompts_skipped")


def worker_counts(shared: Shared) -> dict:
    """The rollout workers' counters, summed, under their metric names ("tokens" for the throughput)."""
    total = shared.counters.total
    return {"tokens": total("tokens"), "reward/timeouts": total("reward_timeouts"),
            "reward/errors": total("reward_errors"),
            **{f"reward/{name}": total(name) for name in SANDBOX_KILLS},
            **{f"rollout/{name}": total(name) for name in WORKER_COUNTERS},
            **(shared.nodes.metrics() if shared.nodes is not None else {})}


def staleness(trained: list, taken: list, version: int) -> dict:
    """Policy-version lag (of a group's oldest sampled token): staleness_* of the fresh groups trained on this
    step, the data max_staleness bounds (all of a fifo batch; tba's recent share, whose replayed groups are
    aged in buffer/age_*), and staleness/ring_* of the groups taken from the ring this step."""
    lags = [lag(g, version) for g in trained if g.group_id >= 0] or [0]  # replayed groups have negative ids
    ring = [lag(g, version) for g in taken] or [0]
    return {"staleness_mean": sum(lags) / len(lags), "staleness_max": max(lags),
            "staleness/ring_mean": sum(ring) / len(ring), "staleness/ring_max": max(ring)}


def kept_and_dropped(kept: list, dropped: list) -> dict:
    """Mean completion length and reward of the fresh groups kept and of those dropped for staleness
    (when any): dropping the slow ones can tilt training towards short, easy completions."""
    out = {}
    for name, groups in (("kept", kept), ("dropped", dropped)):
        if groups:
            out[f"staleness/{name}_len"] = (torch.cat([g.completion_lens for g in groups])
                                            .float().mean().item())
            out[f"staleness/{name}_reward"] = torch.cat([g.rewards for g in groups]).mean().item()
    return out


def episodes(fresh: list) -> dict:
    """What the fresh groups' records say of their episodes: turns, lengths, why they ended, whose tokens, the
    share kept out of the loss (env.mask: no token on the loss mask), and the spread of policy versions inside
    one episode (a weight update mid-episode is legal)."""
    turns = torch.cat([g.turns for g in fresh]).float()
    lens = torch.cat([g.completion_lens for g in fresh]).float()
    finish = torch.cat([g.finish for g in fresh])
    policy = env = masked = 0
    spreads = []
    for g in fresh:
        sampled = g.sampled()
        kept = sampled.any(1)  # a masked episode's tokens are neither the policy's nor the environment's here
        masked += int((~kept).sum())
        policy += int(sampled.sum())
        env += int((g.completion_lens - sampled.sum(1))[kept].sum())
        for row, mask in zip(g.versions, sampled):
            versions = row[mask]
            spreads.append(int(versions.max() - versions.min()) if len(versions) else 0)
    out = {"episode/turns_mean": turns.mean().item(), "episode/turns_max": turns.max().item(),
           "episode/len_p50": lens.quantile(0.5).item(), "episode/len_p90": lens.quantile(0.9).item(),
           "episode/len_max": lens.max().item(), "episode/policy_tokens": policy, "episode/env_tokens": env,
           "episode/version_spread_mean": sum(spreads) / len(spreads),
           "episode/version_spread_max": max(spreads), "episode/masked": masked / len(finish)}
    for code, reason in enumerate(FINISH_REASONS):
        out[f"episode/finish_{reason}"] = (finish == code).float().mean().item()
    return out


def peak_memory(device: torch.device) -> dict:
    """On a GPU: the most memory this rank's tensors have held so far, and what its allocator has reserved, in
    GB (`torch.cuda.max_memory_*`: what an out-of-memory error is measured against). Nothing on the CPU, where
    summary.json has the whole run's peak."""
    if device.type != "cuda":
        return {}
    return {"perf/peak_gpu_allocated_gb": torch.cuda.max_memory_allocated(device) / 2**30,
            "perf/peak_gpu_reserved_gb": torch.cuda.max_memory_reserved(device) / 2**30}
