"""Time to reward: wall-clock until the fresh groups' reward holds a bar, per learning rule and staleness
bound.

    python -m bench.time_to_reward [--steps 12] [--seed 0] [--out bench_out/time_to_reward] [--report-only]
    python -m bench.time_to_reward --sweep      # first: the learning rate of every rule, synchronous
    python -m bench.time_to_reward --seeds 0,1,2,3 [--baseline <commit>]
                                   [--vary 'name=key=value key=value' ...]

All on the default task and model, on this machine, as Hydra multiruns of `train.py`:
  - `--sweep`: `algo` in SWEEP_RULES x `train.lr` in SWEEP_LRS at max_staleness=0, from which each rule's
    preset (conf/algo/<rule>.yaml) takes its learning rate.
  - `before`: the default run as it was on 2026-11-23 before this sweep (BEFORE below): tb, max_staleness=2,
    lr 2e-5, beta 0.1, 8 prompts a step, the raw TB loss, half of each batch replayed, one thread per process,
    BEFORE_STEPS steps (it learns more slowly).
  - the grid: `algo` in RULES x `max_staleness` in ETAS, with the presets' knobs and the cores shared by phase
    (cluster.threads_per_process=0).
  - `cores`: tb at the same ETAS with fixed thread counts, 1 per process (the layout before) and 2 per process
    (oversubscribed when the two sides overlap), against the grid's phase-shared cores.
  - `slowgen`: tb at the same ETAS with a slower generator (rollout.max_batch=8: one group decoded at a time),
    where generation takes about as long as training: the ratio at which asynchrony could pay on 2 cores.

Time to reward is launch/summary.py's: the `time_s` at which the 3-step moving average of `reward_mean` first
reaches 0.8 (and 0.9); evaluation runs only after the last step, so it is not in the clock. Prints a Markdown
table (time to 0.8 and 0.9, s/step, the split of a step into training and waiting, final test pass@1), draws
time_to_reward.png (reward against wall-clock, every setting), and ends with one `<setting>=<seconds to 0.8>`
line per setting (`never` if it did not get there). A bench that stopped part way reruns only what is missing.

`--seeds`, the multi-seed mode: the default run (`now`) once per seed, and beside it, per seed, `baseline`
(the same command in a git worktree of `--baseline`, for example the commit before a change, so both are
measured in the same session on the same machine) and each `--vary` setting (the default run with those
overrides: one factor at a time). Per setting: the median over seeds of the time and of the steps to 0.8 with
their range, step 1's time against the median steady step (steps 4 on that trained as many groups as step 1:
`steady_step`), and s/step; then `<setting>_time_to_0.8=<median s>`, `<setting>_steps_to_0.8=` and
`<setting>_step1_over_steady=` lines, and `now_vs_baseline=<baseline's median time / now's>`.
"""
import argparse
import json
import os
import statistics
import subprocess
import sys
from functools import partial

from bench.common import baseline_tree, median
from bench.common import parse_vary as common_parse_vary
from launch.summary import THRESHOLDS, completed, time_to_reward

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SWEEP_RULES, SWEEP_LRS = ("tb", "grpo", "ppo", "rloo", "online_dpo"), ("2e-5", "5e-5")
RULES, ETAS = ("tb", "grpo", "ppo"), (0, 1)
# The default run before this sweep (its values then; the schema's defaults have moved since).
BEFORE = ["algo=tb", "max_staleness=2", "train.lr=2e-5", "algo.normalize=false", "algo.beta_start=0.1",
          "algo.beta_end=0.1", "buffer.recent_prob=0.5",
          "train.batch_groups=8", "cluster.threads_per_process=1"]
BEFORE_STEPS = 24  # it learns more slowly: enough steps to see it cross the bar
SLOWGEN = ["algo=tb", "rollout.max_batch=8"]
COMMON = ["eval.every=0", "eval.k=1", "progress=false", "checkpoint.at_end=false"]


