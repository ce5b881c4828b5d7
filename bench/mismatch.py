"""Engine against trainer on the same weights: the logprob gap that is numerics alone (the runs'
`mismatch/*`).

    python -m bench.mismatch [--prompts 4] [--samples 4] [--new-tokens 16] [--device cpu]
                             [--model smollm2-135m]

The built-in engine samples K completions per prompt of the default task (temperature 1); the trainer's
TokenLogprobs then scores the same tokens with the same weights, as the learner's diagnostics do on fresh
tokens. Two settings: everything in float32, and everything in bfloat16 (the engine's bf16 weights, the
trainer's bf16 autocast on the CPU or bf16 weights on CUDA, as the GPU plan holds them). Prints
`mismatch/abs_logprob_diff` and `mismatch/kl` for each, and ends with `mismatch_bf16_over_fp32=<ratio of the
mean absolute differences>`. On a CPU without AVX-512 the bf16 setting is slow (minutes): bf16 matmuls there
run about 100x below fp32.
"""
import argparse
import copy
import time

import torch

from bench.common import load, task_prompts
from buffer.ring import Group
from engines.base import Request, SamplingParams
from engines.builtin import BuiltinEngine
from trainer.batch import pack
from trainer.diagnostics import OffPolicyStats
from trainer.policy import TokenLogprobs


def sample(model, prompts, k, new_tokens, eos, dtype, device) -> list[Group]:
    engine = BuiltinEngine(model, max_batch=len(prompts) * k, max_len=max(map(len, prompts)) + new_tokens,
                           seed=0, dtype=dtype, device=device)
    params = SamplingParams(temperature=1.0, top_p=1.0, max_new_tokens=new_tokens, stop_token_ids=(eos,))
    done = engine.generate([Request(i * k + j, p, params) for i, p in enumerate(prompts) for j in range(k)])
    groups = []
    for index, prompt in enumerate(prompts):
        mine = sorted((c for c in done if c.request_id // k == index), key=lambda c: c.request_id)
        width = max(len(c.token_ids) for c in mine)
        ids, logprobs = torch.zeros(k, width, dtype=torch.long), torch.zeros(k, width)
        for i, c in enumerate(mine):
            ids[i, :len(c.token_ids)] = torch.tensor(c.token_ids)
            logprobs[i, :len(c.token_ids)] = torch.tensor(c.logprobs)
        groups.append(Group(prompt_ids=torch.tensor(prompt), completion_ids=ids,
                            completion_lens=torch.tensor([len(c.token_ids) for c in mine]), logprobs=logprobs,
                            versions=torch.zeros(k, width, dtype=torch.long), rewards=torch.zeros(k),
                            truncated=torch.zeros(k, dtype=torch.bool), prompt_index=index, group_id=index,
                            worker_id=0))
    return groups


@torch.no_grad()
def score(model, groups, dtype, device) -> dict:
    batch = pack(groups).to(device)
    policy = TokenLogprobs(copy.deepcopy(model).to(device))
    if device.type == "cuda":
        policy = policy.to(dtype)  # the GPU plan's trainer holds bf16 weights (FSDP2 mixed precision)
    inputs = (batch.input_ids, batch.position_ids, batch.segments, batch.gather, batch.targets, 1.0)
    with torch.autocast("cpu", dtype=torch.bfloat16,
                        enabled=device.type == "cpu" and dtype == torch.bfloat16):
        logprobs, entropy = policy(*inputs, entropy=True)
    stats = OffPolicyStats(version=0)
    stats.add(logprobs.float().cpu(), batch.behav_logprobs.cpu(), batch.mask.cpu(), batch.versions.cpu(),
              entropy.float().cpu())
    return stats.metrics()


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--prompts", type=int, default=4)
    parser.add_argument("--samples", type=int, default=4)
    parser.add_argument("--new-tokens", type=int, default=16)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--model", default="smollm2-135m")
    args = parser.parse_args()
    device = torch.device(args.device)
    model, tokenizer = load(args.model)
    prompts = task_prompts(tokenizer, args.prompts)
    diffs = {}
    print(f"{args.prompts} prompts x {args.samples} samples, <= {args.new_tokens} new tokens, "
          f"T=1.0, on {device}")
    for dtype in (torch.float32, torch.bfloat16):
        start = time.perf_counter()
        groups = sample(model, prompts, args.samples, args.new_tokens, tokenizer.eos_token_id, dtype, device)
        metrics = score(model, groups, dtype, device)
        diffs[dtype] = metrics["mismatch/abs_logprob_diff"]
        tokens = sum(int(g.completion_lens.sum()) for g in groups)
        print(f"{str(dtype):15s} {tokens} tokens  mismatch/abs_logprob_diff "
              f"{metrics['mismatch/abs_logprob_diff']:.2e}  mismatch/kl {metrics['mismatch/kl']:.2e}  "
              f"policy/entropy {metrics['policy/entropy']:.2f}  ({time.perf_counter() - start:.0f} s)",
              flush=True)
    print(f"mismatch_bf16_over_fp32={diffs[torch.bfloat16] / max(diffs[torch.float32], 1e-12):.1f}")


if __name__ == "__main__":
    main()
