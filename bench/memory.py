"""Peak memory of the long-completion run, `python train.py algo=tb task=gsm8k`, and where it goes.

    python -m bench.memory [--baseline 5ca73ac] [--path gsm8k.jsonl] [--steps 3]
                           [--vary 'name=key=value ...' ...]

Each setting is a whole `train.py algo=tb task=gsm8k steps=3` run in its own process tree, on this machine:
  - `before`: the same command from a git worktree of `--baseline` (default 5ca73ac, the commit before issue
    32's memory work: no activation checkpointing, the dense [L, L] attention, 64 engine slots); `now`: the
    command as it runs today; and each `--vary` setting (`now` with those overrides).
  - `--path`: a local copy of GSM8K (a JSONL file in its format). Without it, a GSM8K-shaped file is written
    under --out: templated grade-school word problems of GSM8K's length with '#### <n>' answers. Memory
    depends on the shape of the work (prompts of ~60 tokens, completions of up to rollout.max_new_tokens=512),
    not on the questions' wording.
Per setting: the run's peak (summary.json's `peak_memory_mb`: proportional set size summed over every process,
shared memory counted once), its split by process at that moment (`peak_memory_by_process_mb`), the s/step of
steps 2 on, and the mean completion length. Then what the processes hold by construction, from the model's
shapes: the trainer's fp32 policy, gradients, AdamW moments and tb's frozen reference; a rollout worker's
engine weights and KV cache (rollout.max_batch slots of the longest prompt + max_new_tokens); the remainder of
the trainer's share is its step's activations and the allocator's. Ends with `<setting>_peak_mb=` lines and
`memory_now_vs_before=<ratio>`.
"""
import argparse
import json
import os
import random
from functools import partial

from bench.common import baseline_tree, train_run
from bench.common import parse_vary as common_parse_vary
from buffer.staleness import engine_slots

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASELINE = "5ca73ac"  # the commit before issue 32
COMMON = ["algo=tb", "task=gsm8k", "eval.every=0", "eval.k=1", "task.max_test=8", "progress=false",
          "checkpoint.at_end=false"]
NAMES = ("Natalia", "Weng", "Betty", "Julie", "James", "Mark", "Albert", "Ken", "Alexis", "Tina", "Randy",
         "Joy")
ITEMS = ("clips", "apples", "pencils", "stickers", "cupcakes", "marbles", "books", "tickets")


def write_gsm8k_like(path: str, count: int = 400, seed: int = 0) -> None:
    """GSM8K's format and about its question length (45-50 words): two-step word problems with their
    answers."""
    rng = random.Random(seed)
    with open(path, "w") as f:
        for _ in range(count):
            name, item = rng.choice(NAMES), rng.choice(ITEMS)
            a, b, price = rng.randint(12, 90), rng.randint(2, 6), rng.randint(2, 9)
            question = (f"{name} sold {a} {item} to her friends in April, and then she sold {b} times as "
                        f"many {item} in May as she did in April. Each of the {item} costs ${price}, and "
                        f"{name} keeps all of the money she makes. How many dollars did {name} make from "
                        f"selling {item} in April and May altogether?")
            total = (a + a * b) * price
            answer = (f"In May she sold {a} * {b} = {a * b} {item}. Altogether she sold {a} + {a * b} = "
                      f"{a + a * b} {item}, for {a + a * b} * {price} = {total} dollars.\n#### {total}")
            f.write(json.dumps({"question": question, "answer": answer}) + "\n")


def run(folder: str, overrides: list[str], data: str, steps: int, root: str = ROOT) -> None:
    """One setting's run, from the source tree `root` (a baseline's worktree, or this one)."""
    train_run(folder, [*COMMON, f"task.path={data}", *overrides], steps, root)


