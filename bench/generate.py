"""The built-in CPU engine against Hugging Face `generate`: same model, prompts, budget and sampling.

    python -m bench.generate [--sequences 64] [--new-tokens 64] [--threads 2] [--fallback]

Prints tokens/s of both in fp32 and bf16, the engine's fraction of the limit implied by the matmul peak
measured in the same run (2 x parameters FLOPs per token), and ends with `engine_vs_hf=<ratio>` (bf16).
Completions stop at EOS, so their lengths vary: continuous batching refills finished slots at once.
`--fallback`: fp32 only, the engine's fast path against its fallback (engines/hf.py, the model's own forward)
on the same model, and HF `generate`; ends with `fallback_vs_fast=<ratio>`.
"""
import argparse
import time

import torch

from bench.common import load, matmul_peak_flops, task_prompts
from engines.base import Request, SamplingParams
from engines.builtin import BuiltinEngine


def run_engine(model, prompts, new_tokens, eos, dtype, fallback: bool = False) -> tuple[int, float]:
    engine = BuiltinEngine(model, max_batch=len(prompts), max_len=max(map(len, prompts)) + new_tokens, seed=0,
                           dtype=dtype, fallback=fallback)
    engine.generate([Request(0, prompts[0], SamplingParams(max_new_tokens=2))])  # warm-up
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=new_tokens, stop_token_ids=(eos,))
    start = time.perf_counter()
    done = engine.generate([Request(i, p, params) for i, p in enumerate(prompts)])
    return sum(len(c.token_ids) for c in done), time.perf_counter() - start


def run_hf(model, tokenizer, prompts, new_tokens, eos, dtype) -> tuple[int, float]:
    model = model.to(dtype)
    width = max(map(len, prompts))
    ids = torch.tensor([[eos] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        model.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=2, do_sample=False, pad_token_id=eos)
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                             max_new_tokens=new_tokens, pad_token_id=eos, eos_token_id=eos)
        elapsed = time.perf_counter() - start
    model.to(torch.float32)
    rows = out[:, width:].tolist()
    return sum(r.index(eos) + 1 if eos in r else len(r) for r in rows), elapsed


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--fallback", action="store_true", help="fast path vs fallback, fp32")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    model, tokenizer = load()
    prompts = task_prompts(tokenizer, args.sequences)
    eos = tokenizer.eos_token_id
    params = sum(p.numel() for p in model.parameters())
    print(f"{args.sequences} sequences, <= {args.new_tokens} new tokens, T=1.0, {args.threads} threads, "
          f"{params / 1e6:.1f}M parameters")
    if args.fallback:
        return compare_paths(model, tokenizer, prompts, args.new_tokens, eos)
    ratio = None
    for dtype in (torch.float32, torch.bfloat16):
        peak = matmul_peak_flops(dtype)
        engine_tokens, engine_s = run_engine(model, prompts, args.new_tokens, eos, dtype)
        hf_tokens, hf_s = run_hf(model, tokenizer, prompts, args.new_tokens, eos, dtype)
        engine_tps, hf_tps = engine_tokens / engine_s, hf_tokens / hf_s
        limit = peak / (2 * params)
        ratio = engine_tps / hf_tps
        print(f"{str(dtype):15s} engine {engine_tps:7.1f} tok/s ({engine_tokens} tokens)  "
              f"hf {hf_tps:7.1f} tok/s ({hf_tokens} tokens)  ratio {ratio:.2f}  "
              f"matmul peak {peak / 1e9:.0f} GFLOP/s -> limit {limit:.0f} tok/s, engine at {engine_tps / limit:.0%}")
    print(f"engine_vs_hf={ratio:.2f}")


def compare_paths(model, tokenizer, prompts, new_tokens, eos) -> None:
    rates = {}
    for name, run in (("fast path", lambda: run_engine(model, prompts, new_tokens, eos, torch.float32)),
                      ("fallback", lambda: run_engine(model, prompts, new_tokens, eos, torch.float32, fallback=True)),
                      ("hf generate", lambda: run_hf(model, tokenizer, prompts, new_tokens, eos, torch.float32))):
        tokens, seconds = run()
        rates[name] = tokens / seconds
        print(f"fp32 {name:12s} {rates[name]:7.1f} tok/s ({tokens} tokens)")
    print(f"fallback_vs_fast={rates['fallback'] / rates['fast path']:.2f}")


if __name__ == "__main__":
    main()
