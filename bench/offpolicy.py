"""Off-policy trade-offs: staleness against the learning rule, and updates per batch, on the same 2 cores.

    python -m bench.offpolicy [--steps 10] [--seeds 0,1,2] [--etas 0,2,8] [--out bench_out/offpolicy]
                              [--report-only]

The grid, each point once per seed (Hydra multiruns of `train.py`, one per rule variant):
    max_staleness in {0, 2, 8}  x  {ppo (decoupled), ppo naive (algo.decoupled=false), grpo, dapo, gspo,
                                    cispo, online_dpo, tb}
    ppo (decoupled) with train.minibatches=4 at max_staleness=2
on the default arithmetic task and model, at a reduced size (COMMON below) so that the grid takes about an
hour on 2 cores. Prints one Markdown table (each figure as the mean over seeds, with the seeds' spread) and
draws offpolicy.png: the reward of each step's fresh groups and the greedy test pass@1, against training
wall-clock (evaluation time taken out), one panel per rule, one colour per max_staleness, a band between the
seeds.
Then the seeds' three claims, each marked reproduced, not reproduced or not distinguishable from the test
pass@1 at eta 8 (`claims` below), and
`offpolicy_decoupled_vs_naive=<ppo's final test pass@1 at eta=8 / naive ppo's>`. `--etas 0,8` leaves out the
middle column (and the minibatches=4 row, which is at eta 2): the claims need only 0 and 8. A bench that
stopped part way, or a wider `--etas` later, reruns only the (variant, eta) columns with a missing run.
"""
import argparse
import json
import os
import subprocess
import sys

from launch.summary import completed

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ETAS = (0, 2, 8)
VARIANTS = {  # name -> overrides; each runs at every eta
    "ppo": ["algo=ppo"],
    "ppo_naive": ["algo=ppo", "algo.decoupled=false"],
    "grpo": ["algo=grpo"],
    "dapo": ["algo=dapo"],
    "gspo": ["algo=gspo"],
    "cispo": ["algo=cispo"],
    "online_dpo": ["algo=online_dpo"],
    "tb": ["algo=tb"],
}
EXTRA = {"ppo_m4": (["algo=ppo", "train.minibatches=4"], (2,))}  # name -> overrides, etas
# 4 prompts x 4 samples a step, a quarter of the default batch, so that 10 steps x 32 runs fit in about an
# hour on 2 cores; the test split cut to its first 32 questions, evaluated every 5 steps.
COMMON = ["train.batch_groups=4", "rollout.group_size=4", "eval.every=5", "eval.max_examples=32", "eval.k=1",
          "progress=false", "checkpoint.at_end=false"]


