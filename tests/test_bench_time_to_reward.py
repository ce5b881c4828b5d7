"""bench/time_to_reward.py's reading of runs: time to a 3-step mean reward, the table, the plot, the
folders."""
import json
import os

import pytest

from bench import time_to_reward as ttr


def _run(path, rewards):
    os.makedirs(path)
    rows = [{"step": i, "time_s": 10.0 * i, "reward_mean": r, "perf/train_step_s": 6.0, "perf/wait_s": 4.0,
             "perf/train_threads": 2} for i, r in enumerate(rewards, 1)]
    rows[-1]["eval_pass@1"] = 0.75
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        f.write("\n".join(json.dumps(r) for r in rows) + "\n")


def test_load_table_and_plot(tmp_path):
    _run(tmp_path / "a", [0.3, 0.8, 0.85, 0.9, 1.0])
    _run(tmp_path / "b", [0.3, 0.3, 0.3])
    a, b = ttr.load(str(tmp_path / "a")), ttr.load(str(tmp_path / "b"))
    assert (a[0.8], a[0.9], a["s_per_step"], a["pass@1"]) == (40.0, 50.0, 10.0, 0.75)
    assert b[0.8] is None
    text = ttr.table({"before": b, "tb_eta0": a})
    assert "| tb_eta0 | 40 | 50 | 10.0 | 6.0 | 4.0 | 2.0 | 0.75 |" in text \
        and "| before | never | never |" in text
    ttr.plot({"before": b, "tb_eta0": a}, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 10_000


def test_settings_name_the_folders_hydra_writes(tmp_path):
    sweep = ttr.settings(str(tmp_path), sweep=True)
    # ${train.lr} is 5e-05
    assert sweep["grpo_lr5e-5"] == os.path.join(str(tmp_path), "sweep", "grpo_lr5e-05")
    grid = ttr.settings(str(tmp_path), sweep=False)
    assert {"before", "tb_eta0", "grpo_eta1", "tb_eta1_slowgen"} <= set(grid)


def test_the_seeds_mode_reads_medians_ranges_and_the_first_steps_tax(tmp_path):
    def seed_run(name, times, rewards):
        path = tmp_path / name
        os.makedirs(path)
        rows = [{"step": i, "time_s": t, "reward_mean": r} for i, (t, r) in enumerate(zip(times, rewards), 1)]
        rows[-1]["eval_pass@1"] = rewards[-1]
        (path / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
        return ttr.load_seed(str(path))

    flat = [0.5, 0.9, 0.9, 0.9, 0.9, 0.9]
    a = seed_run("a", [30, 40, 50, 60, 70, 80], flat)  # step 1 took 30 s, steady steps 10 s
    # (0.5 + 0.9 + 0.9) / 3 < 0.8 at step 3
    assert (a["time"], a["steps"], a["step1_over_steady"]) == (60, 4, 3.0)
    b = seed_run("b", [10, 20, 30, 40, 50, 60], [0.1] * 6)  # never reaches 0.8
    c = seed_run("c", [10, 20, 30, 40, 50, 60], flat)
    text, figures = ttr.seeds_table({"now": [a, b, c], "baseline": [b, b, c]})
    assert "| now | 3 | 60 (40-60, 1 never) | 4 (4-4, 1 never) |" in text
    assert text.split("\n")[2].endswith("| 0.90 (0.10-0.90) |")  # the test pass@1 of a, b, c: 0.9, 0.1, 0.9
    assert "now_time_to_0.8=60" in figures and "baseline_time_to_0.8=never" in figures
    assert "now_step1_over_steady=1.00" in figures  # the median of 3.0, 1.0, 1.0
    assert "now_vs_baseline=never" in figures


def test_the_steady_step_is_one_that_trained_as_many_groups_as_step_1():
    # step 1 trained all 4 groups; from step 4 on, steps with 3 tied groups skipped are cheap
    tied = [0, 0, 0, 3, 3, 0, 3, 0, 3]
    steps = [3.0, 3.2, 3.1, 1.0, 1.1, 3.4, 1.0, 3.0, 1.2]
    rows = [{"train/tied_groups_skipped": t} for t in tied]
    # the median of steps 6 and 8 (3.4, 3.0), not of all six from step 4
    assert ttr.steady_step(rows, steps) == 3.2
    rows[0]["train/tied_groups_skipped"] = 2  # no later step like step 1: all of steps 4 on
    assert ttr.steady_step(rows, steps) == 1.15
    # runs from before the metric: steps 4 on
    assert ttr.steady_step([{}] * 5, [5.0, 2.0, 2.0, 1.0, 3.0]) == 2.0


def test_vary_needs_a_name_and_overrides():
    assert ttr.parse_vary(["lr4=train.lr=4e-5 train.grad_clip=1"]) \
        == {"lr4": ["train.lr=4e-5", "train.grad_clip=1"]}
    for bad in (["train.lr"], ["now=train.lr=1"], ["x=a=1", "x=b=2"]):
        with pytest.raises(SystemExit, match="--vary"):
            ttr.parse_vary(bad)
