"""Off-policy trade-offs: the three seed papers' claims decided on a task hard enough to tell rules apart, and
the wider grid of every rule against staleness.

    python -m bench.offpolicy [--grid claims|rules] [--steps N] [--seeds 0,1,...] [--etas 0,8]
                              [--rules ppo,rloo,...] [--out DIR] [--report-only]

`--grid claims` (the default): the harder arithmetic setting (HARDER below: three operands of 0..5, lr 1e-5;
the untrained model's greedy test pass@1 is 0.27), the default batch (4 prompts x 8 samples), 20 steps, six
seeds, max_staleness 0 and 8, and only the rules the claims compare: decoupled PPO (8 only: naive PPO),
online DPO, PPO, GRPO, RLOO, TB with its replay (`buffer.sampler` auto: tba) and TB without it
(`buffer.sampler=fifo`). Test pass@1 on the 64 held-out questions every 5 steps. About 70 minutes on 2 cores.
`--grid rules`: every rule at max_staleness 0, 2 and 8 on the default task at a quarter batch (GRIDS below),
10 steps, three seeds, plus decoupled PPO at `train.minibatches=4` at eta 2: about an hour.

Prints one Markdown table (each figure as the mean over seeds, with the seeds' spread), draws
offpolicy.png (the reward of each step's fresh groups and the greedy test pass@1 against training wall-clock,
evaluation time taken out, one panel per rule, one colour per max_staleness, a band between the seeds), then a
verdict per claim, and `offpolicy_decoupled_vs_naive=<decoupled PPO's figure at eta 8 / naive PPO's>`. A
bench that stopped part way, or more seeds or etas later, runs only the (variant, eta, seed) points with no
completed run.

The decision rule, written down on 2026-12-05 before the claims grid first ran (its code: bench/claims.py):

- A run's figure is its greedy test pass@1 averaged over the evaluations in the second half of training
  (steps 10, 15 and 20 of 20: 3 x 64 answers). Comparisons are paired by seed: a seed fixes the test split and
  the order of the training prompts for every rule and eta.
- A rule's drop is, per seed, its figure at max_staleness 0 minus its figure at 8.
- "A beats B" over n seeds of the paired difference d (mean m, standard error se, t the one-sided 95%
  Student quantile at n - 1 degrees of freedom): holds when m - t.se > 0; does not hold when m + t.se <
  DELTA = 0.05 (an advantage of 3 test questions in 64 or more is ruled out); undecided otherwise, and then
  the seeds that would decide it at this spread are printed (the n at which t.sd / sqrt(n) is under the
  distance from m to the nearer bound).
- AReaL, "decoupled PPO stays stable under staleness where naive PPO degrades": decoupled PPO beats naive PPO
  at max_staleness 8 (d = figure(ppo) - figure(ppo_naive)).
- Asynchronous RLHF, "online DPO is the most robust to off-policy data": online DPO's drop is smaller than
  PPO's, GRPO's and RLOO's (for each rival, d = drop(rival) - drop(online_dpo)). Holds when all three hold,
  does not hold when any does not, undecided otherwise.
- TBA, "trajectory balance with its replay stays robust far off-policy": TB's drop is smaller than GRPO's
  (d = drop(grpo) - drop(tb)) and than TB's own without the replay (d = drop(tb_fifo) - drop(tb)). Holds when
  both hold, does not hold when either does not, undecided otherwise.
- Each rule's drop is printed with its interval as well, so that "no rule degrades" reads apart from "this
  rule degrades less".
"""
import argparse
import json
import os
import subprocess
import sys

from bench.claims import claims, figures
from launch.summary import completed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ETAS = (0, 2, 8)  # the plot's colours
HARDER = ["task.terms=3", "task.max_operand=5", "task.test_size=64", "train.lr=1e-5"]
GRIDS = {
    # name -> variants {name: (overrides, etas)}, overrides common to all, steps, seeds
    "claims": ({"ppo": (["algo=ppo"], (0, 8)),
                "ppo_naive": (["algo=ppo", "algo.decoupled=false"], (8,)),
                "grpo": (["algo=grpo"], (0, 8)),
                "rloo": (["algo=rloo"], (0, 8)),
                "online_dpo": (["algo=online_dpo"], (0, 8)),
                "tb": (["algo=tb"], (0, 8)),
                "tb_fifo": (["algo=tb", "buffer.sampler=fifo"], (0, 8))},
               [*HARDER, "eval.every=5", "eval.k=1", "progress=false", "checkpoint.at_end=false"],
               20, "0,1,2,3,4,5"),
    # 4 prompts x 4 samples a step, a quarter of the default batch, so that 10 steps x 32 runs fit in about an
    # hour on 2 cores; the test split cut to its first 32 questions, evaluated every 5 steps.
    "rules": ({**{name: ([f"algo={name}"], ETAS) for name in ("ppo", "grpo", "dapo", "gspo", "cispo",
                                                               "online_dpo", "tb")},
               "ppo_naive": (["algo=ppo", "algo.decoupled=false"], ETAS),
               "ppo_m4": (["algo=ppo", "train.minibatches=4"], (2,))},
              ["train.batch_groups=4", "rollout.group_size=4", "eval.every=5", "eval.max_examples=32",
               "eval.k=1", "progress=false", "checkpoint.at_end=false"],
              10, "0,1,2"),
}


