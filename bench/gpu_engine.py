"""The built-in engine on a GPU against Hugging Face `generate`: same random-weight model, batch, budget,
sampling.

    python -m bench.gpu_engine --tokenizer DIR [--model qwen2.5-0.5b] [--device cuda] [--sequences 64]
        [--prompt-len 64] [--new-tokens 128] [--out bench_out/models] [--json FILE]

The model is a real architecture with random weights (bench/shapes.py), in bf16 on cuda and float32 on the
CPU. Prompts are random token ids of one length, and nothing stops early (no stop tokens, HF's
eos_token_id=None), so every run generates exactly sequences x new-tokens tokens at T=1, top_p=1: the same
work, in one batch. The engine runs three ways (VARIANTS): `stepwise`, the CPU plan's step; `static`, the GPU
plan's fixed-shape step launched kernel by kernel; `graphs`, that step replayed as CUDA graphs
(rollout.cuda_graphs; eager where there is no CUDA). Each runs the workload once untimed first (its graphs are
captured there, and the capture time printed). Prints tokens/s of each and of HF, the share of tokens the
variants agree on, and ends with `graphs_tokens_per_s=<n> graphs_vs_hf=<ratio> stepwise_vs_hf=<ratio>`.
"""
import argparse
import json
import time
from typing import NamedTuple

import torch

from bench.shapes import add_model_arguments, random_model
from engines.base import Request, SamplingParams
from engines.builtin import BuiltinEngine

VOCAB_BOUND = 49152  # random prompt ids stay below the smallest vocabulary of the shapes (tiny's)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":  # kernels run asynchronously: a timing ends when the last one has
        torch.cuda.synchronize(device)


# The engine's ways of decoding, compared on the same work: today's CPU-plan step (exactly the running rows, a
# few host syncs a step), the GPU plan's static step launched kernel by kernel, and that step as CUDA graphs.
VARIANTS = {"stepwise": dict(static=False), "static": dict(static=True),
            "graphs": dict(static=True, cuda_graphs=True)}


class EngineRun(NamedTuple):
    tokens: int
    seconds: float
    completions: list  # token ids of each request
    graphs: int  # CUDA graphs captured (during the warm-up)
    capture_s: float


def run_engine(model, prompts: list[list[int]], new_tokens: int, dtype, device, variant: str) -> EngineRun:
    engine = BuiltinEngine(model, max_batch=len(prompts), max_len=len(prompts[0]) + new_tokens, seed=0,
                           dtype=dtype, device=device, **VARIANTS[variant])
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=new_tokens, stop_token_ids=())
    requests = [Request(i, p, params) for i, p in enumerate(prompts)]
    # The whole workload once first: kernels, the allocator, and every graph this shape needs (one per width
    # bucket).
    engine.generate(requests)
    synchronize(device)
    start = time.perf_counter()
    done = engine.generate(requests)
    synchronize(device)
    elapsed = time.perf_counter() - start
    step = engine.decoder
    graphs, capture_s = (len(step.graphs), step.capture_s) if step is not None else (0, 0.0)
    return EngineRun(sum(len(c.token_ids) for c in done), elapsed, [c.token_ids for c in done], graphs,
                     capture_s)


