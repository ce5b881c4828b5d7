"""Asynchrony: the default run at max_staleness = 0 (synchronous) against 1, 2 and 4, same seed and steps.

    python -m bench.async_speedup [--steps 12] [--etas 0,1,2,4] [--out bench_out/async]

The settings are one Hydra multirun of `train.py` (one rollout worker + one trainer rank, one thread each,
on the same 2 cores), each evaluated on the test split at the end. Prints wall-clock, reward and accuracy per
setting, where the synchronous run's time goes (the trainer waiting for data vs training), draws the runs side
by side with plot.py, and ends with `async_speedup=<loop time at eta=0 / loop time at eta=2>`.
"""
import argparse
import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def sweep(etas: list[int], steps: int, out: str, extra: list[str]) -> list[dict]:
    """One Hydra multirun over max_staleness; returns each run's figures, in the order of `etas`."""
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "-m", f"max_staleness={','.join(map(str, etas))}",
           f"steps={steps}", "seed=0", "eval.every=0", "progress=false", f"hydra.sweep.dir={out}",
           "hydra.sweep.subdir='max_staleness=${max_staleness}'", *extra]
    print(" ".join(cmd[1:]), flush=True)
    result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"error: the sweep failed:\n{result.stderr[-2000:]}")
    return [_figures(eta, os.path.join(out, f"max_staleness={eta}")) for eta in etas]


def _figures(eta: int, run_dir: str) -> dict:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    rewards = [r["reward_mean"] for r in rows]
    quarter = max(len(rewards) // 4, 1)
    loop = rows[-1]["time_s"]
    return {
        "eta": eta, "dir": run_dir, "wall_s": summary["wall_s"], "loop_s": loop,
        "s_per_step": loop / len(rows), "rewards": rewards,
        "reward_last_quarter": sum(rewards[-quarter:]) / quarter, "pass@1": rows[-1].get("eval_pass@1"),
        "sample_reward": rows[-1].get("eval_sample_reward"),
        "staleness": sum(r["staleness_mean"] for r in rows) / len(rows),
        "train_s": sum(r["perf/train_step_s"] for r in rows), "wait_s": sum(r["perf/wait_s"] for r in rows),
        "memory_mb": summary.get("peak_memory_mb"),
    }


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--etas", default="0,1,2,4")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench_out", "async"))
    parser.add_argument("extra", nargs="*", help="more train.py overrides, e.g. algo=grpo")
    args = parser.parse_args()
    etas = [int(e) for e in args.etas.split(",")]
    results = sweep(etas, args.steps, args.out, args.extra)

    print(f"\n{args.steps} steps of the default run (tb, 8 prompts x 8 samples), "
          "1 rollout worker + 1 trainer, 1 thread each, seed 0; "
          "loop = first step's start to last step's end, wall = the whole process\n")
    print("| max_staleness | loop s | s/step | speedup | wall s | reward, last quarter | test pass@1 | "
          "test sampled reward | mean staleness | trainer training | trainer waiting for data | "
          "peak memory MB |")
    print("| --- " * 12 + "|")
    base = next((r for r in results if r["eta"] == 0), results[0])
    for r in results:
        print(f"| {r['eta']} | {r['loop_s']:.0f} | {r['s_per_step']:.1f} | "
              f"{base['loop_s'] / r['loop_s']:.2f} | {r['wall_s']:.0f} | {r['reward_last_quarter']:.2f} | "
              f"{_fmt(r['pass@1'])} | {_fmt(r['sample_reward'])} | {r['staleness']:.2f} | "
              f"{r['train_s'] / r['loop_s']:.0%} | {r['wait_s'] / r['loop_s']:.0%} | {r['memory_mb']} |")
    print("\nreward_mean per step:")
    for r in results:
        print(f"  max_staleness={r['eta']}: " + " ".join(f"{x:.2f}" for x in r["rewards"]))
    import plot

    png = os.path.join(args.out, "sweep.png")
    print("\n" + plot.compare([r["dir"] for r in results], png))
    print(f"curves: {png} (python plot.py {args.out})")
    two = next((r for r in results if r["eta"] == 2), results[-1])
    print(f"async_speedup={base['loop_s'] / two['loop_s']:.2f}")


def _fmt(x):
    return "-" if x is None else f"{x:.2f}"


if __name__ == "__main__":
    main()