def run_variant(name: str, overrides: list[str], etas, seeds: list[int], steps: int, out: str) -> None:
    sweep_dir = os.path.join(out, name)
    etas = [e for e in etas
            if not all(completed(os.path.join(sweep_dir, _subdir(e, s)), steps) for s in seeds)]
    if not etas:
        print(f"{name}: done before, kept", flush=True)
        return
    cmd = [sys.executable, os.path.join(ROOT, "train.py"), "-m", f"max_staleness={','.join(map(str, etas))}",
           f"seed={','.join(map(str, seeds))}", f"steps={steps}", *overrides, *COMMON,
           f"hydra.sweep.dir={sweep_dir}", "hydra.sweep.subdir='eta=${max_staleness},seed=${seed}'"]
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
    evals, clock, curve, tests = 0.0, [], [], []
    for r in rows:
        evals += r.get("perf/eval_s", 0.0)
        clock.append(r["time_s"] - evals)  # training time: the evaluation pauses training, the same for all
        curve.append(r["reward_mean"])
        if "eval_pass@1" in r:
            tests.append((clock[-1], r["eval_pass@1"]))
    third = max(len(rows) // 3, 1)

    def mean(key):
        values = [r[key] for r in rows if key in r]
        return sum(values) / len(values) if values else None

    return {"clock": clock, "reward": curve, "tests": tests, "reward_last_third": sum(curve[-third:]) / third,
            "pass@1": tests[-1][1] if tests else None, "s_per_step": clock[-1] / len(rows),
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
    lines = ["| rule | max_staleness | reward, last third | test pass@1, end | s/step (training) | "
             "mean staleness | groups dropped | KL(behav ‖ trainer), old tokens | "
             "mismatch KL, fresh tokens | ESS | clip frac | entropy |", "| --- " * 12 + "|"]
    for (name, eta), runs in results.items():
        def f(key, fmt="{:.2f}"):
            value = _mean([r[key] for r in runs])
            return "-" if value is None else fmt.format(value)
        lines.append(f"| {name} | {eta} | {_spread([r['reward_last_third'] for r in runs])} | "
                     f"{_spread([r['pass@1'] for r in runs])} | {f('s_per_step', '{:.1f}')} | "
                     f"{f('staleness')} | {f('dropped', '{:.0f}')} | {f('offpolicy_kl', '{:.4f}')} | "
                     f"{f('mismatch_kl', '{:.1e}')} | {f('ess')} | {f('clip_frac', '{:.3f}')} | "
                     f"{f('entropy')} |")
    return "\n".join(lines)


# (who, what they claim, the rule, the rule it beats at eta 8 or None: robust = no worse at eta 8 than at
# eta 0)
CLAIMS = [("AReaL", "decoupled PPO stays stable under staleness where naive PPO degrades", "ppo",
           "ppo_naive"),
          ("Asynchronous RLHF", "online DPO is robust to off-policy data", "online_dpo", None),
          ("TBA", "trajectory balance with replay is robust to off-policy data", "tb", None)]
NOISY = 0.10  # half-spreads adding up to more than this (3 test questions of 32) decide nothing


def _pass(runs) -> tuple[float, float]:
    """Mean final test pass@1 over the seeds, and half their spread."""
    values = [r["pass@1"] for r in runs if r["pass@1"] is not None]
    return sum(values) / len(values), (max(values) - min(values)) / 2


def claims(results: dict) -> list[str]:
    """One line per claim: reproduced when the rule at eta 8 beats `against` at eta 8 (or, without one, is no
    worse than itself at eta 0) by more than the seeds' half-spreads together; not reproduced when it loses by
    more; not distinguishable when the gap is inside them, or the spreads are too wide to read."""
    lines = []
    for who, what, rule, against in CLAIMS:
        if (rule, 8) not in results or (rule, 0) not in results:
            continue
        mean8, spread8 = _pass(results[(rule, 8)])
        if against:
            other, spread_o = _pass(results[(against, 8)])
            gap, noise = mean8 - other, spread8 + spread_o
            seen = f"{mean8:.2f} ± {spread8:.2f} vs {against} {other:.2f} ± {spread_o:.2f} at eta 8"
            verdict = "reproduced" if gap > noise and noise <= NOISY else \
                "not reproduced" if gap < -noise else "not distinguishable"
        else:
            mean0, spread0 = _pass(results[(rule, 0)])
            drop, noise = mean0 - mean8, spread8 + spread0
            seen = f"{mean8:.2f} ± {spread8:.2f} at eta 8 vs {mean0:.2f} ± {spread0:.2f} at eta 0"
            verdict = "not reproduced" if drop > noise else \
                "not distinguishable" if noise > NOISY else "reproduced"
        lines.append(f"{who}: {what}: {verdict} (test pass@1 {seen})")
    return lines


def plot(results: dict, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = list(VARIANTS)
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
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--seeds", default="0,1,2")
    parser.add_argument("--etas", default=",".join(map(str, ETAS)), help=f"a subset of {ETAS}")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench_out", "offpolicy"))
    parser.add_argument("--report-only", action="store_true", help="only read the runs already in --out")
    args = parser.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    chosen = [int(e) for e in args.etas.split(",")]
    if not set(chosen) <= set(ETAS):
        sys.exit(f"error: --etas {args.etas}: choose from {','.join(map(str, ETAS))} (the plot's colours)")
    grid = {name: (overrides, ETAS) for name, overrides in VARIANTS.items()} | EXTRA
    grid = {name: (overrides, tuple(e for e in etas if e in chosen))
            for name, (overrides, etas) in grid.items()}
    grid = {name: entry for name, entry in grid.items() if entry[1]}
    if not args.report_only:
        for name, (overrides, etas) in grid.items():
            run_variant(name, overrides, etas, seeds, args.steps, args.out)
    results = {(name, eta): [load(os.path.join(args.out, name, _subdir(eta, s))) for s in seeds]
               for name, (_, etas) in grid.items() for eta in etas}
    print(f"\n{args.steps} steps of 4 prompts x 4 samples, seeds {args.seeds}; mean over seeds ± "
          "half their spread\n")
    print(table(results))
    png = os.path.join(args.out, "offpolicy.png")
    plot(results, png)
    print(f"\nplot: {png}\n")
    for line in claims(results):
        print(line)
    if ("ppo", 8) not in results:
        return
    # the fresh groups' reward at eta = 8 describes a policy several versions old; the test split does not
    ratio = _mean([r["pass@1"] for r in results[("ppo", 8)]]) / \
        max(_mean([r["pass@1"] for r in results[("ppo_naive", 8)]]), 1e-9)
    print(f"offpolicy_decoupled_vs_naive={ratio:.2f}")


if __name__ == "__main__":
    main()