def run_hf(model, prompts: list[list[int]], new_tokens: int, device) -> tuple[int, float]:
    # One prompt length, so the left-padded batch has no padding and the mask is all ones.
    ids = torch.tensor(prompts, device=device)
    mask = torch.ones_like(ids)
    # eos_token_id=None: nothing ends a row early; min_new_tokens too in case a default eos survives.
    sampling = dict(do_sample=True, temperature=1.0, top_k=0, top_p=1.0, eos_token_id=None,
                    pad_token_id=model.config.eos_token_id)
    with torch.inference_mode():
        model.generate(ids, attention_mask=mask, min_new_tokens=min(8, new_tokens),
                       max_new_tokens=min(8, new_tokens), **sampling)  # warm-up
        synchronize(device)
        start = time.perf_counter()
        out = model.generate(ids, attention_mask=mask, min_new_tokens=new_tokens, max_new_tokens=new_tokens,
                             **sampling)
        synchronize(device)
        elapsed = time.perf_counter() - start
    return out[:, ids.shape[1]:].numel(), elapsed


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--sequences", type=int, default=64)
    parser.add_argument("--prompt-len", type=int, default=64)
    parser.add_argument("--new-tokens", type=int, default=128)
    args = parser.parse_args()
    from transformers import AutoModelForCausalLM

    device = torch.device("cuda", 0) if args.device == "cuda" else torch.device("cpu")
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    path = random_model(args.model, args.tokenizer, args.out)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype).to(device).eval()
    params = sum(p.numel() for p in model.parameters())
    g = torch.Generator().manual_seed(0)
    prompts = torch.randint(0, VOCAB_BOUND, (args.sequences, args.prompt_len), generator=g).tolist()
    print(f"{args.model} ({params / 1e6:.0f}M parameters, random weights) on {device}, {dtype}: "
          f"{args.sequences} sequences x {args.prompt_len} prompt + {args.new_tokens} new tokens, T=1.0, "
          "top_p=1.0, no stop tokens")

    expected = args.sequences * args.new_tokens
    runs = {variant: run_engine(model, prompts, args.new_tokens, dtype, device, variant)
            for variant in VARIANTS}
    hf_tokens, hf_s = run_hf(model, prompts, args.new_tokens, device)
    counts = {**{v: r.tokens for v, r in runs.items()}, "hf": hf_tokens}
    if any(n != expected for n in counts.values()):  # the comparison is only fair on the same work
        raise RuntimeError(f"expected {expected} new tokens from each, got {counts}")
    hf_tps = hf_tokens / hf_s
    figures = {"hf_tokens_per_s": hf_tps}
    for variant, r in runs.items():
        tps = r.tokens / r.seconds
        figures.update({f"{variant}_tokens_per_s": tps, f"{variant}_vs_hf": tps / hf_tps})
        captured = f", {r.graphs} graphs captured in {r.capture_s:.2f} s" if r.graphs else ""
        print(f"engine, {variant:8s} {tps:9.1f} tok/s ({r.seconds:.2f} s{captured})")
    print(f"hf generate      {hf_tps:9.1f} tok/s ({hf_s:.2f} s)")
    if device.type != "cuda":
        print("(no CUDA: the graphs variant ran the static step eagerly)")
    # A graph replays the static step's own kernels: the same tokens, bit for bit. Against the stepwise step,
    # the attention reads another width and bf16 rounds differently, so tokens may part after a near-tie.
    same = lambda a, b: sum(x == y for p, q in zip(a, b) for x, y in zip(p, q)) / expected  # noqa: E731
    figures.update(graphs_same_tokens_as_static=same(runs["graphs"].completions, runs["static"].completions),
                   static_same_tokens_as_stepwise=same(runs["static"].completions,
                                                       runs["stepwise"].completions),
                   graphs=runs["graphs"].graphs, capture_s=runs["graphs"].capture_s)
    print(f"tokens the same: graphs/static {figures['graphs_same_tokens_as_static']:.3f}, static/stepwise "
          f"{figures['static_same_tokens_as_stepwise']:.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "gpu_engine", "model": args.model, "device": str(device),
                       "dtype": str(dtype), "sequences": args.sequences, "prompt_len": args.prompt_len,
                       "new_tokens": args.new_tokens, **figures, "builtin_vs_hf": figures["graphs_vs_hf"]}, f)
    print(f"graphs_tokens_per_s={figures['graphs_tokens_per_s']:.0f} "
          f"graphs_vs_hf={figures['graphs_vs_hf']:.2f} stepwise_vs_hf={figures['stepwise_vs_hf']:.2f}")


if __name__ == "__main__":
    main()
