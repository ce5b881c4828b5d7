"""LoRA against full fine-tuning: the learner's peak memory and seconds per step, each in a process of its
own.

    python -m bench.lora [--threads 2] [--steps 3] [--algo ppo] [--rank 16] [--bf16] [--model smollm2-135m]

A step is bench/train_step.py's: the default run's batch (8 prompts x 8 completions of up to 16 tokens), one
forward, backward and AdamW step. Two learners: "full", the default run's (every weight trains but the input
embeddings and the head tied to them, `train.freeze_embeddings`), and LoRA (`train.lora.rank`, all linear
layers), in fp32 as the default run on a CPU without bf16 matmul units; `--bf16` adds both under bf16
autocast, LoRA's base then held in bf16 (on a CPU without AMX or AVX-512 BF16, bf16 steps are many times
slower). Peak memory is the process's peak resident set (the model, the optimizer state, the step's
activations, Python and torch), measured in a fresh process per learner; beside it, what the learner holds
between steps (weights and AdamW's moments, counted tensor by tensor). Ends with
`lora_vs_full_memory=<ratio>` (LoRA's peak over full fine-tuning's, both in the default run's fp32) and
`lora_vs_full_step=<ratio>` (the same for seconds per step). `--model qwen2.5-1.5b` (or another shape of
bench/shapes.py, random weights) measures only LoRA (on a bf16 base with --bf16), with one group a step: what
fits where full fine-tuning would not (fp32 weights, gradients and AdamW moments: 16 bytes a parameter).
"""
import argparse
import json
import os
import resource
import socket
import subprocess
import sys
import time

VARIANTS = {  # name: (train.autocast, train.lora.rank > 0, train.lora.base_dtype)
    "full fp32": ("none", False, "auto"),
    "full bf16 autocast": ("bfloat16", False, "auto"),
    "lora fp32 base": ("none", True, "float32"),
    "lora bf16 base": ("bfloat16", True, "bfloat16"),
}


def one(args) -> dict:
    """The figures of one learner, in this process."""
    import torch
    import torch.distributed as dist

    import algos
    from bench.train_step import batch
    from runtime.schema import LoraConfig, RolloutConfig, TrainConfig
    from trainer.learner import Learner

    torch.set_num_threads(args.threads)
    autocast, lora, base = VARIANTS[args.variant]
    path, tokenizer = _model(args)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    groups = 8 if args.model == "smollm2-135m" else 1
    train = TrainConfig(batch_groups=groups, micro_groups=8, micro_tokens=4096, lr=1e-5, autocast=autocast,
                        lora=LoraConfig(rank=args.rank if lora else 0, base_dtype=base),
                        skip_tied_groups=False)  # every group's pass runs, a tie in the random rewards or not
    learner = Learner(model_path=path, train=train, algo=algos.get(args.algo).Config(),
                      rollout=RolloutConfig(group_size=8, max_new_tokens=16, temperature=1.0))
    data = batch(tokenizer, groups=groups)
    learner.step(data, 1)  # warm-up: AdamW's state exists from here on
    start = time.perf_counter()
    for step in range(args.steps):
        learner.step(data, step + 2)
    seconds = (time.perf_counter() - start) / args.steps
    trained = sum(p.numel() for p in learner.policy.parameters() if p.requires_grad)
    held = sum(t.numel() * t.element_size() for t in learner.policy.state_dict().values()) + sum(
        t.numel() * t.element_size() for state in learner.optimizer.state.values() for t in state.values()
        if torch.is_tensor(t))
    dist.destroy_process_group()
    peak_mb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    return {"seconds": seconds, "peak_mb": peak_mb, "held_mb": held / 2**20, "trained": trained,
            "tokens": data.num_tokens}


def _model(args):
    from transformers import AutoTokenizer

    from models.loader import resolve

    path = resolve("smollm2-135m")
    if args.model != "smollm2-135m":
        from bench.shapes import random_model

        path = random_model(args.model, path, "bench_out/models")
    return path, AutoTokenizer.from_pretrained(path)


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--algo", default="ppo",
                        help="the learning rule (tb and online_dpo also hold a reference)")
    parser.add_argument("--rank", type=int, default=16)
    parser.add_argument("--model", default="smollm2-135m", help="smollm2-135m, or a shape of bench/shapes.py")
    parser.add_argument("--bf16", action="store_true", help="also under bf16 autocast, LoRA on a bf16 base")
    # one learner, as a child
    parser.add_argument("--variant", choices=sorted(VARIANTS), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.variant:
        print(json.dumps(one(args)))
        return
    names = ["full fp32", "lora fp32 base"] + ["full bf16 autocast", "lora bf16 base"] * args.bf16
    if args.model != "smollm2-135m":
        names = ["lora bf16 base" if args.bf16 else "lora fp32 base"]
    results = {}
    for name in names:
        cmd = [sys.executable, "-m", "bench.lora", "--variant", name, "--threads", str(args.threads),
               "--steps", str(args.steps), "--algo", args.algo, "--rank", str(args.rank),
               "--model", args.model]
        out = subprocess.run(cmd, capture_output=True, text=True,
                             cwd=os.path.dirname(os.path.dirname(__file__)))
        if out.returncode:
            sys.exit(f"{name}: {out.stderr.strip().splitlines()[-1]}")
        r = results[name] = json.loads(out.stdout.strip().splitlines()[-1])
        print(f"{name:20s} {r['seconds']:.2f} s/step  peak {r['peak_mb']:,.0f} MB  weights + AdamW state "
              f"{r['held_mb']:,.0f} MB  trained parameters "
              f"{r['trained']:,}  ({r['tokens']} tokens/step, {args.threads} threads, algo={args.algo}, "
              f"{args.model})", flush=True)
    if "full fp32" in results:
        full, lora = results["full fp32"], results["lora fp32 base"]
        print(f"lora_vs_full_memory={lora['peak_mb'] / full['peak_mb']:.2f} "
              f"lora_vs_full_step={lora['seconds'] / full['seconds']:.2f}")


if __name__ == "__main__":
    main()
