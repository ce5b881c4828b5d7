"""Curves of one run, and runs side by side.

    python plot.py multirun/2026-11-22/10-00-00              # a sweep: sweep.png in it, and a Markdown table
    python plot.py outputs/a outputs/b -o compare.png        # any runs (or sweeps) together

Reads each run dir's metrics.jsonl (one row per optimizer step), config.yaml and Hydra overrides (the
multirun dir name or .hydra/overrides.yaml). Runs are named after the settings that differ between them
(`max_staleness=2`), else after their dirs. The table's final reward is the mean reward_mean of the last
quarter of the steps, as in summary.json.
"""
import argparse
import json
import math
import os
import re
import sys
from dataclasses import dataclass, field

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402

COSMETIC = {"progress", "logger"}  # settings that do not change a run's results: never in a label


@dataclass
class RunInfo:
    dir: str
    name: str  # the dir's basename
    overrides: dict = field(default_factory=dict)  # Hydra overrides: "max_staleness" -> "2"
    config: dict = field(default_factory=dict)  # config.yaml flattened: "train.lr" -> 2e-05


def load_run(run_dir: str) -> tuple[RunInfo, list[dict]]:
    """The run's identity and its metrics rows (lines cut short by a crash are skipped)."""
    import yaml

    name = os.path.basename(os.path.normpath(run_dir))
    info = RunInfo(run_dir, name, _overrides(run_dir, name))
    if os.path.exists(os.path.join(run_dir, "config.yaml")):
        with open(os.path.join(run_dir, "config.yaml")) as f:
            info.config = _flatten(yaml.safe_load(f) or {})
    rows = []
    if os.path.exists(os.path.join(run_dir, "metrics.jsonl")):
        with open(os.path.join(run_dir, "metrics.jsonl")) as f:
            for line in f:
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError:
                    continue
    return info, [r for r in rows if isinstance(r, dict)]


def find_runs(paths: list[str]) -> list[str]:
    """Run dirs (those with metrics.jsonl or config.yaml) given as such or found under sweep dirs, in job
    order."""
    runs = []
    for path in paths:
        if not os.path.isdir(path):
            raise ValueError(f"{path} is not a directory: give run dirs or sweep dirs")
        found = []
        for root, dirs, files in os.walk(path):
            if "metrics.jsonl" in files or "config.yaml" in files:
                found.append(os.path.normpath(root))
                dirs.clear()  # a run's own subfolders (checkpoints, wandb) hold no runs
            else:
                dirs[:] = [d for d in dirs if not d.startswith(".")]
        if not found:
            raise ValueError(f"no run under {path} (a run dir has metrics.jsonl): give run "
                             "dirs or sweep dirs")
        runs += sorted(found, key=_natural)
    return list(dict.fromkeys(runs))


def labels(infos: list[RunInfo]) -> list[str]:
    """Name each run by the settings that differ between the runs (config.yaml, else the Hydra overrides),
    overridden keys first, at most four; the dir name where nothing differs or names collide."""
    if len(infos) == 1:
        return [", ".join(f"{k}={v}" for k, v in infos[0].overrides.items()) or infos[0].name]
    settings = [_settings(i, infos) for i in infos]
    overridden = {k for i in infos for k in i.overrides}
    # a key only some configs have comes from a code change, not from the sweep
    keys = [k for k in dict.fromkeys(k for s in settings for k in s)
            if k not in COSMETIC and (k in overridden or all(k in s for s in settings))]
    differ = sorted((k for k in keys if len({s.get(k) for s in settings}) > 1),
                    key=lambda k: k not in overridden)
    out = [", ".join(f"{k}={s.get(k, '-')}" for k in differ[:4]) + (", ..." if len(differ) > 4 else "")
           for s in settings]
    return [i.name if not o or out.count(o) > 1 else o for o, i in zip(out, infos)]


def run_curves(run_dir: str) -> str | None:
    """Draw `<run_dir>/curves.png`: the five panels against step (top) and wall-clock (bottom)."""
    info, rows = load_run(run_dir)
    if not rows:
        return None
    fig, axes, minutes = _figure(rows, detail=True)
    _draw(axes, rows, "C0", None, True, minutes)
    _finish(axes, detail=True)
    fig.suptitle(f"{labels([info])[0]}: {len(rows)} step{'s' * (len(rows) != 1)}", fontsize=13)
    out = os.path.join(run_dir, "curves.png")
    fig.savefig(out, dpi=100)
    plt.close(fig)
    return out


