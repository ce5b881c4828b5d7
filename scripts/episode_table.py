"""Before and after, for multi-turn runs: the episodes' success rate and tool calls per episode over the first
and the last `--window` steps of each run, from its metrics.jsonl (the workers' counters, differenced per
step).

    python scripts/episode_table.py outputs/a outputs/b ... [--window 3]
"""
import argparse
import json
import os


def rates(rows: list[dict]) -> list[tuple[float, float, float]]:
    """Per step: (success rate, valid tool calls per episode, malformed calls per episode) of the episodes
    that ended since the previous row."""
    out, last = [], {}
    for row in rows:
        delta = {k: row.get(f"episode/{k}", 0) - last.get(k, 0) for k in
                 ("episodes", "successes", "tool_calls", "tool_errors", "parse_errors", "unknown_tools")}
        last = {k: row.get(f"episode/{k}", 0) for k in delta}
        n = max(delta["episodes"], 1)
        out.append((delta["successes"] / n, (delta["tool_calls"] - delta["tool_errors"]) / n,
                    (delta["parse_errors"] + delta["unknown_tools"]) / n))
    return out


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("runs", nargs="+")
    parser.add_argument("--window", type=int, default=3)
    args = parser.parse_args()
    w = args.window
    print(f"| run | steps | success, first {w} | success, last {w} | valid calls/episode, first {w} | "
          f"last {w} | malformed calls/episode, first {w} | last {w} |")
    print("| --- " * 8 + "|")
    for run in args.runs:
        with open(os.path.join(run, "metrics.jsonl")) as f:
            rows = [json.loads(line) for line in f]
        r = rates(rows)

        def mean(part, i):
            return sum(x[i] for x in part) / len(part)

        first, last = r[:w], r[-w:]
        print(f"| {run} | {len(rows)} | {mean(first, 0):.2f} | {mean(last, 0):.2f} | {mean(first, 1):.2f} | "
              f"{mean(last, 1):.2f} | {mean(first, 2):.2f} | {mean(last, 2):.2f} |")


if __name__ == "__main__":
    main()
