"""plot.py on synthetic run dirs laid out as train.py and Hydra multirun write them."""
import json
import os
import subprocess
import sys

import pytest
from omegaconf import OmegaConf

import plot
from launch.config import compose
from tests.helpers import ROOT

STEPS = 8


def _config(**changes) -> dict:
    """The resolved config as train.py writes it (the default composition, no hydra key), with `changes`."""
    cfg = OmegaConf.to_container(compose([]), resolve=True)
    for key, value in changes.items():
        node = cfg
        *parents, leaf = key.split(".")
        for p in parents:
            node = node[p]
        node[leaf] = value
    return cfg


def _rows(eta: int, evals: bool) -> list[dict]:
    rows = []
    for step in range(1, STEPS + 1):
        row = {"step": step, "time_s": 10.0 * step / (eta + 1), "reward_mean": 0.1 * step + 0.01 * eta,
               "loss": 1.0 / step, "staleness_mean": min(step - 1, eta) / 2,
               "staleness_max": min(step - 1, eta),
               "gen_tokens_per_s": 100.0 * (eta + 1) + step, "train_tokens_per_s": 50.0 + step,
               "reward/batch_mean": 0.5, "perf/train_step_s": 1.0, "grpo/clip_frac": 0.0}
        if evals and step % 4 == 0:
            row.update({"eval_pass@1": 0.2 * step / 4 + 0.05 * eta, "eval_pass@k": 0.9,
                        "eval_sample_reward": 0.4})
        rows.append(row)
    return rows


def _write_run(run_dir, rows, config) -> str:
    os.makedirs(run_dir, exist_ok=True)
    with open(os.path.join(run_dir, "config.yaml"), "w") as f:
        f.write(OmegaConf.to_yaml(config))
    with open(os.path.join(run_dir, "metrics.jsonl"), "w") as f:
        f.writelines(json.dumps(r) + "\n" for r in rows)
    return str(run_dir)


@pytest.fixture
def sweep(tmp_path):
    """`python train.py -m max_staleness=0,2`: run 0 evaluates at steps 4 and 8, run 1 never does."""
    root = tmp_path / "multirun"
    for n, eta in enumerate((0, 2)):
        _write_run(root / f"{n}_max_staleness={eta}", _rows(eta, evals=eta == 0), _config(max_staleness=eta))
    (root / "multirun.yaml").write_text("hydra:\n  mode: MULTIRUN\n")
    # a run's own subfolders are not runs, even with a config.yaml inside (W&B writes one)
    os.makedirs(root / "0_max_staleness=0" / "wandb" / "files")
    (root / "0_max_staleness=0" / "wandb" / "files" / "config.yaml").write_text("a: 1\n")
    return str(root)


def _table(text: str) -> list[list[str]]:
    lines = [line for line in text.splitlines() if line.startswith("|")]
    return [[c.strip() for c in line.strip("|").split("|")] for line in lines[2:]]


def _check_png(path, min_size=(800, 400)):
    from PIL import Image

    with open(path, "rb") as f:
        assert f.read(8) == b"\x89PNG\r\n\x1a\n", f"{path} is not a PNG"
    with Image.open(path) as image:
        image.verify()
    with Image.open(path) as image:
        assert image.size[0] >= min_size[0] and image.size[1] >= min_size[1], image.size
        lo, hi = image.convert("L").getextrema()
        assert hi - lo > 100, "the image is blank"


def test_cli_on_a_sweep_draws_one_png_and_prints_the_table(sweep):
    result = subprocess.run([sys.executable, os.path.join(ROOT, "plot.py"), sweep], capture_output=True,
                            text=True, timeout=120, cwd=ROOT)
    assert result.returncode == 0, result.stderr
    _check_png(os.path.join(sweep, "sweep.png"))
    assert "last 25% of steps" in result.stdout
    rows = _table(result.stdout)
    assert [r[0] for r in rows] == ["max_staleness=0", "max_staleness=2"]
    for row, eta in zip(rows, (0, 2)):
        assert row[1] == str(STEPS)
        last_quarter = [0.1 * s + 0.01 * eta for s in (7, 8)]  # 8 steps -> the last 2
        assert float(row[2]) == pytest.approx(sum(last_quarter) / 2, abs=1e-3)
        assert float(row[4]) == pytest.approx(10.0 * STEPS / (eta + 1), rel=5e-3)
        assert float(row[5]) == pytest.approx(100.0 * (eta + 1) + 4.5, rel=5e-3)
        assert float(row[6]) == pytest.approx(54.5, rel=5e-3)
        assert float(row[7]) == pytest.approx(sum(min(s - 1, eta) / 2 for s in range(1, 9)) / 8, rel=5e-3)
    assert float(rows[0][3]) == pytest.approx(0.4)  # best eval_pass@1: step 8
    assert rows[1][3] == "-"  # never evaluated


