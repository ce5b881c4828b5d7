"""The ceiling a learner step is held to: the FLOP/s of a square matmul, measured in the process that trains
(bench/ uses the same function), and the step's model FLOPs utilisation against it."""
import time

import torch


def matmul_peak_flops(dtype: torch.dtype, n: int = 2048, repeats: int = 10, device: str = "cpu") -> float:
    """FLOP/s of an n x n matmul in `dtype` on `device` (on the CPU with the current thread count): the hardware
    ceiling we compare to. A GPU needs a larger n (8192) for its matmul units to be the bound, not the launches."""
    device = torch.device(device)
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    cuda = device.type == "cuda"  # its kernels run asynchronously: time from an idle GPU to the last one's end
    a @ b
    if cuda:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    if cuda:
        torch.cuda.synchronize(device)
    return 2 * n**3 * repeats / (time.perf_counter() - start)


def learner_peak(device: torch.device, autocast: str) -> float:
    """The peak the run's `perf/learner_mfu` divides by, in the step's compute dtype (bf16 under autocast, and on a
    GPU, where FSDP2 computes in bf16; else fp32). On the CPU: the FLOP/s of one thread (a 1024-square matmul, about
    0.1-0.9 s), since a step's thread count changes with the phase and a matmul's peak grows about linearly with
    threads; on a GPU: the whole device's (8192-square)."""
    dtype = torch.bfloat16 if autocast == "bfloat16" or device.type == "cuda" else torch.float32
    if device.type == "cuda":
        return matmul_peak_flops(dtype, n=8192, repeats=10, device=str(device))
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return matmul_peak_flops(dtype, n=1024, repeats=20)
    finally:
        torch.set_num_threads(threads)


def learner_mfu(params: int, tokens: int, seconds: float, peak: float, threads: float, ranks: int) -> float:
    """6 x parameters FLOPs a token processed (forward and backward), over the step's time, against `peak` x the
    step's mean thread count (CPU; pass 1 on a GPU) x the trainer ranks."""
    return 6 * params * tokens / max(seconds, 1e-9) / (peak * threads * ranks)
