"""Time to reward (launch/summary.py): the first time a 3-step moving average of reward_mean reaches a bar."""
import json

from launch.summary import policy_time_to_reward, time_to_reward, write_summary


def _rows(rewards):
    return [{"step": i + 1, "time_s": 10.0 * (i + 1), "reward_mean": r} for i, r in enumerate(rewards)]


def test_the_moving_average_not_one_lucky_step_counts():
    rows = _rows([0.2, 0.95, 0.3, 0.75, 0.8, 0.9, 1.0])
    assert time_to_reward(rows, 0.8) == (60.0, 6)  # (0.75 + 0.8 + 0.9) / 3; step 2's 0.95 alone is not enough
    assert time_to_reward(rows, 0.85) == (70.0, 7)
    assert time_to_reward(rows, 0.95) is None
    assert time_to_reward(_rows([1.0, 1.0]), 0.5) is None  # fewer steps than the window


def test_the_policy_is_dated_by_the_version_that_sampled_the_window():
    rows = _rows([0.2, 0.5, 0.8, 0.9, 0.9])  # synchronous: step s trains on version s - 1's samples
    assert time_to_reward(rows, 0.8) == (50.0, 5)
    assert policy_time_to_reward(rows, 0.8) == (40.0, 4.0)  # version 4, published at step 4's 40 s
    for row in rows:  # the same rewards sampled two versions earlier (max_staleness 2, lag 2 at every step)
        row["staleness_mean"] = 2.0
    assert policy_time_to_reward(rows, 0.8) == (20.0, 2.0)
    rows[-1]["staleness_mean"] = 1.5  # the window's newest version, 5 - 1 - 1.5, between steps 2 and 3
    assert policy_time_to_reward(rows, 0.8) == (25.0, 2.5)
    for row in rows[:3]:
        row["staleness_mean"] = 4.0  # versions before the first are version 0, published at the start
    assert policy_time_to_reward(rows[:3], 0.5) == (0.0, 0.0)
    assert policy_time_to_reward(rows, 0.95) is None


def test_summary_json_holds_it(tmp_path):
    with open(tmp_path / "metrics.jsonl", "w") as f:
        for row in _rows([0.5, 0.8, 0.9, 0.9, 0.1]):
            f.write(json.dumps(row) + "\n")
    write_summary(str(tmp_path), 0.0, None, 1.0)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert (summary["time_to_reward_0.8"], summary["step_to_reward_0.8"]) == (40.0, 4)
    assert summary["time_to_reward_0.9"] is None and summary["step_to_reward_0.9"] is None
    assert summary["policy_time_to_reward_0.8"] == 30.0
