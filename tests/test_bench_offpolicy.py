"""bench/offpolicy.py's reading of runs: training clock without evaluation, seeds' spread, one table row per
point."""
import json
import os

import pytest

from bench import offpolicy


def _run(path, rewards, eval_s=5.0, seed_shift=0.0):
    os.makedirs(path)
    rows = []
    for i, r in enumerate(rewards, 1):
        row = {"step": i, "time_s": 10.0 * i + (eval_s if i >= 2 else 0.0), "reward_mean": r + seed_shift,
               "staleness_mean": 1.0, "staleness/dropped_groups": 1, "policy/entropy": 2.0,
               "offpolicy/ess": 0.9}
        if i == 2:
            row.update({"perf/eval_s": eval_s, "eval_pass@1": 0.5 + seed_shift})
        rows.append(row)
    with open(os.path.join(path, "metrics.jsonl"), "w") as f:
        f.write("\n".join(json.dumps(r) for r in rows) + "\n")


def test_load_takes_evaluation_out_of_the_clock(tmp_path):
    _run(tmp_path / "a", [0.1, 0.2, 0.3])
    run = offpolicy.load(str(tmp_path / "a"))
    assert run["clock"] == [10.0, 20.0, 30.0]  # 5 s of evaluation after step 2 removed from steps 2 and 3
    assert run["tests"] == [(20.0, 0.5)] and run["pass@1"] == 0.5
    assert run["reward_last_third"] == pytest.approx(0.3) and run["dropped"] == 3
    assert run["offpolicy_kl"] is None and run["ess"] == pytest.approx(0.9)


def test_table_and_plot_show_the_seeds_spread(tmp_path):
    runs = []
    for seed, shift in enumerate((0.0, 0.2)):
        _run(tmp_path / f"s{seed}", [0.1, 0.2, 0.3], seed_shift=shift)
        runs.append(offpolicy.load(str(tmp_path / f"s{seed}")))
    results = {("ppo", 0): runs, ("ppo_m4", 2): runs}
    text = offpolicy.table(results)
    assert "| ppo | 0 | 0.40 ± 0.10 | 0.60 ± 0.10 |" in text and "| ppo_m4 | 2 |" in text
    offpolicy.plot(results, str(tmp_path / "p.png"))
    assert (tmp_path / "p.png").stat().st_size > 10_000


def _runs(*values):
    return [{"pass@1": v} for v in values]


def test_claims_are_judged_against_the_seeds_spread():
    results = {("ppo", 0): _runs(0.9, 0.9, 0.9), ("ppo", 8): _runs(0.80, 0.78, 0.82),
               # decoupled beats naive by far more than the spreads
               ("ppo_naive", 8): _runs(0.40, 0.45, 0.42),
               # drops
               ("online_dpo", 0): _runs(0.90, 0.92, 0.91), ("online_dpo", 8): _runs(0.60, 0.62, 0.61),
               # within a wide spread
               ("tb", 0): _runs(0.5, 0.9, 0.7), ("tb", 8): _runs(0.6, 0.7, 0.8)}
    lines = offpolicy.claims(results)
    assert [line.split(": ")[0] for line in lines] == ["AReaL", "Asynchronous RLHF", "TBA"]
    assert ": reproduced (" in lines[0] and ": not reproduced (" in lines[1] \
        and ": not distinguishable (" in lines[2]
    results[("ppo_naive", 8)] = _runs(0.78, 0.80, 0.82)
    results[("tb", 0)], results[("tb", 8)] = _runs(0.72, 0.70, 0.71), _runs(0.68, 0.70, 0.72)  # no drop
    lines = offpolicy.claims(results)
    assert ": not distinguishable (" in lines[0] and ": reproduced (" in lines[2]


def test_etas_outside_the_grid_are_refused(monkeypatch, tmp_path):
    monkeypatch.setattr("sys.argv", ["offpolicy", "--etas", "0,3", "--report-only", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="--etas 0,3: choose from 0,2,8"):
        offpolicy.main()


def test_a_wider_grid_later_runs_only_the_missing_columns(monkeypatch, tmp_path):
    for seed in (0, 1):  # eta 0 complete for both seeds, eta 8 for one
        for eta in (0, 8) if seed == 0 else (0,):
            folder = tmp_path / "ppo" / f"eta={eta},seed={seed}"
            folder.mkdir(parents=True)
            (folder / "summary.json").write_text(json.dumps({"status": "completed", "steps": 3}))
    calls = []
    monkeypatch.setattr(offpolicy.subprocess, "run", lambda cmd, **_: calls.append(cmd) or
                        type("Done", (), {"returncode": 0})())
    offpolicy.run_variant("ppo", ["algo=ppo"], (0, 8), [0, 1], 3, str(tmp_path))
    assert len(calls) == 1 and "max_staleness=8" in calls[0]
    calls.clear()
    offpolicy.run_variant("ppo", ["algo=ppo"], (0,), [0, 1], 3, str(tmp_path))
    assert calls == []
