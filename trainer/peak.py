"""The ceiling a learner step is held to: the FLOP/s of a square matmul (bench/ uses the same function), and
the step's model FLOPs utilisation against it."""
import time
from dataclasses import dataclass

import torch


def matmul_peak_flops(dtype: torch.dtype, n: int = 2048, repeats: int = 10, device: str = "cpu") -> float:
    """FLOP/s of an n x n matmul in `dtype` on `device` (on the CPU with the current thread count): the
    hardware ceiling we compare to. A GPU needs a larger n (8192) for its matmul units to be the bound, not
    the launches."""
    device = torch.device(device)
    a, b = torch.randn(n, n, dtype=dtype, device=device), torch.randn(n, n, dtype=dtype, device=device)
    # its kernels run asynchronously: time from an idle GPU to the last one's end
    cuda = device.type == "cuda"
    a @ b
    if cuda:
        torch.cuda.synchronize(device)
    start = time.perf_counter()
    for _ in range(repeats):
        a @ b
    if cuda:
        torch.cuda.synchronize(device)
    return 2 * n**3 * repeats / (time.perf_counter() - start)


@dataclass(frozen=True)
class Peak:
    """Matmul FLOP/s by thread count, measured at a few counts: a CPU step's count changes with the phase, and
    its peak does not grow linearly with threads (1 thread 71, 2 threads 105 GFLOP/s in fp32 on a 2-core
    AMD EPYC)."""
    rates: tuple[tuple[int, float], ...]  # (threads, FLOP/s), fewest threads first

    def at(self, threads: float) -> float:
        """The peak at a (time-weighted, so fractional) thread count: linear between the measured counts, and
        proportional to the threads outside them."""
        (lo, lo_rate), (hi, hi_rate) = self.rates[0], self.rates[-1]
        if threads <= lo:
            return lo_rate * threads / lo
        if threads >= hi:
            return hi_rate * threads / hi
        for (a, rate_a), (b, rate_b) in zip(self.rates, self.rates[1:]):
            if a <= threads <= b:
                return rate_a + (rate_b - rate_a) * (threads - a) / (b - a)
        raise AssertionError("rates are sorted by thread count")


def cpu_peak(dtype: torch.dtype, most_threads: int, budget_s: float = 0.3) -> Peak:
    """The CPU's matmul peak at 1 and `most_threads` threads. Call it before any other process computes: under
    load it reads low, and a step's utilisation against it reads high (above 1, seen when the trainer measured
    it while the rollout worker generated its first batch). About `budget_s` a count; the thread count is
    restored."""
    threads = torch.get_num_threads()
    rates = []
    try:
        for count in sorted({1, max(1, most_threads)}):
            torch.set_num_threads(count)
            rates.append((count, _timed_rate(dtype, budget_s)))
    finally:
        torch.set_num_threads(threads)
    return Peak(tuple(rates))


def _timed_rate(dtype: torch.dtype, budget_s: float) -> float:
    """A square matmul's FLOP/s over about `budget_s`: 1024 rows where one takes at most a sixteenth of the
    budget, else 256 (bf16 without AVX-512 has no fast kernel: a 1024 one takes seconds there)."""
    n = 256
    a = torch.randn(n, n, dtype=dtype)
    a @ a  # the first call pays the library's set-up
    start = time.perf_counter()
    a @ a
    if (time.perf_counter() - start) * (1024 // n) ** 3 <= budget_s / 16:
        n = 1024
        a = torch.randn(n, n, dtype=dtype)
        a @ a
    best, end = 0.0, time.perf_counter() + budget_s
    # the best of short windows: a shared VM's noise and a pool's start read low
    while time.perf_counter() < end:
        count, start = 0, time.perf_counter()
        while count == 0 or time.perf_counter() - start < budget_s / 8:
            a @ a
            count += 1
        best = max(best, 2 * n**3 * count / (time.perf_counter() - start))
    return best


def learner_peak(device: torch.device, autocast: str, most_threads: int = 1) -> Peak:
    """The peak a run's `perf/learner_mfu` divides by, in the step's compute dtype (bf16 under autocast, and
    on a GPU, where FSDP2 computes in bf16; else fp32). A GPU's is the whole device's (an 8192-square matmul);
    a CPU's is `cpu_peak`'s, which the launcher measures before it starts any process (train.py)."""
    if device.type == "cuda":
        return Peak(((1, matmul_peak_flops(torch.bfloat16, n=8192, repeats=10, device=str(device))),))
    return cpu_peak(torch.bfloat16 if autocast == "bfloat16" else torch.float32, most_threads)


def learner_mfu(flops_per_token: int, tokens: int, seconds: float, peak: Peak, threads: float,
                ranks: int) -> float:
    """The model FLOPs of the tokens processed (trainer/policy.py `train_flops_per_token`: 6 x parameters when
    every weight trains), over the step's time, against the peak at the step's mean thread count
    (CPU; pass 1 on a GPU) times the trainer ranks."""
    return flops_per_token * tokens / max(seconds, 1e-9) / (peak.at(threads) * ranks)