def _train(args: list[str], root: str = ROOT) -> None:
    cmd = [sys.executable, os.path.join(root, "train.py"), *args]
    print(" ".join(cmd[1:]), flush=True)
    result = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"error: {' '.join(args[:3])} failed:\n{result.stderr[-2000:]}")


def settings(out: str, sweep: bool) -> dict[str, str]:
    """Setting name -> its run directory."""
    if sweep:
        # Hydra names the folders by the values as the config holds them: 5e-05
        return {f"{r}_lr{lr}": os.path.join(out, "sweep", f"{r}_lr{float(lr)}") for r in SWEEP_RULES
                for lr in SWEEP_LRS}
    runs = {"before": os.path.join(out, "before")}
    runs |= {f"{r}_eta{e}": os.path.join(out, "grid", f"{r}_eta{e}") for r in RULES for e in ETAS}
    runs |= {f"tb_eta{e}_threads{t}": os.path.join(out, "cores", f"tb_eta{e}_threads{t}")
             for e in ETAS for t in (1, 2)}
    return runs | {f"tb_eta{e}_slowgen": os.path.join(out, "slowgen", f"tb_eta{e}") for e in ETAS}


def run_all(out: str, steps: int, seed: int, sweep: bool) -> None:
    common = [f"steps={steps}", f"seed={seed}", *COMMON]
    if sweep:
        _multirun(os.path.join(out, "sweep"),
                  [f"algo={','.join(SWEEP_RULES)}", f"train.lr={','.join(SWEEP_LRS)}", "max_staleness=0"],
                  "${algo.name}_lr${train.lr}", common)
        return
    before = os.path.join(out, "before")
    if not completed(before, BEFORE_STEPS):
        _train([*BEFORE, *common, f"steps={BEFORE_STEPS}", f"hydra.run.dir={before}"])
    etas = f"max_staleness={','.join(map(str, ETAS))}"
    _multirun(os.path.join(out, "grid"), [f"algo={','.join(RULES)}", etas],
              "${algo.name}_eta${max_staleness}", common)
    _multirun(os.path.join(out, "cores"), ["algo=tb", etas, "cluster.threads_per_process=1,2",
                                           "cluster.oversubscribe=true"],
              "${algo.name}_eta${max_staleness}_threads${cluster.threads_per_process}", common)
    _multirun(os.path.join(out, "slowgen"), [*SLOWGEN, etas], "${algo.name}_eta${max_staleness}", common)


def _multirun(sweep_dir: str, grid: list[str], subdir: str, common: list[str]) -> None:
    """One Hydra multirun, unless every run of it is already complete (a bench stopped part way)."""
    runs = [os.path.join(sweep_dir, d) for d in os.listdir(sweep_dir)] if os.path.isdir(sweep_dir) else []
    runs = [d for d in runs if os.path.isdir(d)]
    steps = int(common[0].split("=")[1])
    expected = 1
    for axis in grid:
        expected *= len(axis.split("=", 1)[1].split(","))
    if len(runs) >= expected and all(completed(d, steps) for d in runs):
        return
    _train(["-m", *grid, *common, f"hydra.sweep.dir={sweep_dir}", f"hydra.sweep.subdir='{subdir}'"])


def load(run_dir: str) -> dict:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    last = rows[-1]
    n = len(rows)
    return {"clock": [r["time_s"] for r in rows], "reward": [r["reward_mean"] for r in rows],
            **{t: (time_to_reward(rows, t) or (None,))[0] for t in THRESHOLDS},
            "s_per_step": last["time_s"] / n, "train_s": sum(r["perf/train_step_s"] for r in rows) / n,
            "wait_s": sum(r["perf/wait_s"] for r in rows) / n, "pass@1": last.get("eval_pass@1"),
            "threads": sum(r.get("perf/train_threads", 1) for r in rows) / n}