def run_variant(name: str, overrides: list[str], etas, seeds: list[int], steps: int, out: str,
                common: list[str]) -> None:
    """Run the (eta, seed) points of one variant that have no completed run: one Hydra multirun per set of
    etas missing the same seeds, so that a run already done is never run again (and never overwritten)."""
    sweep_dir = os.path.join(out, name)
    missing = {}  # missing seeds -> the etas that miss them
    for e in etas:
        todo = tuple(s for s in seeds if not completed(os.path.join(sweep_dir, _subdir(e, s)), steps))
        if todo:
            missing.setdefault(todo, []).append(e)
    if not missing:
        print(f"{name}: done before, kept", flush=True)
    for todo, todo_etas in missing.items():
        cmd = [sys.executable, os.path.join(ROOT, "train.py"), "-m",
               f"max_staleness={','.join(map(str, todo_etas))}", f"seed={','.join(map(str, todo))}",
               f"steps={steps}", *overrides, *common, f"hydra.sweep.dir={sweep_dir}",
               "hydra.sweep.subdir='eta=${max_staleness},seed=${seed}'"]
        print(" ".join(cmd[1:]), flush=True)
        result = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
        if result.returncode != 0:
            sys.exit(f"error: the {name} sweep failed:\n{result.stderr[-2000:]}")


def _subdir(eta: int, seed: int) -> str:
    return f"eta={eta},seed={seed}"


