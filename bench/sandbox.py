"""The sandbox's cost: programs scored per second by the reward pool, sandboxed against not, in the same run.

    python -m bench.sandbox [--programs 200] [--workers 2] [--reps 3]

The programs are what an MBPP-like run scores: a mix of right and wrong solutions of small function problems
(three asserts, one sandboxed run each) and stdin/stdout problems (two cases, a run each), plus 1 in 20 that
raises. Each rep scores them all through `RewardPool("code")`, first with `isolate=False` (the same runner and
limits in a plain subprocess, no container: the baseline, never used for model output) and then sandboxed;
the median rep counts. Ends with `sandboxed_vs_plain=<programs/s sandboxed / programs/s plain>` and
`sandbox_ms_per_run=<the extra wall-clock per run, over the pool's workers>`.
"""
import argparse
import json
import statistics
import time

from rewards.pool import RewardPool

FENCE = "```"


def programs(n: int) -> tuple[list[str], list[str], int]:
    """(replies, references, sandboxed runs they take)."""
    replies, references, runs = [], [], 0
    for i in range(n):
        right = i % 2 == 0
        if i % 20 == 19:
            body, ref = "raise ValueError('no idea')", {"tests": ["assert add(1, 2) == 3"]}
            runs += 1
        elif i % 4 < 2:
            op = "+" if right else "-"
            body = f"def add(a, b):\n    return a {op} b"
            ref = {"tests": ["assert add(1, 2) == 3", "assert add(0, 0) == 0",
                             f"assert add({i}, 1) == {i + 1}"]}
            runs += 1
        else:
            body = ("import sys\nprint(sum(int(x) for x in sys.stdin.read().split())"
                    + (")" if right else " + 1)"))
            ref = {"inputs": ["1 2\n", f"{i} 1\n"], "outputs": ["3\n", f"{i + 1}\n"]}
            runs += 2
        replies.append(f"Solution:\n{FENCE}python\n{body}\n{FENCE}\n")
        references.append(json.dumps(ref))
    return replies, references, runs


def rate(isolate: bool, workers: int, replies: list[str], references: list[str]) -> float:
    options = dict(isolate=isolate, timeout_s=5.0, program_timeout_s=20.0)
    with RewardPool("code", workers=workers, timeout_s=30.0, options=options) as pool:
        # workers started, interpreter files cached
        pool.score(replies[:workers * 2], references[:workers * 2])
        start = time.perf_counter()
        scores = pool.score(replies, references)
        seconds = time.perf_counter() - start
    if (pool.timeouts, pool.errors) != (0, 0):
        raise SystemExit(f"error: the pool timed out {pool.timeouts} and failed {pool.errors} times")
    expected = sum(1 for i in range(len(replies)) if i % 2 == 0 and i % 20 != 19)
    if sum(scores) != expected:
        raise SystemExit(f"error: {sum(scores)} programs passed, {expected} should have")
    return len(replies) / seconds


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--programs", type=int, default=200)
    parser.add_argument("--workers", type=int, default=2, help="reward pool workers (one per core here)")
    parser.add_argument("--reps", type=int, default=3)
    args = parser.parse_args()
    replies, references, runs = programs(args.programs)
    plain, boxed = [], []
    for _ in range(args.reps):
        plain.append(rate(False, args.workers, replies, references))
        boxed.append(rate(True, args.workers, replies, references))
    plain_rate, boxed_rate = statistics.median(plain), statistics.median(boxed)
    per_run_ms = (args.programs / boxed_rate - args.programs / plain_rate) / runs * args.workers * 1000
    print(f"{args.programs} programs ({runs} runs), reward pool with {args.workers} workers, "
          f"median of {args.reps}")
    print(f"plain subprocess: {plain_rate:.1f} programs/s ({', '.join(f'{r:.1f}' for r in plain)})")
    print(f"sandboxed:        {boxed_rate:.1f} programs/s ({', '.join(f'{r:.1f}' for r in boxed)})")
    print(f"sandboxed_vs_plain={boxed_rate / plain_rate:.2f}")
    print(f"sandbox_ms_per_run={per_run_ms:.1f}")


if __name__ == "__main__":
    main()
