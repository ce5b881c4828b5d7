"""What a run leaves beside its metrics when it ends: summary.json and curves.png."""
import json
import os
import resource
import sys
import time


def write_summary(run_dir, start, error, peak_mb):
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
        # The run's memory: proportional resident set (shared memory counted once) summed over every process,
        # sampled each second; and the largest resident set of any one process.
        "peak_memory_mb": round(peak_mb),
        "peak_rss_mb_max_process": max(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss,
                                       resource.getrusage(resource.RUSAGE_SELF).ru_maxrss) / 1024,
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