def compare(run_dirs: list[str], out_png: str) -> str:
    """Draw the runs side by side into `out_png`; return a Markdown table with one row per run."""
    loaded = [load_run(d) for d in run_dirs]
    named = list(zip(labels([info for info, _ in loaded]), [rows for _, rows in loaded]))
    runs = [(label, rows) for label, rows in named if rows]
    skipped = [label for label, rows in named if not rows]
    if not runs:
        raise ValueError(f"no metrics rows in any of: {', '.join(run_dirs)}")
    fig, axes, minutes = _figure([r for _, rows in runs for r in rows], detail=False)
    for i, (label, rows) in enumerate(runs):
        _draw(axes, rows, f"C{i % 10}", label, False, minutes)
    _finish(axes, detail=False)
    handles, texts = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, texts, loc="upper center", ncol=min(len(runs), 6), fontsize=11, frameon=False)
    fig.savefig(out_png, dpi=100)
    plt.close(fig)
    table = ["| run | steps | final reward (mean reward_mean, last 25% of steps) | best test pass@1 | "
             "wall-clock (s) | gen tokens/s (mean) | train tokens/s (mean) | mean staleness |",
             "|---" * 8 + "|"]
    for label, rows in runs:
        s = summarize(rows)
        cells = [label.replace("|", "\\|"), str(s["steps"])] + [_fmt(s[k]) for k in (
            "final_reward", "best_pass@1", "wall_s", "gen_tokens_per_s", "train_tokens_per_s",
            "staleness_mean")]
        table.append("| " + " | ".join(cells) + " |")
    if skipped:
        table += [""] + [f"skipped (no rows in metrics.jsonl): {label}" for label in skipped]
    return "\n".join(table)


