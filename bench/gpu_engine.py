"""The built-in engine on a GPU against Hugging Face `generate`: same random-weight model, batch, budget, sampling.

    python -m bench.gpu_engine --tokenizer DIR [--model qwen2.5-0.5b] [--device cuda] [--sequences 64]
        [--prompt-len 64] [--new-tokens 128] [--out bench_out/models] [--json FILE]

The model is a real architecture with random weights (bench/shapes.py), in bf16 on cuda and float32 on the CPU.
Prompts are random token ids of one length, and nothing stops early (no stop tokens, HF's eos_token_id=None), so
both generate exactly sequences x new-tokens tokens at T=1, top_p=1: the same work, in one batch. Prints tokens/s
of both and ends with `builtin_vs_hf=<ratio>` (the engine's tokens/s over HF's).
"""
import argparse
import json
import time

import torch

from bench.shapes import add_model_arguments, random_model
from engines.base import Request, SamplingParams
from engines.builtin import BuiltinEngine

VOCAB_BOUND = 49152  # random prompt ids stay below the smallest vocabulary of the shapes (tiny's)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":  # kernels run asynchronously: a timing ends when the last one has
        torch.cuda.synchronize(device)


def run_engine(model, prompts: list[list[int]], new_tokens: int, dtype, device) -> tuple[int, float]:
    engine = BuiltinEngine(model, max_batch=len(prompts), max_len=len(prompts[0]) + new_tokens, seed=0, dtype=dtype,
                           device=device)
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=new_tokens, stop_token_ids=())
    requests = [Request(i, p, params) for i, p in enumerate(prompts)]
    warmup = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=min(8, new_tokens), stop_token_ids=())
    engine.generate([Request(i, p, warmup) for i, p in enumerate(prompts)])  # kernels and allocator at this batch
    synchronize(device)
    start = time.perf_counter()
    done = engine.generate(requests)
    synchronize(device)
    elapsed = time.perf_counter() - start
    return sum(len(c.token_ids) for c in done), elapsed


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
    print(f"{args.model} ({params / 1e6:.0f}M parameters, random weights) on {device}, {dtype}: {args.sequences} "
          f"sequences x {args.prompt_len} prompt + {args.new_tokens} new tokens, T=1.0, top_p=1.0, no stop tokens")

    engine_tokens, engine_s = run_engine(model, prompts, args.new_tokens, dtype, device)
    hf_tokens, hf_s = run_hf(model, prompts, args.new_tokens, device)
    expected = args.sequences * args.new_tokens
    if engine_tokens != expected or hf_tokens != expected:  # the comparison is only fair on the same work
        raise RuntimeError(f"expected {expected} new tokens from each, got engine {engine_tokens}, hf {hf_tokens}")
    engine_tps, hf_tps = engine_tokens / engine_s, hf_tokens / hf_s
    ratio = engine_tps / hf_tps
    print(f"builtin engine {engine_tps:9.1f} tok/s ({engine_s:.2f} s)")
    print(f"hf generate    {hf_tps:9.1f} tok/s ({hf_s:.2f} s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "gpu_engine", "model": args.model, "device": str(device), "dtype": str(dtype),
                       "sequences": args.sequences, "prompt_len": args.prompt_len, "new_tokens": args.new_tokens,
                       "builtin_tokens_per_s": engine_tps, "hf_tokens_per_s": hf_tps, "builtin_vs_hf": ratio}, f)
    print(f"builtin_vs_hf={ratio:.2f}")


if __name__ == "__main__":
    main()
