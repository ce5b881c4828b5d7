"""cluster=ray's plumbing alone, at 1, 2 and 3 generator nodes: groups/s and each weight push's seconds.

    python -m bench.ray_scaling [--nodes 1,2,3] [--steps 40] [--seeds 0,1] [--step-s 0.1]
                                [--out bench_out/ray_scaling]

Needs Ray (pip install -r requirements-ray.txt). Every node is simulated on this machine (cluster.ray.address
""), each run a `python train.py cluster=ray` whose generator nodes run `rollout.engine=simulated`
(engines/simulated.py: no model, a decode step is a fixed wait of --step-s that uses no core, so a node's
output does not depend on how many cores the machine has) and whose learner trains a 2-layer random model of
width 64 (bench/startup.py tiny_model: a few milliseconds a step, so the learner is not what limits). The
trainer node has no rollout worker; each generator node has one, with 16 sequences in flight (4 groups of 4,
8 tokens each); max_staleness=4 and 8 groups a step, so the gate never holds a node back. What is left is
the plumbing: leases, forwarding calls, the ring, the weight pushes.
Figures, from each run's metrics.jsonl and summary.json:
  - groups/s: train.batch_groups groups a step over the mean step time from step 10 on (nodes start one
    after another; the first steps have the start-up);
  - push s: a weight push's mean seconds (ray/node<i>_push_s, the mean over the nodes), and forward s:
    a forwarding call's (ray/node<i>_forward_s).
Ends with `groups_per_s_<N>=` per node count (median over seeds) and `scaling_<N>=` the ratio to 1 node.
A bench stopped part way reruns only the missing runs.
"""
import argparse
import json
import os
import statistics
import sys

from bench.common import train_run
from bench.startup import tiny_model

SETTINGS = ["rollout.engine=simulated", "rollout.group_size=4", "rollout.max_new_tokens=8",
            "rollout.max_batch=16", "train.batch_groups=8", "train.micro_groups=8", "max_staleness=4",
            "eval.every=0", "checkpoint.at_end=false", "progress=false", "curves=false"]
FIRST = 10  # the step the timing starts from


def nodes(n: int) -> str:
    generators = ", ".join(["{role: generator, cores: 1, rollout_workers: 1}"] * n)
    return f"[{{role: trainer, cores: 1, rollout_workers: 0, trainer_ranks: 1}}, {generators}]"


def read(folder: str, n: int) -> dict:
    with open(os.path.join(folder, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    timed = [r for r in rows if r["step"] >= FIRST]
    step_s = (timed[-1]["time_s"] - timed[0]["time_s"]) / (len(timed) - 1)
    groups = int(next(s.split("=")[1] for s in SETTINGS if s.startswith("train.batch_groups=")))
    pushes = [summary[f"ray/node{i}_push_s"] for i in range(1, n + 1)]
    forwards = [summary[f"ray/node{i}_forward_s"] for i in range(1, n + 1)]
    return {"groups_per_s": groups / step_s, "step_s": step_s, "push_s": statistics.mean(pushes),
            "forward_s": statistics.mean(forwards),
            "delivered": [summary[f"ray/node{i}_groups"] for i in range(1, n + 1)]}


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--nodes", default="1,2,3", help="generator node counts, comma-separated")
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--seeds", default="0,1", help="comma-separated")
    parser.add_argument("--step-s", type=float, default=0.1, help="the simulated engine's decode step")
    parser.add_argument("--out", default="bench_out/ray_scaling")
    args = parser.parse_args()
    if args.steps < FIRST + 2:
        sys.exit(f"error: --steps must be >= {FIRST + 2} (timing starts at step {FIRST})")
    try:
        import ray  # noqa: F401
    except ImportError:
        sys.exit("error: bench.ray_scaling needs Ray: pip install -r requirements-ray.txt")
    counts = [int(n) for n in args.nodes.split(",")]
    seeds = [int(s) for s in args.seeds.split(",")]
    model = tiny_model(os.path.abspath(os.path.join(args.out, "model")))
    os.environ["RINGRL_SIMULATED_STEP_S"] = f"{args.step_s:g}"  # the launcher reads it for the engine spec
    results = {n: [] for n in counts}
    for seed in seeds:
        for n in counts:
            folder = os.path.abspath(os.path.join(args.out, f"nodes{n}_step{args.step_s:g}_seed{seed}"))
            train_run(folder, ["cluster=ray", f"cluster.ray.nodes={nodes(n)}", f"model.path={model}",
                               f"seed={seed}", *SETTINGS], args.steps)
            results[n].append(read(folder, n))
    print(f"\n{args.steps} steps per run, steps {FIRST} on timed; a simulated decode step of "
          f"{args.step_s:g} s; this machine: {os.cpu_count()} cores")
    print("| generator nodes | seed | groups/s | s/step | weight push, s (mean over nodes) | "
          "forwarding call, s | groups delivered per node |")
    print("| --- | --- | --- | --- | --- | --- | --- |")
    for n in counts:
        for seed, r in zip(seeds, results[n]):
            print(f"| {n} | {seed} | {r['groups_per_s']:.2f} | {r['step_s']:.3f} | {r['push_s']:.4f} | "
                  f"{r['forward_s']:.4f} | {', '.join(map(str, r['delivered']))} |")
    medians = {n: statistics.median(r["groups_per_s"] for r in results[n]) for n in counts}
    for n in counts:
        print(f"groups_per_s_{n}={medians[n]:.2f}")
    if 1 in medians:
        for n in counts:
            if n != 1:
                print(f"scaling_{n}={medians[n] / medians[1]:.2f}")


if __name__ == "__main__":
    main()
