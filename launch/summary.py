"""What a run leaves beside its metrics when it ends: summary.json and curves.png.

Time to reward is what runs are compared by (bench/time_to_reward.py): the `time_s` of the first step at which
the moving average of `reward_mean` over the last WINDOW steps reaches a threshold. summary.json holds it for
each of THRESHOLDS (null: never reached), and the same read by the policy (`policy_time_to_reward` below)."""
import json
import os
import resource
import sys
import time

WINDOW, THRESHOLDS = 3, (0.8, 0.9)


def time_to_reward(rows: list[dict], threshold: float, window: int = WINDOW) -> tuple[float, int] | None:
    """(time_s, step) of the first row where the mean `reward_mean` of it and the window - 1 rows before it
    reaches `threshold`; None if no such row."""
    for i in range(window - 1, len(rows)):
        recent = [r["reward_mean"] for r in rows[i - window + 1:i + 1]]
        if sum(recent) / window >= threshold:
            return rows[i]["time_s"], rows[i]["step"]
    return None


def policy_time_to_reward(rows: list[dict], threshold: float,
                          window: int = WINDOW) -> tuple[float, float] | None:
    """(time_s, version): when the trainer published the policy whose own samples first averaged `threshold`.

    `time_to_reward` reads the reward of the groups a step trains on, which at max_staleness > 0 a policy up
    to that many versions older sampled: it credits the trainer late by the lag. Here the same window of rows
    is read as the versions that sampled it (the row's step - 1 - its fresh groups' mean lag,
    `staleness_mean`, of their oldest tokens), and the window's newest version is dated by the row that
    published it (version v at step v's `time_s`, linear between steps; version 0 at 0 s). Synchronous runs
    come out one step earlier than by `time_to_reward`; an asynchronous run's lag no longer counts against it.
    None if never reached."""
    published = {0: 0.0, **{r["step"]: r["time_s"] for r in rows}}
    for i in range(window - 1, len(rows)):
        recent = rows[i - window + 1:i + 1]
        if sum(r["reward_mean"] for r in recent) / window < threshold:
            continue
        version = max(max(r["step"] - 1 - r.get("staleness_mean", 0.0), 0.0) for r in recent)
        low = int(version)  # a resumed run's versions from before it started are dated 0 s, like version 0
        start, end = published.get(low, 0.0), published.get(min(low + 1, max(published)), 0.0)
        t = start + (version - low) * (end - start)
        return round(t, 3), round(version, 3)
    return None


def completed(run_dir: str, steps: int) -> bool:
    """The run in `run_dir` finished all of its `steps` (a bench that stopped part way reruns the others)."""
    path = os.path.join(run_dir, "summary.json")
    if not os.path.exists(path):
        return False
    with open(path) as f:
        summary = json.load(f)
    return summary.get("status") == "completed" and summary.get("steps") == steps


def write_summary(run_dir, start, error, peak_mb, counts: dict | None = None, peak_parts: dict | None = None,
                  peak_each: dict | None = None, peak_rss_mb: float = 0.0):
    """summary.json: how the run ended, its reward, time to reward and memory, and `counts` (the launcher's
    own counters, read after every process stopped); `peak_parts`: the peak's split by process; `peak_each`:
    each process's own peak; `peak_rss_mb`: the largest resident set any process reached, as sampled."""
    rows = []
    path = os.path.join(run_dir, "metrics.jsonl")
    if os.path.exists(path):
        with open(path) as f:
            rows = [json.loads(line) for line in f if line.strip()]
    rewards = [r["reward_mean"] for r in rows]
    quarter = max(len(rewards) // 4, 1)
    summary = {
        "status": "completed" if error is None else "failed",
        "error": error.splitlines()[0] if error else None,
        "steps": len(rows),
        "wall_s": round(time.time() - start, 2),
        "reward_first_quarter": sum(rewards[:quarter]) / quarter if rewards else None,
        "reward_last_quarter": sum(rewards[-quarter:]) / quarter if rewards else None,
        **{f"time_to_reward_{t}": (time_to_reward(rows, t) or (None,))[0] for t in THRESHOLDS},
        **{f"step_to_reward_{t}": (time_to_reward(rows, t) or (None, None))[1] for t in THRESHOLDS},
        **{f"policy_time_to_reward_{t}": (policy_time_to_reward(rows, t) or (None,))[0] for t in THRESHOLDS},
        # The run's memory: proportional resident set (shared memory counted once) summed over every process,
        # sampled every few seconds (launch/supervisor.py); and the largest resident set of any one process.
        "peak_memory_mb": round(peak_mb),
        # ... and its split at that moment: the launcher, each trainer rank and rollout worker
        # (with its children)
        "peak_memory_by_process_mb": {name: round(mb) for name, mb in sorted((peak_parts or {}).items())},
        # ... and each process's own peak, whenever it came (a rollout worker's need not fall at the total's)
        "peak_memory_each_process_mb": {name: round(mb) for name, mb in sorted((peak_each or {}).items())},
        "peak_rss_mb_max_process": max(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss / 1024,
                                       resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
                                       peak_rss_mb),
        **(counts or {}),
    }
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)


def draw_curves(run_dir):
    """curves.png beside metrics.jsonl; a plotting failure must not fail the run."""
    try:
        import plot

        plot.run_curves(run_dir)
    except Exception as e:
        print(f"warning: curves.png not drawn: {str(e).splitlines()[0]}", file=sys.stderr)
