"""Asynchrony where it pays: multi-turn episodes against a slow environment, synchronous vs asynchronous.

    python -m bench.agentic [--task arith_retry] [--etas 0,1,2,4] [--latencies 0,1,2] [--seeds 0,1,2]
                            [--steps 16] [--bar 0.8] [--out bench_out/agentic] [--report-only]

Each run is `train.py task=<task> max_staleness=<eta> env.latency_s=<latency> seed=<seed>` (turns of at most 8
tokens, episodes of at most 48: SHORT below): every environment step waits a log-normal delay of that mean
(env.latency_sigma=1, a long tail), a remote tool's stand-in that uses no core. A synchronous trainer (eta 0)
waits for the slowest episode of its batch; an asynchronous one trains on what has arrived while later
episodes wait for their tools. Per (latency, eta), medians over the seeds: time to the bar (the 3-step mean of
the fresh groups' reward, launch/summary.py), the same read by the policy (when the trainer published the
versions that sampled that window: launch/summary.py policy_time_to_reward), s/step and its split into
training and waiting for data, the share of the episodes' time spent waiting for the environment, and the idle
share of the cores (1 - the runs' CPU seconds / (wall seconds x cores)). Ends with one line per latency,
`speedup_latency<L>=<eta 0's median time / the best eta > 0's>` (`never` where a side never reached the bar),
and `speedup_latency<L>_by_policy=` the same by the policy.
A bench stopped part way reruns only the missing runs.
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import time

from bench.common import median
from launch.summary import completed, policy_time_to_reward, time_to_reward

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMON = ["eval.every=0", "eval.k=1", "eval.max_examples=4", "progress=false", "checkpoint.at_end=false"]
# Short turns ("Reply with just the number" needs a few tokens), so the bench's runs fit an hour on 2 cores.
SHORT = ["env.max_turn_tokens=8", "rollout.max_new_tokens=48"]


def run_dir(out: str, latency: float, eta: int, seed: int) -> str:
    return os.path.join(out, f"latency{latency:g}_eta{eta}_seed{seed}")


def run(out: str, task: str, latency: float, eta: int, seed: int, steps: int) -> None:
    folder = run_dir(out, latency, eta, seed)
    if completed(folder, steps):
        return
    args = [f"task={task}", f"max_staleness={eta}", f"env.latency_s={latency:g}", f"seed={seed}",
            f"steps={steps}", *COMMON, *SHORT, f"hydra.run.dir={folder}"]
    print("train.py " + " ".join(args), flush=True)
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    start = time.time()
    result = subprocess.run([sys.executable, os.path.join(ROOT, "train.py"), *args], cwd=ROOT,
                            capture_output=True, text=True)
    wall, after = time.time() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    if result.returncode != 0:
        sys.exit(f"error: {' '.join(args[:4])} failed:\n{result.stderr[-2000:]}")
    cpu = (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)
    with open(os.path.join(folder, "cpu.json"), "w") as f:
        json.dump({"wall_s": wall, "cpu_s": cpu, "cores": len(os.sched_getaffinity(0))}, f)


def load(folder: str, bar: float) -> dict:
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    with open(os.path.join(folder, "cpu.json")) as f:
        cpu = json.load(f)
    n, last = len(rows), rows[-1]
    reached, policy = time_to_reward(rows, bar), policy_time_to_reward(rows, bar)
    idle = 1 - cpu["cpu_s"] / (cpu["wall_s"] * cpu["cores"])
    return {"time": reached[0] if reached else None, "policy_time": policy[0] if policy else None,
            "s_step": last["time_s"] / n, "idle": idle,
            "train_s": sum(r["perf/train_step_s"] for r in rows) / n,
            "wait_s": sum(r["perf/wait_s"] for r in rows) / n,
            "env_frac": last.get("episode/env_time_frac", 0.0), "success": last.get("episode/success_rate")}


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--task", default="arith_retry")
    parser.add_argument("--etas", default="0,1,2,4")
    parser.add_argument("--latencies", default="0,1,2", help="mean seconds of each environment step's delay")
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--steps", type=int, default=16)
    parser.add_argument("--bar", type=float, default=0.8)
    parser.add_argument("--out", default=os.path.join(ROOT, "bench_out", "agentic"))
    parser.add_argument("--report-only", action="store_true")
    args = parser.parse_args()
    etas = [int(e) for e in args.etas.split(",")]
    latencies = [float(x) for x in args.latencies.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    if not args.report_only:
        for seed in seeds:  # a whole comparison per seed first: a bench stopped part way has whole seeds
            for latency in latencies:
                for eta in etas:
                    run(args.out, args.task, latency, eta, seed, args.steps)
    print(f"\ntask={args.task}, {args.steps} steps, seeds {args.seeds}, medians over seeds\n")
    print(f"| env latency (s) | max_staleness | time to {args.bar} (s) | by the policy (s) | s/step | "
          "train s/step | wait s/step | env share of episode time | idle share of cores |")
    print("| --- " * 9 + "|")
    best, best_policy = {}, {}
    for latency in latencies:
        for eta in etas:
            runs = [load(run_dir(args.out, latency, eta, s), args.bar) for s in seeds
                    if os.path.exists(os.path.join(run_dir(args.out, latency, eta, s), "cpu.json"))]
            if not runs:
                continue
            t, p = median([r["time"] for r in runs]), median([r["policy_time"] for r in runs])
            best[(latency, eta)], best_policy[(latency, eta)] = t, p

            def mid(key):
                return statistics.median(r[key] for r in runs)

            print(f"| {latency:g} | {eta} | {'never' if t is None else f'{t:.0f}'} ({len(runs)} seeds) | "
                  f"{'never' if p is None else f'{p:.0f}'} | {mid('s_step'):.1f} | {mid('train_s'):.1f} | "
                  f"{mid('wait_s'):.1f} | {mid('env_frac'):.2f} | {mid('idle'):.2f} |")
    print()
    for latency in latencies:
        for name, times in (("", best), ("_by_policy", best_policy)):
            sync = times.get((latency, 0))
            asyncs = [times[(latency, e)] for e in etas if e > 0 and times.get((latency, e)) is not None]
            speedup = "never" if sync is None or not asyncs else f"{sync / min(asyncs):.2f}"
            print(f"speedup_latency{latency:g}{name}={speedup}")


if __name__ == "__main__":
    main()
