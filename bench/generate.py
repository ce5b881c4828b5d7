"""The built-in CPU engine against Hugging Face `generate`: same model, prompts, budget and sampling.

    python -m bench.generate [--sequences 64] [--requests 256] [--new-tokens 16] [--ignore-eos] [--threads 2]
                             [--dtypes auto|fp32|bf16|fp32,bf16] [--repeats 3]
    python -m bench.generate --new-tokens 256 --ignore-eos      # the long-completion shape
    python -m bench.generate --fallback

`--sequences` slots decode together; `--requests` requests wait for them, as a rollout worker's queue does, so
continuous batching refills a finished slot at once and the batch stays full. As in a rollout, they are
`--group-size` samples of each prompt of the default task (the engine computes a shared prompt once). HF
`generate` has no such queue: it gets the first `--sequences` requests in one batch. Completions stop at EOS
(default-task answers are about 14 tokens), or with `--ignore-eos` run to `--new-tokens`, so that every step
reads a longer KV cache.
Prints tokens/s of both in fp32 and bf16 and the engine against two limits measured in the same run: compute
(the matmul peak over the run's FLOPs: 2 x parameters a token, generated or of a distinct prompt, prefill
being work too, and attention's two matmuls over each token's context, as PaLM's MFU counts them) and memory
(the bytes a decode step reads, every weight once and the KV cache of the sequences in flight at their mean
length, over the measured copy bandwidth, times the sequences a step decodes). The engine runs `--repeats`
times (default 3), each run held to the higher of the matmul peaks, and of the copy bandwidths, read just
before and just after it (each run's bandwidth is printed); the engine's fraction of
the lower limit, `engine_at=`, and its tokens/s are those of the median run (the spread beside them); beside
it the same run against a compute limit of the weights' FLOPs alone (the accounting before 87cfac8). Ends with
`engine_vs_hf=<ratio>` and `engine_at_limit=<fraction>` (bf16; fp32 on a CPU without native
bf16, where `--dtypes` defaults to fp32 alone). Where the engine's
matmuls read oneDNN-blocked weights (bf16 with AVX-512, fp32 with AVX2 only: engines/llama.py
`blocks_weights`), it also runs on the plain weights, the same requests, and prints
`blocked_vs_plain=<ratio>`.
`--fallback`: fp32 only, the engine's fast path against its fallback (engines/hf.py, the model's own forward)
on the same model, and HF `generate`; ends with `fallback_vs_fast=<ratio>`.
"""
import argparse
import time
from typing import NamedTuple

import torch

from bench.common import bench_dtypes, copy_bandwidth, load, matmul_peak_flops, task_prompts
from engines.base import Request, SamplingParams
from engines.builtin import BuiltinEngine
from engines.llama import blocks_weights


def limits(config, params: int, prompts, new_tokens: int, tokens: int, dtype, peak: float, bandwidth: float,
           slots: int = 0, attention: bool = True):
    """(compute limit, memory limit) in generated tokens/s. Compute: the run's FLOPs at the matmul peak:
    2 x params for every generated token and every token of a distinct prompt (prefill), and, with
    `attention`, attention's two matmuls (scores and the weighted sum: 4 x layers x heads x head_dim FLOPs for
    each position a token attends to, as PaLM's MFU counts them), a generated token attending to its context
    at the mean length below and a prompt's tokens causally. Memory: the run decodes `tokens` for `prompts` in
    steps of up to `slots` sequences (default: all of them at once); each step reads the weights once and the
    cache of every sequence in flight, at its mean length (prompt + half the new tokens generated)."""
    distinct = [len(p) for p in {tuple(p) for p in prompts}]
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    mean_len = sum(map(len, prompts)) / len(prompts) + tokens / len(prompts) / 2
    flops = 2 * params * (tokens + sum(distinct))
    if attention:
        per_position = 4 * config.num_hidden_layers * config.num_attention_heads * head_dim
        flops += per_position * (tokens * mean_len + sum(n * (n + 1) / 2 for n in distinct))
    compute = peak * tokens / flops
    size = torch.finfo(dtype).bits // 8
    kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * head_dim * size
    n = slots or len(prompts)
    step_bytes = params * size + n * mean_len * kv_per_token
    memory = n * bandwidth / step_bytes
    return compute, memory