def summarize(rows: list[dict]) -> dict:
    """The table's figures. Final reward = mean reward_mean over the last quarter of the steps (at least
    one)."""
    def mean(values):
        return sum(values) / len(values) if values else None

    rewards = _values(rows, "reward_mean")
    passes = _values(rows, "eval_pass@1")
    times = _values(rows, "time_s")
    return {"steps": len(rows), "final_reward": mean(rewards[-max(len(rewards) // 4, 1):]),
            "best_pass@1": max(passes) if passes else None, "wall_s": times[-1] if times else None,
            "gen_tokens_per_s": mean(_values(rows, "gen_tokens_per_s")),
            "train_tokens_per_s": mean(_values(rows, "train_tokens_per_s")),
            "staleness_mean": mean(_values(rows, "staleness_mean"))}


def _figure(all_rows, detail):
    """Two rows of the five panels: x = optimizer step, then x = wall-clock (minutes for long runs)."""
    fig, axes = plt.subplots(2, 5, figsize=(20, 8), squeeze=False)
    # Fixed margins: a constrained layout of ten panels costs about 2 s per drawing on a 2-core machine.
    fig.subplots_adjust(left=0.04, right=0.99, bottom=0.07, top=0.89, wspace=0.28, hspace=0.32)
    minutes = max(_values(all_rows, "time_s"), default=0) > 600
    titles = (("reward (bold: trailing mean over 10% of steps)", "reward_mean"),
              ("test accuracy" if detail else "test pass@1", "eval_pass@1" if not detail else "pass rate"),
              ("loss", "loss"),
              ("staleness" if detail else "staleness (mean)", "policy versions behind"),
              ("throughput" if detail else "throughput (solid: generation, dashed: training)", "tokens/s"))
    for row, xlabel in enumerate(("optimizer step", "wall-clock (min)" if minutes else "wall-clock (s)")):
        for col, (title, ylabel) in enumerate(titles):
            ax = axes[row][col]
            ax.set_title(title, fontsize=10)
            ax.set_xlabel(xlabel)
            ax.set_ylabel(ylabel)
            ax.grid(alpha=0.3)
    return fig, axes, minutes


def _draw(axes, rows, color, label, detail, minutes):
    """One run's curves in `color`, top row against step, bottom row against wall-clock. detail (a single
    run): also pass@k and the maximum staleness, named in the panels' legends."""
    for row, x_key in enumerate(("step", "time_s")):
        ax, scale = axes[row], 60.0 if x_key == "time_s" and minutes else 1.0

        def curve(col, key, style="-", name=None):
            xs, ys = _series(rows, x_key, key, scale)
            if xs:
                marker = "o" if len(xs) == 1 or key.startswith("eval_") else None
                ax[col].plot(xs, ys, style, color=color, label=name, marker=marker, markersize=4)

        xs, ys = _series(rows, x_key, "reward_mean", scale)
        window = max(len(ys) // 10, 1)
        if window > 1:
            ax[0].plot(xs, ys, "-", color=color, alpha=0.3, linewidth=1)
        if ys:
            smooth = [sum(ys[max(j - window + 1, 0):j + 1]) / min(j + 1, window) for j in range(len(ys))]
            ax[0].plot(xs, smooth, "-", color=color, linewidth=2, marker="o" if len(ys) == 1 else None,
                       markersize=4, label=label)
        curve(1, "eval_pass@1", name="greedy pass@1")
        if detail:
            curve(1, "eval_pass@k", "--", name="sampled pass@k")
        curve(2, "loss")
        curve(3, "staleness_mean", name="mean")
        if detail:
            curve(3, "staleness_max", ":", name="max")
        curve(4, "gen_tokens_per_s", name="generation")
        curve(4, "train_tokens_per_s", "--", name="training")


def _finish(axes, detail):
    """Panel legends (a single run's series) and a note where no evaluation was logged."""
    for row in axes:
        if not row[1].lines:
            row[1].text(0.5, 0.5, "no evaluation logged", ha="center", va="center", color="gray",
                        transform=row[1].transAxes)
        if detail:
            for col in (1, 3, 4):
                if row[col].lines:
                    row[col].legend(fontsize=8)


def _series(rows, x_key, y_key, scale=1.0):
    """(x, y) over the rows where both are finite numbers."""
    pairs = [(r[x_key] / scale, r[y_key]) for r in rows if _num(r.get(x_key)) and _num(r.get(y_key))]
    return [p[0] for p in pairs], [p[1] for p in pairs]


def _values(rows, key):
    return [r[key] for r in rows if _num(r.get(key))]


def _num(value) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def _fmt(value) -> str:
    if value is None:
        return "-"
    return f"{value:.1f}" if abs(value) >= 100 else f"{value:.3g}"


def _overrides(run_dir: str, name: str) -> dict:
    """Hydra's overrides of a run: from a multirun dir name (`3_max_staleness=2,seed=1`), else from
    .hydra/overrides.yaml; hydra.* settings left out."""
    import yaml

    items = []
    match = re.fullmatch(r"\d+_(.+=.*)", name)
    if match:
        items = re.split(r",(?=[\w.+~/-]+=)", match.group(1))  # a comma inside a value is not a separator
    elif os.path.exists(os.path.join(run_dir, ".hydra", "overrides.yaml")):
        with open(os.path.join(run_dir, ".hydra", "overrides.yaml")) as f:
            items = yaml.safe_load(f) or []
    pairs = [str(item).lstrip("+~").split("=", 1) for item in items if "=" in str(item)]
    return {k: v for k, v in pairs if not k.startswith("hydra.")}


def _flatten(tree: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in tree.items():
        if isinstance(value, dict):
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def _settings(info: RunInfo, infos) -> dict:
    """A run's settings as `key -> text`: config.yaml where there is one, with a config group whose name
    differs between the runs as `algo=grpo` (its knobs left out); the overrides where there is none."""
    if not info.config:
        return dict(info.overrides)
    groups = {k[:-5] for k in info.config if k.endswith(".name")
              if len({str(j.config.get(k)) for j in infos}) > 1}
    out = {}
    for key, value in info.config.items():
        group = key.split(".")[0]
        key, value = (group, info.config.get(f"{group}.name")) if group in groups else (key, value)
        out[key] = json.dumps(value) if isinstance(value, bool) or value is None else str(value)
    return out


def _natural(path: str):
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path)]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description="Plot runs side by side and print a Markdown table.")
    parser.add_argument("dirs", nargs="+",
                        help="run dirs (with metrics.jsonl) or sweep dirs holding run dirs")
    parser.add_argument("-o", "--out",
                        help="output PNG (default: <first sweep dir>/sweep.png, else ./runs.png)")
    args = parser.parse_args(argv)
    try:
        runs = find_runs(args.dirs)
        sweeps = [d for d in args.dirs if os.path.normpath(d) not in runs]
        out = args.out or (os.path.join(sweeps[0], "sweep.png") if sweeps else "runs.png")
        table = compare(runs, out)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    print(table)
    print(f"\nwrote {out}", file=sys.stderr)


if __name__ == "__main__":
    main()
