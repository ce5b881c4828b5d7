"""One trainer rank's learner step on the GPU plan (FSDP2, bf16 compute, packed variable-length sequences), as
MFU.

    python -m bench.gpu_train --tokenizer DIR [--model qwen2.5-0.5b] [--device cuda] [--groups 8]
        [--prompt-len 128] [--completion-len 256] [--micro-tokens -1] [--no-checkpointing] [--steps 3]
        [--out bench_out/models] [--json FILE]

The learner is the GPU plan's: `GPUPlacement` on one rank (NCCL on cuda; gloo and the same FSDP2 wrapping on
the CPU), GRPO, AdamW, with activation checkpointing as `cluster=gpu1` sets it. A batch is `--groups` groups
of K=8 completions, all of `--completion-len` tokens, after a random prompt of `--prompt-len` tokens, trained
in passes of at most `--micro-tokens` (train.micro_tokens, its default: -1, 65536 on a GPU) as a run does. One
warm-up step, then `--steps` timed steps.

Two figures, both against the peak of a bf16 matmul measured in the same run on the same device:
- MFU, the useful work: 6 x parameters x trained tokens (each prompt once per group, plus every completion
  token), plus the causal attention of each prompt + completion sequence (6 x s^2 x hidden x layers: forward
  and backward, half the square).
- HFU, what the chosen implementation computes: under flash-attn each prompt K times (one sequence per
  completion, the price of its kernel) and causal blocks per sequence; under sdpa (no flash-attn installed)
  each prompt once and the dense square of each group's row (prompt + K completions) under the shared-prompt
  mask; activation checkpointing runs every forward twice.
The attention implementation is named in the output. Ends with `mfu=<fraction>`.
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
from launch.plan import free_port
from runtime.schema import RolloutConfig, TrainConfig
from trainer.batch import pack, pass_tokens
from trainer.gpu_policy import GPUPlacement, attn_implementation
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
                         torch.randint(0, 2, (k,), generator=g).float(), torch.ones(k, dtype=torch.bool),
                         i, i, 0))
    return pack(out)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":  # kernels run asynchronously: a timing ends when the last one has
        torch.cuda.synchronize(device)


def flops(params: int, hidden: int, layers: int, groups: list[int], k: int, prompt_len: int,
          completion_len: int, attention: str, checkpointing: bool) -> tuple[float, float]:
    """(useful, computed) FLOPs of one step whose passes hold `groups` groups each (see the module
    docstring)."""
    n = sum(groups)
    seq = prompt_len + completion_len
    trained = n * (prompt_len + k * completion_len)
    useful = 6 * params * trained + 6 * hidden * layers * n * k * seq ** 2 / 2
    forwards = 4 if checkpointing else 3  # forward, backward (twice a forward), and the recomputed forward
    if attention == "flash_attention_2":  # separate sequences: each prompt K times, causal blocks
        dense = 2 * params * n * k * seq * forwards
        attn = forwards * 4 * hidden * layers * n * k * seq ** 2 / 2
    else:  # the shared-prompt layout: each prompt once, the whole square of each group's row under the mask
        dense = 2 * params * trained * forwards
        attn = forwards * 4 * hidden * layers * n * (prompt_len + k * completion_len) ** 2
    return useful, dense + attn


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--groups", type=int, default=8, help="groups of K=8 completions per step")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--completion-len", type=int, default=256)
    parser.add_argument("--micro-tokens", type=int, default=TrainConfig.micro_tokens,
                        help="train.micro_tokens: padded tokens of the shared-prompt layout per pass")
    parser.add_argument("--no-checkpointing", action="store_true",
                        help="keep activations (cluster=gpu1 does not)")
    parser.add_argument("--steps", type=int, default=3)
    args = parser.parse_args()

    path = random_model(args.model, args.tokenizer, args.out)
    checkpointing = not args.no_checkpointing
    placement = GPUPlacement(gpu=0, checkpointing=checkpointing, device_type=args.device)
    device = placement.device
    # A GPU's matmul units need large matrices to be the bound rather than the kernel launches. The CPU is a
    # dry run: without native bf16 units its bf16 matmuls take a slow path (a 2048 one can take a minute), so
    # small.
    peak = matmul_peak_flops(torch.bfloat16, n=8192, repeats=50, device=device) if device.type == "cuda" \
        else matmul_peak_flops(torch.bfloat16, n=512, repeats=3)
    port = free_port()
    placement.init_process_group(0, 1, port)
    try:
        # The whole batch is one optimizer step of this rank's, in passes of at most micro_tokens.
        train = TrainConfig(batch_groups=args.groups, micro_groups=args.groups,
                            micro_tokens=args.micro_tokens,
                            lr=1e-6, autocast="none",  # the GPU placement computes in bf16 through FSDP2
                            freeze_embeddings=False,  # every weight trains: the 6 x parameters of MFU below
                            # and every group's pass runs, a tie in the rewards or not
                            skip_tied_groups=False)
        learner = Learner(model_path=path, train=train, algo=algos.get("grpo").Config(),
                          rollout=RolloutConfig(group_size=K, max_new_tokens=args.completion_len),
                          rank=Rank(0, 1, port, placement))
        data = fixed_batch(args.groups, args.prompt_len, args.completion_len)
        passes = [stop - start for start, stop in learner._passes(data)]
        config = learner.policy.lm.config
        attention = getattr(config, "_attn_implementation", None) or attn_implementation()
        params = sum(p.numel() for p in learner.policy.parameters())
        useful, computed = flops(params, config.hidden_size, config.num_hidden_layers, passes, K,
                                 args.prompt_len, args.completion_len, attention, checkpointing)
        tokens = data.num_tokens  # prompts once per group + completions
        print(f"{args.model} ({params / 1e6:.0f}M parameters, random weights) on {device}, GPUPlacement "
              f"(FSDP2, bf16 compute, activation checkpointing {'on' if checkpointing else 'off'}), "
              f"attention {attention}, grpo: {args.groups} groups x {K} x ({args.prompt_len} prompt + "
              f"{args.completion_len} completion), {tokens} trained tokens/step in {len(passes)} passes of "
              f"{passes} groups (micro_tokens {pass_tokens(args.micro_tokens, device.type)})")
        learner.step(data, 1)  # warm-up: allocator, kernels, AdamW's state
        synchronize(device)
        if device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(device)
        start = time.perf_counter()
        for step in range(args.steps):
            learner.step(data, step + 2)
        synchronize(device)
        seconds = (time.perf_counter() - start) / args.steps
        peak_gb = torch.cuda.max_memory_allocated(device) / 2**30 if device.type == "cuda" else None
    finally:
        dist.destroy_process_group()
    mfu, hfu = useful / seconds / peak, computed / seconds / peak
    print(f"{tokens / seconds:.0f} tokens/s  {seconds:.3f} s/step  {useful / seconds / 1e12:.3g} TFLOP/s "
          f"useful, {computed / seconds / 1e12:.3g} computed  bf16 matmul peak {peak / 1e12:.3g} TFLOP/s  "
          f"MFU {mfu:.1%}  HFU {hfu:.1%}"
          + (f"  peak memory {peak_gb:.1f} GB" if peak_gb is not None else ""))
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "gpu_train", "model": args.model, "device": str(device),
                       "groups": args.groups, "group_size": K, "prompt_len": args.prompt_len,
                       "completion_len": args.completion_len,
                       "micro_tokens": pass_tokens(args.micro_tokens, device.type), "passes": passes,
                       "checkpointing": checkpointing,
                       "attention": attention, "steps": args.steps, "parameters": params,
                       "tokens_per_step": tokens, "seconds_per_step": seconds,
                       "tokens_per_s": tokens / seconds, "useful_flops": useful, "computed_flops": computed,
                       "peak_flops": peak, "mfu": mfu, "hfu": hfu, "peak_gpu_allocated_gb": peak_gb}, f)
    print(f"mfu={mfu:.3f}")


if __name__ == "__main__":
    main()
