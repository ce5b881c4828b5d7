"""Engine changes, switched off and on in turn in one process, so that a drifting VM's speed affects both
alike: prompt caches copied from a running sibling (`BuiltinEngine._held_prefixes`, ec7ed9a), CPU decode
attention as two matmuls (`Llama.split_attention`: fp32 at ec7ed9a, bf16 at e6863a0) and a CPU cache that
grows with the longest sequence (`BuiltinEngine.FIRST_WIDTH`, aa0ffcb). Off: no copies, the fused kernel, the
cache max_len wide from the start. `--only attention` or `--only growth` switches that one alone (the others
stay on); `--only widen` compares the cache widened in place GROWTH positions at a time (64cb786, on) with
aa0ffcb's, which doubled into a fresh buffer (off, kept here as `doubling`).
"""
import argparse
import statistics
import time

import torch

from bench.common import load, task_prompts
from engines.base import Request, SamplingParams
from engines.builtin import BuiltinEngine
from engines.llama import Llama

HELD, FIRST_WIDTH = BuiltinEngine._held_prefixes, BuiltinEngine.FIRST_WIDTH
NEW_CACHE, FIT_CACHE = BuiltinEngine._new_cache, BuiltinEngine._fit_cache


def doubling(engine: BuiltinEngine, positions: int) -> None:
    """Session 18's growth: twice as wide (or `positions`), up to max_len, in a fresh buffer holding a
    copy."""
    width = engine.k_cache.shape[3]
    if positions > width:
        width = min(engine.max_len, max(positions, 2 * width))
        engine.k_cache, engine.v_cache = engine.model.grow_cache(engine.k_cache, engine.v_cache, width)


def switch(on: bool, only: str) -> None:
    if only in ("all", "attention"):
        Llama.split_attention = on
    if only in ("all", "growth"):
        BuiltinEngine.FIRST_WIDTH = FIRST_WIDTH if on else 1 << 30  # off: the cache max_len wide at once
    if only == "widen":  # off: a cache with no room to widen into, so grow_cache copies it into a fresh one
        BuiltinEngine._fit_cache = FIT_CACHE if on else doubling
        BuiltinEngine._new_cache = NEW_CACHE if on else lambda self: self.model.new_cache(
            self.max_batch, min(self.max_len, self.FIRST_WIDTH))
    if only == "all":
        BuiltinEngine._held_prefixes = HELD if on else lambda self, lengths, pending: {}


def tokens_per_s(model, prompts, new_tokens: int, eos, dtype) -> tuple[float, int]:
    engine = BuiltinEngine(model, max_batch=64, max_len=max(map(len, prompts)) + new_tokens, seed=0,
                           dtype=dtype)
    engine.generate([Request(0, prompts[0], SamplingParams(max_new_tokens=2))])  # warm-up
    params = SamplingParams(max_new_tokens=new_tokens, stop_token_ids=() if eos is None else (eos,))
    start = time.perf_counter()
    done = engine.generate([Request(i, p, params) for i, p in enumerate(prompts)])
    return sum(len(c.token_ids) for c in done) / (time.perf_counter() - start), engine.prefix_copies


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--requests", type=int, default=256)
    parser.add_argument("--ignore-eos", action="store_true")
    parser.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    parser.add_argument("--only", choices=["all", "attention", "growth", "widen"], default="all")
    parser.add_argument("--threads", type=int, default=2, help="1: a default run's rollout worker")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load()
    prompts = [p for p in task_prompts(tokenizer, -(-args.requests // 8)) for _ in range(8)][:args.requests]
    eos = None if args.ignore_eos else tokenizer.eos_token_id
    rates = {False: [], True: []}
    for _ in range(args.pairs):
        for on in (False, True):
            switch(on, args.only)
            rate, copies = tokens_per_s(model, prompts, args.new_tokens, eos,
                                        {"fp32": torch.float32, "bf16": torch.bfloat16}[args.dtype])
            rates[on].append(rate)
            print(f"{'on ' if on else 'off'} {rate:6.1f} tok/s, {copies} prompt caches copied", flush=True)
    ratios = [on / off for off, on in zip(rates[False], rates[True])]
    print(f"on_vs_off={statistics.median(rates[True]) / statistics.median(rates[False]):.2f} "
          f"(per pair {', '.join(f'{r:.2f}' for r in ratios)})")


if __name__ == "__main__":
    main()