def load(run_dir: str) -> dict:
    """One run's curves and figures."""
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    evals, clock, curve, tests, late = 0.0, [], [], [], []
    for r in rows:
        evals += r.get("perf/eval_s", 0.0)
        clock.append(r["time_s"] - evals)  # training time: the evaluation pauses training, the same for all
        curve.append(r["reward_mean"])
        if "eval_pass@1" in r:
            tests.append((clock[-1], r["eval_pass@1"]))
            late += [r["eval_pass@1"]] if 2 * r["step"] >= len(rows) else []
    third = max(len(rows) // 3, 1)

    def mean(key):
        values = [r[key] for r in rows if key in r]
        return sum(values) / len(values) if values else None

    return {"clock": clock, "reward": curve, "tests": tests, "reward_last_third": sum(curve[-third:]) / third,
            "pass@1": tests[-1][1] if tests else None, "figure": sum(late) / len(late) if late else None,
            "s_per_step": clock[-1] / len(rows),
            "staleness": mean("staleness_mean"), "dropped": sum(r["staleness/dropped_groups"] for r in rows),
            "offpolicy_kl": mean("offpolicy/kl"), "mismatch_kl": mean("mismatch/kl"),
            "ess": mean("offpolicy/ess"),
            "clip_frac": next((mean(f"{rule}/clip_frac") for rule in ("ppo", "grpo", "dapo", "gspo")
                               if mean(f"{rule}/clip_frac") is not None), None),
            "entropy": mean("policy/entropy")}


def _spread(values) -> str:
    values = [v for v in values if v is not None]
    if not values:
        return "-"
    mid = sum(values) / len(values)
    return f"{mid:.2f} ± {(max(values) - min(values)) / 2:.2f}" if len(values) > 1 else f"{mid:.2f}"


def _mean(values):
    values = [v for v in values if v is not None]
    return sum(values) / len(values) if values else None


def table(results: dict) -> str:
    lines = ["| rule | max_staleness | reward, last third | test pass@1, end | test pass@1, 2nd half | "
             "s/step (training) | "
             "mean staleness | groups dropped | KL(behav ‖ trainer), old tokens | "
             "mismatch KL, fresh tokens | ESS | clip frac | entropy | seeds |", "| --- " * 14 + "|"]
    for (name, eta), runs in results.items():
        def f(key, fmt="{:.2f}"):
            value = _mean([r[key] for r in runs])
            return "-" if value is None else fmt.format(value)
        lines.append(f"| {name} | {eta} | {_spread([r['reward_last_third'] for r in runs])} | "
                     f"{_spread([r['pass@1'] for r in runs])} | {_spread([r['figure'] for r in runs])} | "
                     f"{f('s_per_step', '{:.1f}')} | "
                     f"{f('staleness')} | {f('dropped', '{:.0f}')} | {f('offpolicy_kl', '{:.4f}')} | "
                     f"{f('mismatch_kl', '{:.1e}')} | {f('ess')} | {f('clip_frac', '{:.3f}')} | "
                     f"{f('entropy')} | {len(runs)} |")
    return "\n".join(lines)


def plot(results: dict, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(dict.fromkeys("ppo" if name == "ppo_m4" else name for name, _ in results))
    fig, axes = plt.subplots(2, len(panels), figsize=(4 * len(panels), 7), sharey="row", squeeze=False)
    colors = {0: "tab:blue", 2: "tab:orange", 8: "tab:red"}
    for (name, eta), runs in results.items():
        col = panels.index("ppo" if name == "ppo_m4" else name)
        style = dict(color=colors[eta], linestyle="--" if name == "ppo_m4" else "-",
                     label=f"eta={eta}" + (", minibatches=4" if name == "ppo_m4" else ""))
        steps = min(len(r["reward"]) for r in runs)
        clock = [_mean([r["clock"][i] for r in runs]) for i in range(steps)]
        per_step = [[r["reward"][i] for r in runs] for i in range(steps)]
        axes[0][col].plot(clock, [_mean(v) for v in per_step], **style)
        axes[0][col].fill_between(clock, [min(v) for v in per_step], [max(v) for v in per_step],
                                  color=colors[eta], alpha=0.15)
        points = min(len(r["tests"]) for r in runs)
        if points:
            t = [_mean([r["tests"][i][0] for r in runs]) for i in range(points)]
            acc = [[r["tests"][i][1] for r in runs] for i in range(points)]
            axes[1][col].plot(t, [_mean(v) for v in acc], marker="o", **style)
            axes[1][col].fill_between(t, [min(v) for v in acc], [max(v) for v in acc], color=colors[eta],
                                      alpha=0.15)
    for col, name in enumerate(panels):
        axes[0][col].set_title(name.replace("_naive", " naive (decoupled=false)"))
        axes[1][col].set_xlabel("training wall-clock, s")
        if axes[0][col].lines:
            axes[0][col].legend(fontsize=8)
    axes[0][0].set_ylabel("reward of the step's fresh groups")
    axes[1][0].set_ylabel("test pass@1 (greedy)")
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--grid", choices=list(GRIDS), default="claims")
    parser.add_argument("--steps", type=int, help="default: the grid's (claims 20, rules 10)")
    parser.add_argument("--seeds", help="default: the grid's (claims 0..5, rules 0,1,2)")
    parser.add_argument("--etas", help="a subset of the grid's (claims 0,8; rules 0,2,8)")
    parser.add_argument("--rules", help="only these of the grid's variants, e.g. ppo,rloo (default: all)")
    parser.add_argument("--out", help="default: bench_out/offpolicy_<grid>")
    parser.add_argument("--report-only", action="store_true", help="only read the runs already in --out")
    args = parser.parse_args()
    variants, common, steps, seeds = GRIDS[args.grid]
    steps = args.steps or steps
    seeds = [int(s) for s in (args.seeds or seeds).split(",")]
    out = args.out or os.path.join(ROOT, "bench_out", f"offpolicy_{args.grid}")
    offered = sorted({e for _, etas in variants.values() for e in etas})
    chosen = [int(e) for e in args.etas.split(",")] if args.etas else offered
    if not set(chosen) <= set(offered):
        sys.exit(f"error: --etas {args.etas}: choose from {','.join(map(str, offered))} "
                 f"(the {args.grid} grid's)")
    grid = {name: (overrides, tuple(e for e in etas if e in chosen))
            for name, (overrides, etas) in variants.items()}
    grid = {name: entry for name, entry in grid.items() if entry[1]}
    if args.rules:
        unknown = set(args.rules.split(",")) - set(grid)
        if unknown:
            sys.exit(f"error: --rules {args.rules}: {','.join(sorted(unknown))} not in the {args.grid} grid "
                     f"(choose from {','.join(grid)})")
        grid = {name: entry for name, entry in grid.items() if name in args.rules.split(",")}
    if not args.report_only:
        for name, (overrides, etas) in grid.items():
            run_variant(name, overrides, etas, seeds, steps, out, common)
    # a run that did not complete (a bench stopped part way, read with --report-only) is left out
    results = {(name, eta): [{**load(os.path.join(out, name, _subdir(eta, s))), "seed": s} for s in seeds
                             if completed(os.path.join(out, name, _subdir(eta, s)), steps)]
               for name, (_, etas) in grid.items() for eta in etas}
    results = {key: runs for key, runs in results.items() if runs}
    if not results:
        sys.exit(f"error: no completed run of the {args.grid} grid in {out} at these seeds and steps; run it "
                 "without --report-only")
    print(f"\n{args.grid} grid: {steps} steps, {' '.join(common)}, seeds {','.join(map(str, seeds))}; "
          "mean over seeds ± half their spread\n")
    print(table(results))
    png = os.path.join(out, "offpolicy.png")
    plot(results, png)
    print(f"\nplot: {png}\n")
    for line in claims(results):
        print(line)
    decoupled, naive = figures(results, "ppo", 8), figures(results, "ppo_naive", 8)
    both = decoupled.keys() & naive.keys()
    if both:
        # the fresh groups' reward at eta = 8 describes a policy several versions old; the test split does not
        ratio = sum(decoupled[s] for s in both) / max(sum(naive[s] for s in both), 1e-9)
        print(f"offpolicy_decoupled_vs_naive={ratio:.2f} (seeds both ran: {len(both)})")


if __name__ == "__main__":
    main()
