"""bench/time_to_reward.py's reading of runs: time to a 3-step mean reward, the table, the plot, the folders."""
import json
import os

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
    assert "| tb_eta0 | 40 | 50 | 10.0 | 6.0 | 4.0 | 2.0 | 0.75 |" in text and "| before | never | never |" in text
    ttr.plot({"before": b, "tb_eta0": a}, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 10_000


def test_settings_name_the_folders_hydra_writes(tmp_path):
    sweep = ttr.settings(str(tmp_path), sweep=True)
    assert sweep["grpo_lr5e-5"] == os.path.join(str(tmp_path), "sweep", "grpo_lr5e-05")  # ${train.lr} is 5e-05
    grid = ttr.settings(str(tmp_path), sweep=False)
    assert {"before", "tb_eta0", "grpo_eta1", "tb_eta1_slowgen"} <= set(grid)
