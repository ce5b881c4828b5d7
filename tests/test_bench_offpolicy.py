"""bench/offpolicy.py's reading of runs: training clock without evaluation, seeds' spread, one table row per
point."""
import json
import os

import pytest

from bench import claims, offpolicy


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
    return [{"seed": seed, "figure": v} for seed, v in enumerate(values)]


def test_beats_holds_fails_or_asks_for_seeds_under_the_written_rule():
    """m - t.se > 0 holds; m + t.se < 0.05 does not hold; in between undecided, with the seeds that would
    decide it at this spread (t at 2 degrees of freedom 2.920, at 9 seeds 1.860)."""
    assert claims.beats([0.10, 0.12, 0.11])[0] == "holds"
    assert claims.beats([0.0, 0.01, -0.01])[0] == "does not hold"
    verdict, seen = claims.beats([0.10, -0.02, 0.04])  # m 0.04, sd 0.06: needs t.sd/sqrt(n) < 0.04
    assert verdict == "undecided" and "about 9 seeds would decide it" in seen
    assert claims.beats([0.02, 0.04, 0.03])[0] == "holds"  # small but sure: "holds" is read first


def test_claims_take_paired_differences_and_need_every_part():
    rules = ("ppo", "grpo", "rloo", "online_dpo", "tb", "tb_fifo")
    # every rival drops 0.2 at each seed, online DPO and TB none; naive PPO is 0.2 under decoupled at eta 8
    r = {**{(rule, 0): _runs(0.5, 0.4, 0.45) for rule in rules},
         **{(rule, 8): _runs(0.3, 0.2, 0.25) for rule in ("ppo", "grpo", "rloo", "tb_fifo")},
         ("online_dpo", 8): _runs(0.5, 0.4, 0.45), ("tb", 8): _runs(0.5, 0.4, 0.45),
         ("ppo_naive", 8): _runs(0.10, 0.01, 0.04)}
    lines = claims.claims(r)
    heads = [line for line in lines if not line.startswith(("    ", "drop of"))]
    assert heads == ["AReaL: decoupled PPO stays stable under staleness where naive PPO degrades: holds",
                     "Asynchronous RLHF: online DPO is the most robust to off-policy data: holds",
                     "TBA: trajectory balance with its replay stays robust far off-policy: holds"]
    assert "drop of tb_fifo, eta 0 -> 8: +0.200" in "\n".join(lines)
    # TB's replay makes no difference: one part does not hold, so the claim does not
    r[("tb_fifo", 8)] = _runs(0.5, 0.4, 0.45)
    assert "TBA: trajectory balance with its replay stays robust far off-policy: does not hold" in \
        claims.claims(r)
    # naive PPO's runs missing: AReaL's claim is left out, not judged on nothing
    del r[("ppo_naive", 8)]
    assert not any(line.startswith("AReaL") for line in claims.claims(r))


def test_etas_outside_the_grid_are_refused(monkeypatch, tmp_path):
    monkeypatch.setattr("sys.argv", ["offpolicy", "--etas", "0,3", "--report-only", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="--etas 0,3: choose from 0,8 .the claims grid's."):
        offpolicy.main()


def test_a_wider_grid_later_runs_only_the_missing_points(monkeypatch, tmp_path):
    for seed in (0, 1):  # eta 0 complete for both seeds, eta 8 for one
        for eta in (0, 8) if seed == 0 else (0,):
            folder = tmp_path / "ppo" / f"eta={eta},seed={seed}"
            folder.mkdir(parents=True)
            (folder / "summary.json").write_text(json.dumps({"status": "completed", "steps": 3}))
    calls = []
    monkeypatch.setattr(offpolicy.subprocess, "run", lambda cmd, **_: calls.append(cmd) or
                        type("Done", (), {"returncode": 0})())
    offpolicy.run_variant("ppo", ["algo=ppo"], (0, 8), [0, 1], 3, str(tmp_path), offpolicy.GRIDS["claims"][1])
    # eta 8 misses seed 1 alone: seed 0's run there is neither run again nor overwritten
    assert len(calls) == 1 and "max_staleness=8" in calls[0] and "task.terms=3" in calls[0]
    assert [arg for arg in calls[0] if arg.startswith("seed=")] == ["seed=1"]
    calls.clear()
    offpolicy.run_variant("ppo", ["algo=ppo"], (0, 8), [0, 1, 2], 3, str(tmp_path), [])  # a third seed
    assert sorted((c[3], c[4]) for c in calls) == [("max_staleness=0", "seed=2"),
                                                   ("max_staleness=8", "seed=1,2")]
    calls.clear()
    offpolicy.run_variant("ppo", ["algo=ppo"], (0,), [0, 1], 3, str(tmp_path), [])
    assert calls == []


def test_report_only_reads_the_runs_that_completed_and_unknown_rules_are_refused(monkeypatch, tmp_path,
                                                                                  capsys):
    for eta, seed, done in ((0, 0, True), (0, 1, True), (8, 0, True), (8, 1, False)):
        folder = tmp_path / "ppo" / f"eta={eta},seed={seed}"
        _run(folder, [0.1, 0.2, 0.3], seed_shift=0.1 * seed)
        (folder / "summary.json").write_text(json.dumps({"status": "completed" if done else "error",
                                                         "steps": 3}))
    monkeypatch.setattr("sys.argv", ["offpolicy", "--report-only", "--steps", "3", "--seeds", "0,1",
                                     "--rules", "ppo", "--out", str(tmp_path)])
    offpolicy.main()
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ppo |")]
    # eta 8's second seed stopped part way: one seed read there, both at eta 0
    assert rows[0].endswith("| 2 |") and rows[1].endswith("| 1 |") and len(rows) == 2
    monkeypatch.setattr("sys.argv", ["offpolicy", "--report-only", "--rules", "ppo,sac",
                                     "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="--rules ppo,sac: sac not in the claims grid"):
        offpolicy.main()


def test_report_only_with_no_completed_run_says_so(monkeypatch, tmp_path):
    monkeypatch.setattr("sys.argv", ["offpolicy", "--grid", "rules", "--report-only", "--out", str(tmp_path)])
    with pytest.raises(SystemExit, match="no completed run of the rules grid in .*; run it without"):
        offpolicy.main()