def test_compare_explicit_runs_and_output_path(sweep, tmp_path):
    runs = plot.find_runs([sweep])
    assert [os.path.basename(r) for r in runs] == ["0_max_staleness=0", "1_max_staleness=2"]
    out = str(tmp_path / "both.png")
    table = plot.compare(runs, out)
    _check_png(out)
    assert len(_table(table)) == 2


def test_every_run_gets_curves_png(sweep):
    for run in plot.find_runs([sweep]):
        assert plot.run_curves(run) == os.path.join(run, "curves.png")
        _check_png(os.path.join(run, "curves.png"))


def test_one_row_and_empty_runs(tmp_path):
    one = _write_run(tmp_path / "one", _rows(1, evals=False)[:1], _config(seed=1))
    empty = _write_run(tmp_path / "empty", [], _config(seed=2))
    _check_png(plot.run_curves(one))
    assert plot.run_curves(empty) is None
    table = plot.compare(plot.find_runs([one, empty]), str(tmp_path / "runs.png"))
    rows = _table(table)
    assert [r[0] for r in rows] == ["seed=1"] and rows[0][1] == "1"
    assert float(rows[0][2]) == pytest.approx(0.11)  # the single row is the last quarter
    assert "skipped (no rows in metrics.jsonl): seed=2" in table
    with pytest.raises(ValueError, match="no metrics rows"):
        plot.compare([empty], str(tmp_path / "none.png"))


def test_labels_from_config_when_dir_names_say_nothing(tmp_path):
    a = _write_run(tmp_path / "10-00-00", _rows(0, True), _config())
    b = _write_run(tmp_path / "11-00-00", _rows(0, True), _config(**{"train.lr": 1e-5}))
    c = _write_run(tmp_path / "12-00-00", _rows(0, True), _config(algo={"name": "grpo", "clip": 0.2}))
    infos = [plot.load_run(d)[0] for d in (a, b, c)]
    assert plot.labels(infos) == [
        "train.lr=2.5e-05, algo=ppo", "train.lr=1e-05, algo=ppo", "train.lr=2.5e-05, algo=grpo"]
    same = _write_run(tmp_path / "13-00-00", _rows(0, True), _config())
    assert plot.labels([plot.load_run(d)[0] for d in (a, same)]) == ["10-00-00", "13-00-00"]


def test_labels_across_sweeps_fill_in_unswept_values(tmp_path):
    a = _write_run(tmp_path / "s1" / "0_max_staleness=0", _rows(0, False), _config(max_staleness=0))
    b = _write_run(tmp_path / "s2" / "0_algo=grpo,max_staleness=0", _rows(0, False),
                   _config(max_staleness=0, algo={"name": "grpo"}))
    infos = [plot.load_run(d)[0] for d in (a, b)]
    assert plot.labels(infos) == ["algo=ppo", "algo=grpo"]


def test_load_run_skips_a_line_cut_short(tmp_path):
    run = _write_run(tmp_path / "run", _rows(0, False)[:3], _config())
    with open(os.path.join(run, "metrics.jsonl"), "a") as f:
        f.write('{"step": 4, "rew')
    info, rows = plot.load_run(run)
    assert [r["step"] for r in rows] == [1, 2, 3] and info.name == "run"


def test_find_runs_refuses_a_dir_without_runs(tmp_path):
    with pytest.raises(ValueError, match="no run under"):
        plot.find_runs([str(tmp_path)])
