"""Shared by the benchmarks: the model, prompts from the default task, a matmul peak measured in-run, and the
median of times some of which never came."""
import os
import statistics
import subprocess
import sys
import time

import torch

from launch.summary import completed
from trainer.peak import matmul_peak_flops  # noqa: F401  (moved there: the run's metrics use it too)

_REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def copy_bandwidth(megabytes: int = 512, repeats: int = 5) -> float:
    """Bytes/s of a large tensor copy with the current thread count, counted as bytes read + bytes written
    (STREAM's copy convention): the memory ceiling a decode step that reads every weight is held to."""
    src = torch.ones(megabytes * 2**20 // 4)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch
    start = time.perf_counter()
    for _ in range(repeats):
        dst.copy_(src)
    return 2 * src.numel() * 4 * repeats / (time.perf_counter() - start)


def bench_dtypes(choice: str) -> list[str]:
    """`--dtypes`: `auto` is fp32, and bf16 where this CPU computes it natively (AVX-512; launch/plan.py):
    without it a bf16 matmul takes a generic loop about 100x slower than fp32, and a bench in bf16 would run
    for hours. Else a comma-separated list of fp32 and bf16, run as asked."""
    from launch.plan import native_bf16

    if choice == "auto":
        if native_bf16("cpu"):
            return ["fp32", "bf16"]
        print("this CPU has no native bf16 (no AVX-512): fp32 only, the precision a run picks here "
              "(--dtypes fp32,bf16 forces bf16)")
        return ["fp32"]
    dtypes = choice.split(",")
    if not dtypes or not set(dtypes) <= {"fp32", "bf16"}:
        sys.exit(f"error: --dtypes {choice!r}: write auto, fp32, bf16 or fp32,bf16")
    return dtypes


def model_matmul_flops(config, tokens: int, dtype: torch.dtype, repeats: int = 5) -> float:
    """FLOP/s of the matmuls one training step of this model does ([tokens, d] by each projection: forward,
    input gradient, weight gradient), timed one shape at a time: the most a step could reach if everything
    around the matmuls were free. Narrow models run far below the square-matmul peak."""
    d, ff, kv = config.hidden_size, config.intermediate_size, config.num_key_value_heads * config.head_dim
    shapes = [(d, d), (d, kv), (d, kv), (d, d), (d, ff), (d, ff), (ff, d)]  # q k v o gate up down
    flops = seconds = 0.0
    for count, (k, n) in ([(config.num_hidden_layers, shape) for shape in shapes]
                          + [(1, (d, config.vocab_size))]):
        x, w, g = (torch.randn(tokens, k, dtype=dtype), torch.randn(n, k, dtype=dtype),
                   torch.randn(tokens, n, dtype=dtype))
        for matmul in (lambda: x @ w.t(), lambda: g @ w, lambda: g.t() @ x):
            matmul()
            start = time.perf_counter()
            for _ in range(repeats):
                matmul()
            seconds += count * (time.perf_counter() - start) / repeats
            flops += count * 2 * tokens * k * n
    return flops / seconds


def load(model_path: str = "smollm2-135m"):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from models.loader import resolve

    path = resolve(model_path)
    return (AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval(),
            AutoTokenizer.from_pretrained(path))


def task_prompts(tokenizer, n: int, seed: int = 0) -> list[list[int]]:
    """n prompts of the default task (distinct questions, so completions end at different lengths)."""
    import tasks
    from tasks.arithmetic import Config, build

    task = build(Config(), seed)
    examples = (task.train * (n // len(task.train) + 1))[:n]
    return [tasks.prompt_ids(tokenizer, ex.question) for ex in examples]


def median(values: list):
    """The median, `None` (never reached the bar) counting as slower than any time."""
    ranked = sorted(values, key=lambda v: float("inf") if v is None else v)
    if len(ranked) % 2:
        return ranked[(len(ranked) - 1) // 2]
    pair = ranked[len(ranked) // 2 - 1:len(ranked) // 2 + 1]
    return None if None in pair else statistics.median(pair)


def parse_vary(texts: list[str], reserved: tuple[str, ...]) -> dict[str, list[str]]:
    """`--vary 'name=key=value key=value'` -> {name: overrides}; a name must be new and not one of
    `reserved`."""
    out = {}
    for text in texts:
        name, _, overrides = text.partition("=")
        if not name or "=" not in overrides or name in reserved or name in out:
            sys.exit(f"error: --vary {text!r}: write 'name=key=value [key=value ...]' with a new name")
        out[name] = overrides.split()
    return out


def baseline_tree(out: str, commit: str) -> str:
    """A checkout of `commit` (a detached git worktree under `out`, made once) to run the baseline from."""
    sha = subprocess.run(["git", "rev-parse", "--verify", f"{commit}^{{commit}}"], cwd=_REPO,
                         capture_output=True, text=True)
    if sha.returncode != 0:
        sys.exit(f"error: --baseline {commit}: not a commit of this repository (git log "
                 "--oneline lists them)")
    path = os.path.join(os.path.abspath(out), f"src_{sha.stdout.strip()[:12]}")
    if not os.path.exists(os.path.join(path, "train.py")):
        subprocess.run(["git", "worktree", "prune"], cwd=_REPO, check=True)
        subprocess.run(["git", "worktree", "add", "--detach", path, sha.stdout.strip()], cwd=_REPO,
                       check=True, capture_output=True)
    return path


def train_run(folder: str, args: list[str], steps: int, root: str = _REPO) -> None:
    """`python train.py <args> steps=<steps>` into `folder`, from the source tree `root` (a baseline's
    worktree, or this one), unless a run there already completed them (a benchmark stopped part way reruns
    only the rest). A failed run ends the benchmark with its error."""
    if completed(folder, steps):
        return
    cmd = [sys.executable, os.path.join(root, "train.py"), *args, f"steps={steps}", f"hydra.run.dir={folder}"]
    print(" ".join(cmd[1:]), flush=True)
    result = subprocess.run(cmd, cwd=root, capture_output=True, text=True)
    if result.returncode != 0:
        sys.exit(f"error: {' '.join(args)} failed:\n{result.stderr[-2000:]}")