def table(results: dict) -> str:
    def s(v, fmt="{:.0f}"):
        return "never" if v is None else fmt.format(v)

    lines = ["| setting | time to 0.8 (s) | time to 0.9 (s) | s/step | train s/step | wait s/step | "
             "trainer threads (mean) | test pass@1, end |", "| --- " * 8 + "|"]
    for name, r in results.items():
        lines.append(f"| {name} | {s(r[0.8])} | {s(r[0.9])} | {r['s_per_step']:.1f} | {r['train_s']:.1f} | "
                     f"{r['wait_s']:.1f} | {r['threads']:.1f} | {s(r['pass@1'], '{:.2f}')} |")
    return "\n".join(lines)


def plot(results: dict, png: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(9, 5))
    for i, (name, r) in enumerate(results.items()):
        window = [sum(r["reward"][max(0, i - 2):i + 1]) / len(r["reward"][max(0, i - 2):i + 1])
                  for i in range(len(r["reward"]))]
        style = "--" if "eta0" in name else ("-" if name != "before" else ":")
        ax.plot(r["clock"], window, style, label=name, linewidth=2.5 if name == "before" else 1.5,
                color="black" if name == "before" else plt.cm.tab20(i % 20))
    for t in THRESHOLDS:
        ax.axhline(t, color="grey", linewidth=0.5)
    ax.set_xlabel("wall-clock, s")
    ax.set_ylabel("reward of the step's fresh groups, 3-step mean")
    ax.legend(fontsize=8, ncol=2)
    fig.tight_layout()
    fig.savefig(png, dpi=90)
    plt.close(fig)


parse_vary = partial(common_parse_vary, reserved=("now", "baseline"))  # `--vary` of the seeds mode


def run_seeds(out: str, steps: int, seeds: list[int], settings: dict[str, tuple[str, list[str]]]) -> None:
    """Every setting (name -> (checkout, overrides)) at every seed, a whole comparison per seed first."""
    for seed in seeds:
        for name, (root, overrides) in settings.items():
            folder = os.path.join(os.path.abspath(out), "seeds", name, f"seed{seed}")
            if not completed(folder, steps):
                _train([*overrides, f"steps={steps}", f"seed={seed}", *COMMON, f"hydra.run.dir={folder}"],
                       root)


def step_times(rows: list[dict]) -> list[float]:
    return [b["time_s"] - a["time_s"] for a, b in zip([{"time_s": 0.0}] + rows, rows)]


def steady_step(rows: list[dict], steps: list[float]) -> float:
    """The median time of steps 4 on that trained as many groups as step 1 (the same
    `train/tied_groups_skipped`), or of all steps 4 on where none did. A step whose groups all tie skips their
    passes (train.skip_tied_groups), so a solved task's late steps are cheaper than step 1 for a reason that
    is not a warm-up tax."""
    later = list(zip(rows, steps))[3:]
    first_tied = rows[0].get("train/tied_groups_skipped")
    alike = [s for row, s in later if row.get("train/tied_groups_skipped") == first_tied]
    return statistics.median(alike or [s for _, s in later] or steps[1:] or steps)


def load_seed(folder: str) -> dict:
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    reached = time_to_reward(rows, 0.8) or (None, None)
    steps = step_times(rows)
    return {"time": reached[0], "steps": reached[1], "step1_over_steady": steps[0] / steady_step(rows, steps),
            "s_per_step": rows[-1]["time_s"] / len(rows), "pass@1": rows[-1].get("eval_pass@1")}


