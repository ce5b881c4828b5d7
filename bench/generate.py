"""The built-in CPU engine against Hugging Face `generate`: same model, prompts, budget and sampling.

    python -m bench.generate [--sequences 64] [--new-tokens 64] [--threads 2] [--fallback]

Prints tokens/s of both in fp32 and bf16 and the engine against two limits measured in the same run: compute (the
matmul peak over 2 x parameters FLOPs a token) and memory (the bytes a decode step reads, every weight once and the
KV cache of the sequences in flight at their mean length, over the measured copy bandwidth, times the sequences a
step decodes); the engine's fraction of the lower one is `engine_at=`. Ends with `engine_vs_hf=<ratio>` and
`engine_at_limit=<fraction>` (bf16).
Completions stop at EOS, so their lengths vary: continuous batching refills finished slots at once.
`--fallback`: fp32 only, the engine's fast path against its fallback (engines/hf.py, the model's own forward)
on the same model, and HF `generate`; ends with `fallback_vs_fast=<ratio>`.
"""
import argparse
import time

import torch

from bench.common import copy_bandwidth, load, matmul_peak_flops, task_prompts
from engines.base import Request, SamplingParams
from engines.builtin import BuiltinEngine


def limits(config, params: int, prompts, new_tokens: int, tokens: int, dtype, peak: float, bandwidth: float):
    """(compute limit, memory limit) in tokens/s. Memory: the run decodes `tokens` in steps of up to len(prompts)
    sequences; each step reads the weights once and the cache of every sequence in flight, at its mean length
    (prompt + half the new tokens generated)."""
    compute = peak / (2 * params)
    size = torch.finfo(dtype).bits // 8
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * size
    n = len(prompts)
    mean_len = sum(map(len, prompts)) / n + tokens / n / 2
    step_bytes = params * size + n * mean_len * kv_per_token
    memory = n * bandwidth / step_bytes
    return compute, memory


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
    ratio = at = None
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write)")
    for dtype in (torch.float32, torch.bfloat16):
        peak = matmul_peak_flops(dtype)
        engine_tokens, engine_s = run_engine(model, prompts, args.new_tokens, eos, dtype)
        hf_tokens, hf_s = run_hf(model, tokenizer, prompts, args.new_tokens, eos, dtype)
        engine_tps, hf_tps = engine_tokens / engine_s, hf_tokens / hf_s
        compute, memory = limits(model.config, params, prompts, args.new_tokens, engine_tokens, dtype, peak,
                                 bandwidth)
        ratio, at = engine_tps / hf_tps, engine_tps / min(compute, memory)
        print(f"{str(dtype):15s} engine {engine_tps:7.1f} tok/s ({engine_tokens} tokens)  "
              f"hf {hf_tps:7.1f} tok/s ({hf_tokens} tokens)  ratio {ratio:.2f}  "
              f"limits: compute {compute:.0f} tok/s (matmul peak {peak / 1e9:.0f} GFLOP/s), memory {memory:.0f} "
              f"tok/s -> engine_at={at:.0%} of the lower")
    print(f"engine_vs_hf={ratio:.2f}")
    print(f"engine_at_limit={at:.2f}")


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
