"""Start-up: the wall-clock of a whole short run, from the command to its exit, against a baseline commit.

    python -m bench.startup [--baseline 0a3b37f] [--runs 5] [--shape tiny|default] [--out bench_out/startup]

`--shape tiny` (the default) is the end-to-end tests' run: a random 2-layer Llama with SmolLM2's tokenizer
(written under --out, from the default model's folder) and the tests' settings (tests/helpers.py TINY), 2
steps. Nearly all of its time is start-up (the launcher's set-up, each process's imports and set-up) and the
end (the last evaluation, a checkpoint, the summary and curves), which every end-to-end test pays once a run.
`--shape default` is `python train.py steps=1` with the last evaluation cut to one example and no checkpoint:
what a user waits for around a real run's first step.

Runs alternate between this tree (`now`) and a git worktree of --baseline, so that the machine's drift falls
on both. Prints each setting's median and range of wall seconds, and ends with `startup_now_s=`,
`startup_baseline_s=` and `startup_now_vs_baseline=<baseline's median / now's>` (above 1: now starts faster).
"""
import argparse
import os
import shutil
import subprocess
import sys
import time

from bench.common import baseline_tree, median

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BASELINE = "0a3b37f"  # the commit before the forkserver (launch/forkserver.py)
TINY = ["rollout.group_size=4", "rollout.max_new_tokens=8", "rollout.max_batch=16", "train.batch_groups=2",
        "train.micro_groups=2", "steps=2"]  # tests/helpers.py TINY, and the tests' usual 2 steps
DEFAULT = ["steps=1", "eval.every=0", "eval.k=1", "eval.max_examples=1", "checkpoint.at_end=false"]


def tiny_model(folder: str) -> str:
    """A random Llama of SmolLM2's architecture, 2 layers of width 64, with SmolLM2's tokenizer (as
    tests/conftest.py makes it); written once."""
    if os.path.exists(os.path.join(folder, "config.json")):
        return folder
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    from models.loader import resolve

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                         max_position_embeddings=512, rms_norm_eps=1e-5, rope_theta=100000.0,
                         tie_word_embeddings=True, bos_token_id=1, eos_token_id=2, pad_token_id=2)
    LlamaForCausalLM(config).save_pretrained(folder)
    AutoTokenizer.from_pretrained(resolve("smollm2-135m")).save_pretrained(folder)
    return folder


def timed_run(root: str, args: list[str], run_dir: str) -> float:
    """Seconds from starting `python train.py <args>` in `root` to its exit; a failed run ends the
    benchmark."""
    shutil.rmtree(run_dir, ignore_errors=True)  # a fresh run each time, not a rerun's resume or append
    cmd = [sys.executable, os.path.join(root, "train.py"), *args, f"hydra.run.dir={run_dir}",
           "progress=false"]
    start = time.monotonic()
    result = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
    took = time.monotonic() - start
    if result.returncode != 0:
        sys.exit(f"error: {' '.join(cmd[1:])} failed:\n{result.stderr[-2000:]}")
    return took


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline", default=BASELINE,
                        help="the commit to compare with (default: %(default)s)")
    parser.add_argument("--runs", type=int, default=5, help="runs of each setting, alternated (default: 5)")
    parser.add_argument("--shape", choices=("tiny", "default"), default="tiny")
    parser.add_argument("--out", default="bench_out/startup")
    args = parser.parse_args()
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)
    overrides = [f"model.path={tiny_model(os.path.join(out, 'tiny_model'))}", *TINY] if args.shape == "tiny" \
        else DEFAULT
    trees = {"now": ROOT, "baseline": baseline_tree(out, args.baseline)}
    walls: dict[str, list[float]] = {name: [] for name in trees}
    for i in range(args.runs):
        for name, root in trees.items():
            walls[name].append(timed_run(root, overrides, os.path.join(out, "runs", f"{name}_{i}")))
            print(f"{name} run {i + 1}: {walls[name][-1]:.1f} s", flush=True)
    print(f"\n{args.shape} run, {args.runs} runs each, alternated (wall s):")
    for name, values in walls.items():
        print(f"  {name:>8}: median {median(values):.1f} (range {min(values):.1f}-{max(values):.1f})")
    print(f"startup_now_s={median(walls['now']):.1f}")
    print(f"startup_baseline_s={median(walls['baseline']):.1f}")
    print(f"startup_now_vs_baseline={median(walls['baseline']) / median(walls['now']):.2f}")


if __name__ == "__main__":
    main()
