"""cluster=ray on a simulated two-node cluster against the single-node run of the same config: groups per
second and the seconds each step's weights take to reach the generators.

    python -m bench.ray_nodes [--steps 12] [--seeds 0,1] [--out bench_out/ray_nodes]

Needs Ray (pip install -r requirements-ray.txt). Per seed, two runs of the default task and model on this
machine, `python train.py steps=N seed=S eval.every=0`, each in its own process tree:
  - `single`: the default CPU plan, one rollout worker and one trainer rank;
  - `ray`: the same two processes with the rollout worker on a generator node: `cluster=ray`, the trainer node
    training (no rollout worker) and one simulated generator node with one, forwarding its groups over Ray and
    receiving the weights by a gloo broadcast after every step. Ray's own daemons share the machine's cores.
Figures, from each run's metrics.jsonl and summary.json:
  - groups/s: train.batch_groups groups a step over the mean step time of steps 2 on (step 1 has the
    start-up);
  - weights: `single`'s publish into the shared-memory store (perf/publish_s, the trainer's side), and `ray`'s
    publish plus the broadcast to the generator node (ray/broadcast_s: a consistent copy of the store and the
    gloo broadcast, measured by the trainer node's forwarding thread);
  - the generator node's groups delivered and its mean forwarding call's seconds.
Ends with `ray_vs_single=<groups/s ratio, median over seeds>` and `broadcast_s=<median>`.
"""
import argparse
import json
import os
import statistics
import sys

from bench.common import train_run

COMMON = ["eval.every=0", "progress=false", "checkpoint.at_end=false"]
SETTINGS = {
    "single": [],
    "ray": ["cluster=ray"],
}


def read(folder: str) -> dict:
    with open(os.path.join(folder, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    with open(os.path.join(folder, "config.yaml")) as f:
        groups = next(int(line.split(":")[1]) for line in f if line.strip().startswith("batch_groups:"))
    step_s = (rows[-1]["time_s"] - rows[0]["time_s"]) / (len(rows) - 1)
    return {"groups_per_s": groups / step_s, "step_s": step_s,
            "publish_s": statistics.mean(r["perf/publish_s"] for r in rows),
            "broadcast_s": summary.get("ray/broadcast_s"), "node_groups": summary.get("ray/node1_groups"),
            "forward_s": summary.get("ray/node1_forward_s")}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seeds", default="0", help="comma-separated")
    parser.add_argument("--out", default="bench_out/ray_nodes")
    args = parser.parse_args()
    if args.steps < 2:
        sys.exit("error: --steps must be >= 2 (step 1 has the start-up)")
    try:
        import ray  # noqa: F401
    except ImportError:
        sys.exit("error: bench.ray_nodes needs Ray: pip install -r requirements-ray.txt")
    seeds = [int(s) for s in args.seeds.split(",")]
    results = {name: [] for name in SETTINGS}
    for seed in seeds:
        for name, overrides in SETTINGS.items():
            folder = os.path.abspath(os.path.join(args.out, f"{name}_seed{seed}"))
            train_run(folder, [*COMMON, f"seed={seed}", *overrides], args.steps)
            results[name].append(read(folder))
    print(f"\n{args.steps} steps of the default run per setting, seeds {args.seeds}; this machine: "
          f"{os.cpu_count()} cores")
    print("| setting | seed | groups/s | s/step (2 on) | weights to the engines, s | "
          "generator node: groups, s per forwarding call |")
    print("| --- | --- | --- | --- | --- | --- |")
    for name in SETTINGS:
        for seed, r in zip(seeds, results[name]):
            weights = f"{r['publish_s']:.3f} publish" + (f" + {r['broadcast_s']:.3f} broadcast"
                                                         if r["broadcast_s"] is not None else "")
            node = f"{r['node_groups']}, {r['forward_s']:.3f}" if r["node_groups"] is not None else "-"
            print(f"| {name} | {seed} | {r['groups_per_s']:.3f} | {r['step_s']:.2f} | {weights} | {node} |")
    ratio = statistics.median(r["groups_per_s"] / s["groups_per_s"] for r, s in zip(results["ray"],
                                                                                       results["single"]))
    print(f"ray_vs_single={ratio:.2f}")
    print(f"broadcast_s={statistics.median(r['broadcast_s'] for r in results['ray']):.3f}")


if __name__ == "__main__":
    main()
