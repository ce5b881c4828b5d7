"""scripts/same_metrics.py: the before/after check of a refactor sees a changed value and ignores the
clock."""
import json
import subprocess
import sys

ROOT = __file__.rsplit("/tests/", 1)[0]


def _run(tmp_path, name, rows, summary):
    run = tmp_path / name
    run.mkdir()
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    (run / "summary.json").write_text(json.dumps(summary))
    return str(run)


def _compare(a, b, *extra):
    return subprocess.run([sys.executable, "scripts/same_metrics.py", a, b, *extra], cwd=ROOT,
                          capture_output=True, text=True)


def test_only_the_clock_and_memory_may_differ(tmp_path):
    rows = [{"step": 1, "loss": 0.5, "time_s": 1.0, "perf/train_step_s": 0.3, "gen_tokens_per_s": 9.0,
             "perf/learner_mfu": 0.2}]
    summary = {"steps": 1, "wall_s": 3.0, "peak_memory_mb": 10, "time_to_reward_0.8": None}
    before = _run(tmp_path, "before", rows, summary)
    clock = [dict(rows[0], time_s=2.0,
                  **{"perf/train_step_s": 0.4, "gen_tokens_per_s": 8.0, "perf/learner_mfu": 0.1})]
    after = _run(tmp_path, "after", clock, dict(summary, wall_s=4.0, peak_memory_mb=12))
    same = _compare(before, after)
    assert same.returncode == 0 and same.stdout.strip().endswith("same: 2 rows, 2 keys a row"), same.stdout

    changed = _run(tmp_path, "changed", [dict(rows[0], loss=0.50001)], summary)
    differ = _compare(before, changed)
    assert differ.returncode == 1
    assert "row 0 loss: 0.5 != 0.50001" in differ.stdout \
        and differ.stdout.strip().endswith("differ: 1 values")

    shorter = _run(tmp_path, "shorter", [], summary)
    assert _compare(before, shorter).returncode == 1


def test_a_metric_the_change_adds_is_left_out_only_when_named(tmp_path):
    rows = [{"step": 1, "loss": 0.5}]
    before = _run(tmp_path, "before", rows, {"steps": 1})
    after = _run(tmp_path, "after", [dict(rows[0], **{"train/new": 0})], {"steps": 1})
    assert _compare(before, after).returncode == 1  # not named: a difference
    named = _compare(before, after, "--added", "train/new,other")
    assert named.returncode == 0 and named.stdout.strip().endswith("same: 2 rows, 2 keys a row"), named.stdout
    had = _run(tmp_path, "had", [dict(rows[0], **{"train/new": 1})], {"steps": 1})
    assert _compare(had, after, "--added", "train/new").returncode == 1  # present before: still compared