def run_engine(model, prompts, new_tokens, eos, dtype, fallback: bool = False, slots: int = 0,
               plain: bool = False) -> tuple[int, float]:
    """Tokens generated and seconds: `prompts` through `slots` engine slots (default: one each); eos None:
    none stop early. `plain`: the matmuls read the plain weights (F.linear), not the blocked copies a CPU
    engine may keep."""
    engine = BuiltinEngine(model, max_batch=slots or len(prompts),
                           max_len=max(map(len, prompts)) + new_tokens, seed=0, dtype=dtype,
                           fallback=fallback)
    if plain:
        engine.model.blocks = False
    engine.generate([Request(0, prompts[0], SamplingParams(max_new_tokens=2))])  # warm-up
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=new_tokens,
                            stop_token_ids=() if eos is None else (eos,))
    start = time.perf_counter()
    done = engine.generate([Request(i, p, params) for i, p in enumerate(prompts)])
    return sum(len(c.token_ids) for c in done), time.perf_counter() - start


def run_hf(model, tokenizer, prompts, new_tokens, eos, dtype, ignore_eos: bool = False) -> tuple[int, float]:
    model = model.to(dtype)
    width = max(map(len, prompts))
    ids = torch.tensor([[eos] * (width - len(p)) + p for p in prompts])  # left padding
    mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    with torch.inference_mode():
        model.generate(ids[:1], attention_mask=mask[:1], max_new_tokens=2, do_sample=False, pad_token_id=eos)
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, do_sample=True, temperature=1.0, top_p=1.0, top_k=0,
                             max_new_tokens=new_tokens, pad_token_id=eos,
                             eos_token_id=None if ignore_eos else eos,
                             **({"min_new_tokens": new_tokens} if ignore_eos else {}))
        elapsed = time.perf_counter() - start
    model.to(torch.float32)
    rows = out[:, width:].tolist()
    if ignore_eos:
        return sum(map(len, rows)), elapsed
    return sum(r.index(eos) + 1 if eos in r else len(r) for r in rows), elapsed


class EngineRun(NamedTuple):
    rate: float  # generated tokens/s
    at: float  # rate over the lower of the two limits
    compute: float  # limits, tokens/s
    memory: float
    peak: float  # the matmul peak the compute limit comes from, FLOP/s
    tokens: int
    at_weights: float  # `at` with a compute limit that leaves attention's matmuls out (sessions before 26)
    bandwidth: float  # the copy bandwidth the memory limit comes from, bytes/s