def seeds_table(results: dict[str, list[dict]]) -> tuple[str, list[str]]:
    """The Markdown table over seeds and the one-figure lines."""
    def spread(values, fmt):
        mid = median(values)
        done = [v for v in values if v is not None]
        span = f"{fmt.format(min(done))}-{fmt.format(max(done))}" if done else "-"
        never = sum(v is None for v in values)
        return (("never" if mid is None else fmt.format(mid))
                + f" ({span}{f', {never} never' if never else ''})")

    lines = ["| setting | seeds | time to 0.8, s: median (range) | steps to 0.8: median (range) | "
             "step 1 / steady step | s/step | test pass@1: median (range) |", "| --- " * 7 + "|"]
    figures = []
    for name, runs in results.items():
        lines.append(f"| {name} | {len(runs)} | {spread([r['time'] for r in runs], '{:.0f}')} | "
                     f"{spread([r['steps'] for r in runs], '{:.0f}')} | "
                     f"{statistics.median(r['step1_over_steady'] for r in runs):.2f} | "
                     f"{statistics.median(r['s_per_step'] for r in runs):.1f} | "
                     f"{spread([r['pass@1'] for r in runs], '{:.2f}')} |")
        t, n = median([r["time"] for r in runs]), median([r["steps"] for r in runs])
        figures += [f"{name}_time_to_0.8={'never' if t is None else round(t, 1)}",
                    f"{name}_steps_to_0.8={'never' if n is None else n}",
                    f"{name}_step1_over_steady={statistics.median(r['step1_over_steady'] for r in runs):.2f}"]
    now, base = results.get("now"), results.get("baseline")
    if now and base:
        t_now, t_base = median([r["time"] for r in now]), median([r["time"] for r in base])
        figures.append("now_vs_baseline="
                       f"{'never' if t_now is None or t_base is None else f'{t_base / t_now:.2f}'}")
    return "\n".join(lines), figures


def main_seeds(args) -> None:
    seeds = [int(s) for s in args.seeds.split(",")]
    settings = {"now": (ROOT, [])}
    if args.baseline:
        settings["baseline"] = (baseline_tree(args.out, args.baseline), [])
    settings |= {name: (ROOT, overrides) for name, overrides in parse_vary(args.vary).items()}
    if not args.report_only:
        run_seeds(args.out, args.steps, seeds, settings)
    results = {}
    for name in settings:
        folders = [os.path.join(args.out, "seeds", name, f"seed{s}") for s in seeds]
        runs = [load_seed(f) for f in folders if os.path.exists(os.path.join(f, "metrics.jsonl"))]
        if runs:
            results[name] = runs
    text, figures = seeds_table(results)
    print(f"\n{args.steps} steps, seeds {args.seeds}"
          + (f", baseline {args.baseline}" if args.baseline else "") + "\n")
    print(text + "\n")
    print("\n".join(figures))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--steps", type=int, default=12)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--seeds", default="", help="the multi-seed mode: these seeds, for example 0,1,2,3")
    parser.add_argument("--baseline", default="", help="with --seeds: also run this commit's default run")
    parser.add_argument("--vary", action="append", default=[],
                        help="with --seeds: 'name=key=value ...', repeatable")
    parser.add_argument("--sweep", action="store_true",
                        help="the learning-rate sweep instead of the comparison")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench_out", "time_to_reward"))
    parser.add_argument("--report-only", action="store_true", help="only read the runs already in --out")
    args = parser.parse_args()
    if args.seeds:
        return main_seeds(args)
    if args.baseline or args.vary:
        sys.exit("error: --baseline and --vary go with --seeds (the multi-seed mode)")
    if not args.report_only:
        run_all(args.out, args.steps, args.seed, args.sweep)
    results = {name: load(d) for name, d in settings(args.out, args.sweep).items()
               if os.path.exists(os.path.join(d, "metrics.jsonl"))}
    print(f"\n{args.steps} steps, seed {args.seed}\n")
    print(table(results))
    png = os.path.join(args.out, "sweep.png" if args.sweep else "time_to_reward.png")
    plot(results, png)
    print(f"\nplot: {png}")
    for name, r in results.items():
        print(f"{name}={'never' if r[0.8] is None else round(r[0.8])}")


if __name__ == "__main__":
    main()