def read(folder: str) -> dict:
    with open(os.path.join(folder, "summary.json")) as f:
        summary = json.load(f)
    with open(os.path.join(folder, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    times = [b["time_s"] - a["time_s"] for a, b in zip(rows, rows[1:])] or [rows[-1]["time_s"]]
    return {"peak": summary["peak_memory_mb"], "parts": summary.get("peak_memory_by_process_mb", {}),
            "s_per_step": sum(times) / len(times),
            "completion_len": sum(r["perf/completion_len"] for r in rows) / len(rows)}


def held_by_construction() -> dict[str, float]:
    """MB each process holds whatever the batch: the trainer's state and a rollout worker's engine."""
    import torch

    from bench.common import load
    from launch.config import compose, parse
    from launch.plan import resolve_precision

    cfg = parse(compose([*COMMON, "task.path=unused"]))
    model, _ = load(cfg.model.path)
    params = sum(p.numel() for p in model.parameters())
    c = model.config
    head_dim = getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads
    dtype = resolve_precision(cfg.rollout.dtype, cfg.train.autocast, "cpu")[0]
    size = torch.finfo(getattr(torch, dtype)).bits // 8
    prompt = 120  # GSM8K's longest prompts in the chat template, tokens (about twice the mean)
    max_len = prompt + cfg.rollout.max_new_tokens
    slots = engine_slots(cfg.max_staleness, cfg.train.batch_groups, cfg.rollout.group_size,
                         cfg.rollout.max_batch)
    kv = 2 * c.num_hidden_layers * c.num_key_value_heads * head_dim * size * slots * max_len
    mb = 2**20
    return {"trainer: fp32 weights": 4 * params / mb, "trainer: gradients": 4 * params / mb,
            "trainer: AdamW moments": 8 * params / mb,
            "trainer: tb's frozen reference (fp32)": 4 * params / mb,
            f"rollout worker: engine weights ({dtype})": size * params / mb,
            f"rollout worker: KV cache ({slots} slots x {max_len} tokens, {dtype})": kv / mb}


parse_vary = partial(common_parse_vary, reserved=("before", "now"))


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--baseline", default=BASELINE, help="the commit whose run is `before`")
    parser.add_argument("--path", default="", help="a local GSM8K JSONL (default: a GSM8K-shaped file)")
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--vary", action="append", default=[], help="'name=key=value ...', repeatable")
    parser.add_argument("--out", default=os.path.join(ROOT, "bench_out", "memory"))
    args = parser.parse_args()
    os.makedirs(args.out, exist_ok=True)
    data = (os.path.abspath(args.path) if args.path
            else os.path.join(os.path.abspath(args.out), "gsm8k_like.jsonl"))
    if not args.path:
        write_gsm8k_like(data)
    trees = {"before": baseline_tree(args.out, args.baseline)}
    settings = {"before": [], "now": [], **parse_vary(args.vary)}
    results = {}
    for name, overrides in settings.items():
        folder = os.path.join(os.path.abspath(args.out), name)
        run(folder, overrides, data, args.steps, trees.get(name, ROOT))
        results[name] = read(folder)
    print(f"\nalgo=tb task=gsm8k, {args.steps} steps, before: {args.baseline}, "
          f"data: {'GSM8K-shaped' if not args.path else args.path}\n")
    print("| setting | peak MB | at the peak, by process (MB) | s/step (steps 2 on) | "
          "mean completion tokens |")
    print("| --- | --- | --- | --- | --- |")
    for name, r in results.items():
        parts = ", ".join(f"{k} {v:,}" for k, v in sorted(r["parts"].items(), key=lambda kv: -kv[1]))
        print(f"| {name} | {r['peak']:,} | {parts} | {r['s_per_step']:.1f} | {r['completion_len']:.0f} |")
    print("\nheld by construction, whatever the batch (MB):")
    for what, mb in held_by_construction().items():
        print(f"  {what}: {mb:,.0f}")
    print()
    for name, r in results.items():
        print(f"{name}_peak_mb={r['peak']}")
    print(f"memory_now_vs_before={results['now']['peak'] / results['before']['peak']:.2f}")


if __name__ == "__main__":
    main()