def engine_runs(model, prompts, args, eos, dtype, params: int, bandwidth: float) -> list[EngineRun]:
    """`--repeats` engine runs, each against its own limits.
    A shared VM's matmul rate drifts by 1.5x within minutes, and its memory bandwidth with the host's traffic:
    the peak and the copy bandwidth are read on both sides of each run, and the higher ones are that run's
    limits (lower ones would flatter the engine)."""
    peaks, bandwidths, runs = [matmul_peak_flops(dtype)], [bandwidth], []
    for _ in range(args.repeats):
        tokens, seconds = run_engine(model, prompts, args.new_tokens, None if args.ignore_eos else eos, dtype,
                                     slots=args.sequences)
        peaks.append(matmul_peak_flops(dtype))
        bandwidths.append(copy_bandwidth())
        peak, held = max(peaks[-2:]), max(bandwidths[-2:])
        compute, memory = limits(model.config, params, prompts, args.new_tokens, tokens, dtype, peak, held,
                                 slots=args.sequences)
        weights, _ = limits(model.config, params, prompts, args.new_tokens, tokens, dtype, peak, held,
                            slots=args.sequences, attention=False)
        rate = tokens / seconds
        runs.append(EngineRun(rate, rate / min(compute, memory), compute, memory, peak, tokens,
                              rate / min(weights, memory), held))
    return runs


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--sequences", type=int, default=64, help="engine slots: sequences decoded together")
    parser.add_argument("--requests", type=int, default=0,
                        help="prompts queued for them (default 4 x sequences)")
    parser.add_argument("--group-size", type=int, default=8, help="samples per prompt, as rollout.group_size")
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--ignore-eos", action="store_true", help="every completion runs to --new-tokens")
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--fallback", action="store_true", help="fast path vs fallback, fp32")
    parser.add_argument("--repeats", type=int, default=3, help="engine runs per dtype; medians are reported")
    parser.add_argument("--dtypes", default="auto",
                        help="fp32, bf16 or both; auto: bf16 too where the CPU has it natively")
    args = parser.parse_args()
    if args.repeats < 1:
        parser.error("--repeats must be at least 1")
    torch.set_num_threads(args.threads)
    model, tokenizer = load()
    requests = args.requests or 4 * args.sequences
    prompts = [p for p in task_prompts(tokenizer, -(-requests // args.group_size))
               for _ in range(args.group_size)]
    prompts = prompts[:requests]
    eos = tokenizer.eos_token_id
    params = sum(p.numel() for p in model.parameters())
    budget = f"{'' if args.ignore_eos else '<= '}{args.new_tokens} new tokens"
    print(f"{requests} requests ({args.group_size} a prompt) through {args.sequences} slots, {budget}, "
          f"T=1.0, {args.threads} threads, {params / 1e6:.1f}M parameters")
    if args.fallback:
        return compare_paths(model, tokenizer, prompts[:args.sequences], args.new_tokens, eos)
    ratio = at = None
    bandwidth = copy_bandwidth()
    print(f"copy bandwidth {bandwidth / 1e9:.1f} GB/s (read + write)")
    for dtype in [{"fp32": torch.float32, "bf16": torch.bfloat16}[name]
                  for name in bench_dtypes(args.dtypes)]:
        runs = engine_runs(model, prompts, args, eos, dtype, params, bandwidth)
        median = sorted(runs, key=lambda r: r.at)[(len(runs) - 1) // 2]
        at = median.at
        hf_tokens, hf_s = run_hf(model, tokenizer, prompts[:args.sequences], args.new_tokens, eos, dtype,
                                 args.ignore_eos)
        hf_tps = hf_tokens / hf_s
        ratio = median.rate / hf_tps
        spread = (f" (runs {min(r.rate for r in runs):.1f}-{max(r.rate for r in runs):.1f} tok/s, "
                  f"{min(r.at for r in runs):.0%}-{max(r.at for r in runs):.0%})" if len(runs) > 1 else "")
        print(f"copy bandwidth around the {dtype} runs: "
              + ", ".join(f"{r.bandwidth / 1e9:.1f}" for r in runs)
              + " GB/s (each run's, the higher of the readings before and after it)")
        print(f"{str(dtype):15s} engine {median.rate:7.1f} tok/s ({median.tokens} tokens)  "
              f"hf {hf_tps:7.1f} tok/s ({hf_tokens} tokens)  ratio {ratio:.2f}  "
              f"limits: compute {median.compute:.0f} tok/s (matmul peak {median.peak / 1e9:.0f} GFLOP/s), "
              f"memory {median.memory:.0f} tok/s -> engine_at={at:.0%} of the lower, the median of "
              f"{len(runs)} runs{spread}; {median.at_weights:.0%} against a compute limit of the "
              "weights' FLOPs alone")
        if blocks_weights(torch.device("cpu"), dtype):
            plain_tokens, plain_s = run_engine(model, prompts, args.new_tokens,
                                               None if args.ignore_eos else eos, dtype,
                                               slots=args.sequences, plain=True)
            blocked_vs_plain = median.rate / (plain_tokens / plain_s)
            print(f"{str(dtype):15s} engine on the plain weights (F.linear) {plain_tokens / plain_s:7.1f} "
                  f"tok/s ({plain_tokens} tokens) -> blocked_vs_plain={blocked_vs_plain:.2f}")
    print(f"engine_vs_hf={ratio:.2f}")
    print(f"engine_at_limit={at:.2f}")


def compare_paths(model, tokenizer, prompts, new_tokens, eos) -> None:
    rates = {}
    for name, run in (("fast path", lambda: run_engine(model, prompts, new_tokens, eos, torch.float32)),
                      ("fallback",
                       lambda: run_engine(model, prompts, new_tokens, eos, torch.float32, fallback=True)),
                      ("hf generate",
                       lambda: run_hf(model, tokenizer, prompts, new_tokens, eos, torch.float32))):
        tokens, seconds = run()
        rates[name] = tokens / seconds
        print(f"fp32 {name:12s} {rates[name]:7.1f} tok/s ({tokens} tokens)")
    print(f"fallback_vs_fast={rates['fallback'] / rates['fast path']:.2f}")


if __name__ == "__main__":
    main()
