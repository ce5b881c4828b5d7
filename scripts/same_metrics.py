"""Do two runs give the same metrics? The check a refactor passes: a fixed-seed `max_staleness=0` run before
and after the change must agree on every value but the wall-clock ones.

    python scripts/same_metrics.py RUN_DIR_BEFORE RUN_DIR_AFTER [--added KEY,...]

Compares metrics.jsonl row by row and summary.json, leaving out the clock and memory figures
(`time_s`, `perf/*_s`, `*_per_s`, `perf/learner_mfu`; the summary's `wall_s`, `time_to_reward_*`, `peak_*`).
Prints each differing value (the first 30) and a last line `same: <rows> rows, <keys> keys a row` or
`differ: <n> values`; exit code 0 when they agree, 1 when they do not. `--added` names metrics the change
adds: absent from every row before, they are left out of the comparison (a row that had them before still
compares them).
"""
import json
import os
import sys


def timed(key: str) -> bool:
    """Wall-clock and memory figures: they differ between any two runs."""
    key = key.removeprefix("summary/")
    return (key in ("time_s", "wall_s") or key.endswith("_per_s")
            or key.startswith(("time_to_reward", "policy_time_to_reward", "peak_"))
            or (key.startswith("perf/") and key.endswith("_s")) or key == "perf/learner_mfu")


def differences(before: list[dict], after: list[dict], added: frozenset = frozenset()) -> list[str]:
    out = [f"rows: {len(before)} != {len(after)}"] if len(before) != len(after) else []
    for i, (a, b) in enumerate(zip(before, after)):
        for key in sorted(set(a) | set(b)):
            if key in added and key not in a:
                continue
            if not timed(key) and a.get(key) != b.get(key):
                out.append(f"row {i} {key}: {a.get(key)!r} != {b.get(key)!r}")
    return out


def _rows(run_dir: str) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    summary = os.path.join(run_dir, "summary.json")
    if os.path.exists(summary):
        with open(summary) as f:
            rows.append({f"summary/{k}": v for k, v in json.load(f).items()})
    return rows


def main(argv: list[str]) -> int:
    added = frozenset()
    if len(argv) == 4 and argv[2] == "--added":
        added, argv = frozenset(argv[3].split(",")), argv[:2]
    if len(argv) != 2:
        print("usage: python scripts/same_metrics.py RUN_DIR_BEFORE RUN_DIR_AFTER [--added KEY,...]",
              file=sys.stderr)
        return 2
    before, after = _rows(argv[0]), _rows(argv[1])
    found = differences(before, after, added)
    for line in found[:30]:
        print(line)
    if found:
        print(f"differ: {len(found)} values")
        return 1
    keys = sum(not timed(k) for k in before[0]) if before else 0
    print(f"same: {len(before)} rows, {keys} keys a row")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
