"""Session 12's two engine changes, switched off and on in turn in one process, so that a drifting VM's speed
affects both alike: prompt caches copied from a running sibling (`BuiltinEngine._held_prefixes`) and fp32 decode
attention as two matmuls (`Llama._attend_fp32`). Off: no copies, the fused kernel.

    PYTHONPATH=. python scripts/engine_ab.py [--pairs 3] [--new-tokens 16] [--requests 256]
    PYTHONPATH=. python scripts/engine_ab.py --pairs 2 --new-tokens 256 --requests 64 --ignore-eos

Prints tok/s of each run and the median of on/off; bench.generate's requests (8 samples a prompt), 64 slots, fp32.
"""
import argparse
import statistics
import time
from functools import partial

import torch
import torch.nn.functional as F

from bench.common import load, task_prompts
from engines.base import Request, SamplingParams
from engines.builtin import BuiltinEngine
from engines.llama import Llama

ATTEND, HELD = Llama._attend_fp32, BuiltinEngine._held_prefixes


def switch(on: bool) -> None:
    Llama._attend_fp32 = ATTEND if on else lambda self, visible: partial(F.scaled_dot_product_attention,
                                                                         attn_mask=visible)
    BuiltinEngine._held_prefixes = HELD if on else lambda self, lengths, pending: {}


def tokens_per_s(model, prompts, new_tokens: int, eos) -> tuple[float, int]:
    engine = BuiltinEngine(model, max_batch=64, max_len=max(map(len, prompts)) + new_tokens, seed=0)
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
    args = parser.parse_args()
    torch.set_num_threads(2)
    model, tokenizer = load()
    prompts = [p for p in task_prompts(tokenizer, -(-args.requests // 8)) for _ in range(8)][:args.requests]
    eos = None if args.ignore_eos else tokenizer.eos_token_id
    rates = {False: [], True: []}
    for _ in range(args.pairs):
        for on in (False, True):
            switch(on)
            rate, copies = tokens_per_s(model, prompts, args.new_tokens, eos)
            rates[on].append(rate)
            print(f"{'on ' if on else 'off'} {rate:6.1f} tok/s, {copies} prompt caches copied", flush=True)
    ratios = [on / off for off, on in zip(rates[False], rates[True])]
    print(f"on_vs_off={statistics.median(rates[True]) / statistics.median(rates[False]):.2f} "
          f"(per pair {', '.join(f'{r:.2f}' for r in ratios)})")


if __name__ == "__main__":
    main()
