"""One trainer rank's learner step on the GPU plan (FSDP2, bf16 compute, packed variable-length sequences), as MFU.

    python -m bench.gpu_train --tokenizer DIR [--model qwen2.5-0.5b] [--device cuda] [--groups 8]
        [--prompt-len 128] [--completion-len 256] [--steps 3] [--out bench_out/models] [--json FILE]

The learner is the GPU plan's: `GPUPlacement` on one rank (NCCL on cuda; gloo and the same FSDP2 wrapping on the
CPU), GRPO, AdamW. A batch is `--groups` groups of K=8 completions, all of `--completion-len` tokens, after a
random prompt of `--prompt-len` tokens; on cuda it goes through in one pass (train.micro_tokens set to hold it),
on the CPU in passes of train.micro_tokens' default 4096. One warm-up step, then `--steps` timed steps.
MFU = 6 x parameters x trained tokens (each prompt once per group, plus every completion token) per second, over
the peak of a bf16 matmul measured in the same run on the same device. The GPU layout computes each prompt K
times (one sequence per completion, the price of flash-attn's varlen kernel); that work is not counted, as in
the CPU benchmark (bench/train_step.py). Ends with `mfu=<fraction>`.
"""
import argparse
import json
import time

import torch
import torch.distributed as dist

import algos
from bench.common import matmul_peak_flops
from bench.shapes import add_model_arguments, random_model
from buffer.ring import Group
from launch.config import RolloutConfig, TrainConfig
from launch.plan import free_port
from trainer.batch import pack
from trainer.gpu_policy import GPUPlacement
from trainer.learner import Learner, Rank

K = 8  # completions per group, the default rollout.group_size
VOCAB_BOUND = 49152  # random ids stay below the smallest vocabulary of the shapes (tiny's)


def fixed_batch(groups: int, prompt_len: int, completion_len: int, k: int = K, seed: int = 0):
    """Like bench/train_step.py's batch(), with random prompts and every completion exactly `completion_len`
    tokens long (cut at the budget, as a run's long completions are)."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for i in range(groups):
        prompt = torch.randint(0, VOCAB_BOUND, (prompt_len,), generator=g)
        ids = torch.randint(0, VOCAB_BOUND, (k, completion_len), generator=g)
        out.append(Group(prompt, ids, torch.full((k,), completion_len), torch.full((k, completion_len), -1.0),
                         torch.zeros(k, completion_len, dtype=torch.long),
                         torch.randint(0, 2, (k,), generator=g).float(), torch.ones(k, dtype=torch.bool), i, i, 0))
    return pack(out)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":  # kernels run asynchronously: a timing ends when the last one has
        torch.cuda.synchronize(device)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--groups", type=int, default=8, help="groups of K=8 completions per step")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--completion-len", type=int, default=256)
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    path = random_model(args.model, args.tokenizer, args.out)
    placement = GPUPlacement(gpu=0, device_type=args.device)
    device = placement.device
    # A GPU's matmul units need large matrices to be the bound rather than the kernel launches. The CPU is a dry
    # run: without native bf16 units its bf16 matmuls take a slow path (a 2048 one can take a minute), so small.
    peak = matmul_peak_flops(torch.bfloat16, n=8192, repeats=50, device=device) if device.type == "cuda" \
        else matmul_peak_flops(torch.bfloat16, n=512, repeats=3)
    port = free_port()
    placement.init_process_group(0, 1, port)
    try:
        row = args.prompt_len + K * args.completion_len  # a group's packed row: its prompt once, then K completions
        micro_tokens = args.groups * row if device.type == "cuda" else 4096
        # The whole batch is one optimizer step of this rank's (batch_groups = micro_groups = the batch).
        train = TrainConfig(batch_groups=args.groups, micro_groups=args.groups, micro_tokens=micro_tokens, lr=1e-6,
                            autocast="none")  # the GPU placement computes in bf16 through FSDP2's mixed precision
        learner = Learner(model_path=path, train=train, algo=algos.get("grpo").Config(),
                          rollout=RolloutConfig(group_size=K, max_new_tokens=args.completion_len),
                          rank=Rank(0, 1, port, placement))
        data = fixed_batch(args.groups, args.prompt_len, args.completion_len)
        tokens = data.num_tokens  # prompts once per group + completions
        computed = args.groups * K * (args.prompt_len + args.completion_len)  # what the varlen layout runs
        params = sum(p.numel() for p in learner.policy.parameters())
        print(f"{args.model} ({params / 1e6:.0f}M parameters, random weights) on {device}, GPUPlacement (FSDP2, "
              f"bf16 compute), grpo: {args.groups} groups x {K} x ({args.prompt_len} prompt + {args.completion_len} "
              f"completion), {tokens} trained tokens/step ({computed} computed: each prompt K times), "
              f"micro_tokens {micro_tokens}")
        learner.step(data, 1)  # warm-up: allocator, kernels, AdamW's state
        synchronize(device)
        start = time.perf_counter()
        for step in range(args.steps):
            learner.step(data, step + 2)
        synchronize(device)
        seconds = (time.perf_counter() - start) / args.steps
    finally:
        dist.destroy_process_group()
    achieved = 6 * params * tokens / seconds
    mfu = achieved / peak
    print(f"{tokens / seconds:.0f} tokens/s  {seconds:.3f} s/step  {achieved / 1e12:.3g} TFLOP/s  "
          f"bf16 matmul peak {peak / 1e12:.3g} TFLOP/s  MFU {mfu:.1%}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "gpu_train", "model": args.model, "device": str(device), "groups": args.groups,
                       "group_size": K, "prompt_len": args.prompt_len, "completion_len": args.completion_len,
                       "steps": args.steps, "parameters": params, "tokens_per_step": tokens,
                       "seconds_per_step": seconds, "tokens_per_s": tokens / seconds, "achieved_flops": achieved,
                       "peak_flops": peak, "mfu": mfu}, f)
    print(f"mfu={mfu:.3f}")


if __name__ == "__main__":
    main()
