"""What a run leaves beside its metrics when it ends: summary.json and curves.png.

Time to reward is what runs are compared by (bench/time_to_reward.py): the `time_s` of the first step at which
the moving average of `reward_mean` over the last WINDOW steps reaches a threshold. summary.json holds it for
each of THRESHOLDS (null: never reached)."""
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


def completed(run_dir: str, steps: int) -> bool:
    """The run in `run_dir` finished all of its `steps` (a bench that stopped part way reruns the others)."""
    path = os.path.join(run_dir, "summary.json")
    if not os.path.exists(path):
        return False
    with open(path) as f:
        summary = json.load(f)
    return summary.get("status") == "completed" and summary.get("steps") == steps


def write_summary(run_dir, start, error, peak_mb, counts: dict | None = None):
    """summary.json: how the run ended, its reward, time to reward and memory, and `counts` (the launcher's own
    counters, read after every process stopped)."""
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
        # The run's memory: proportional resident set (shared memory counted once) summed over every process,
        # sampled every few seconds (launch/supervisor.py); and the largest resident set of any one process.
        "peak_memory_mb": round(peak_mb),
        "peak_rss_mb_max_process": max(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,
                                       resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) / 1024,
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
