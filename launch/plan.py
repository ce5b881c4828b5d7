"""The device plan: where generation and training run."""
import os


def device_plan(plan: str, num_gpus: int) -> str:
    """`cpu`, or `gpu` (SGLang engines + FSDP2/NCCL ranks, laid out by launch/layout.py). `auto` stays on the CPU
    until the GPU launch path is wired into train.py; its parts live in engines/sglang.py, engines/weight_sync.py
    and trainer/gpu_policy.py (docs/gpu.md)."""
    if plan == "gpu":
        if num_gpus == 0:
            raise ValueError("cluster.plan=gpu needs CUDA GPUs and torch sees none; use cluster=cpu")
        raise ValueError("cluster.plan=gpu: the GPU launch path is not wired into train.py yet (docs/gpu.md lists "
                         "what exists); use cluster=cpu")
    return "cpu"


def pin_threads(threads: int) -> None:
    """Before spawning: children inherit these, so each process uses `threads` cores and no more."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(threads)
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")  # one progress bar (ours), not one per load
