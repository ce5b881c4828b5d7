"""Moving data between processes, against one plain copy of the same bytes measured in the same run.

    python -m bench.transport [--seconds 1.0] [--threads 1] [--reps 5]

Ring: a producer process streams groups through the trajectory ring to this process, for three group sizes.
`ring/copy_` divides the payload bytes/s delivered end to end by those of one `dst.copy_(src)` of a group's
bytes in one process (the target is 0.5). A put and a get each copy the payload once, in two processes: only
when they run on two free cores do the copies overlap. `handoff` runs the same two processes with nothing but
a shared buffer, a semaphore each way, one copy_ in and one clone out: the most any ring could reach on this
machine at this moment, so `ring/handoff` is the ring's own cost. Small groups are bound by the ring's fixed
cost per group (`us/group`: about 20 us of Python calls on each side), not by bytes; the bandwidth figure
`ring_vs_copy` is the large case's, where bytes dominate.

Weights: a child process publishes SmolLM2-135M's fp32 state dict (random values) to the weight store and this
process reads it into its own tensors, as the trainer and a rollout worker do; each is timed and compared with
one `copy_` of the same bytes. Ends with `ring_vs_copy=<large case ring/copy_>` (the target is >= 0.5) and
`weights_vs_memcpy=<(publish + read) / copy_>` (the target is <= 3).
"""
import argparse
import os
import statistics
import time

import torch
import torch.multiprocessing as mp

from buffer.ring import Group, TrajectoryRing
from engines.weights import WeightStore

# (name, K, new tokens, prompt tokens): the default run, a GSM8K-like run, and long completions.
RING_CASES = [("default", 8, 16, 40), ("gsm8k-like", 8, 512, 200), ("large", 16, 4096, 200)]
RING_SLOTS = 25  # the default run's ring: (max_staleness + 1) * batch_groups + rollout_workers


def make_group(k: int, new_tokens: int, prompt_len: int) -> Group:
    return Group(prompt_ids=torch.randint(0, 49152, (prompt_len,)),
                 completion_ids=torch.randint(0, 49152, (k, new_tokens)),
                 completion_lens=torch.full((k,), new_tokens), logprobs=-torch.rand(k, new_tokens),
                 versions=torch.randint(0, 8, (k, new_tokens)), rewards=torch.rand(k),
                 truncated=torch.zeros(k, dtype=torch.bool), prompt_index=0, group_id=0, worker_id=0)


def payload_bytes(group: Group) -> int:
    return sum(t.nbytes for t in (group.prompt_ids, group.completion_ids, group.completion_lens,
                                  group.logprobs, group.versions, group.rewards, group.truncated))


def _stream_groups(ring: TrajectoryRing, case: tuple, threads: int, stop):
    torch.set_num_threads(threads)
    group = make_group(*case[1:])
    while not stop.is_set():
        ring.put(group, timeout=0.1)
        group.group_id += 1


def _stream_bytes(slots: torch.Tensor, free, ready, threads: int, stop):
    torch.set_num_threads(threads)
    src = torch.randint(0, 256, slots.shape[1:], dtype=torch.uint8)
    sent = 0
    while not stop.is_set():
        if free.acquire(timeout=0.1):
            slots[sent % len(slots)].copy_(src)
            ready.release()
            sent += 1


def ring_rates(ctx, case: tuple, seconds: float, threads: int, rounds: int = 4) -> dict[str, float]:
    """Payload bytes/s of the ring, of the bare handoff, and of copy_, measured in turns so that all three
    see the same load from the rest of the machine. A producer idles (blocked) while its turn is not on."""
    _, k, new_tokens, prompt_len = case
    nbytes = payload_bytes(make_group(k, new_tokens, prompt_len))
    ring = TrajectoryRing(RING_SLOTS, k, prompt_len, new_tokens, ctx=ctx)
    slots = torch.zeros(RING_SLOTS, nbytes, dtype=torch.uint8).share_memory_()
    free, ready, stop = ctx.Semaphore(RING_SLOTS), ctx.Semaphore(0), ctx.Event()
    producers = [ctx.Process(target=_stream_groups, args=(ring, case, threads, stop), daemon=True),
                 ctx.Process(target=_stream_bytes, args=(slots, free, ready, threads, stop), daemon=True)]
    for p in producers:
        p.start()
    src, dst = torch.randint(0, 256, (nbytes,), dtype=torch.uint8), torch.zeros(nbytes, dtype=torch.uint8)

    handed = 0

    def take_ring():
        assert ring.get(timeout=120) is not None, "the ring's producer stopped"

    def take_handoff():
        nonlocal handed
        assert ready.acquire(timeout=120), "the handoff's producer stopped"
        slots[handed % RING_SLOTS].clone()  # the slot filled longest ago, as the producer fills them in turn
        handed += 1
        free.release()

    takes = {"ring": take_ring, "handoff": take_handoff, "copy_": lambda: dst.copy_(src)}
    count, elapsed = dict.fromkeys(takes, 0), dict.fromkeys(takes, 0.0)
    for _ in range(rounds):
        for name, take in takes.items():
            for _ in range(RING_SLOTS):  # untimed: what piled up while it waited, and the producer's wake-up
                take()
            start = time.perf_counter()
            while time.perf_counter() - start < seconds / rounds:
                take()
                count[name] += 1
            elapsed[name] += time.perf_counter() - start
    stop.set()  # a producer blocked on a full buffer sees it within its 0.1 s timeout
    for p in producers:
        p.join(10)
    return {name: count[name] * nbytes / elapsed[name] for name in takes}


def _publish(store: WeightStore, shapes: dict, threads: int, go, done, times: torch.Tensor):
    torch.set_num_threads(threads)
    weights = {name: torch.empty(shape).uniform_() for name, shape in shapes.items()}
    for rep in range(len(times)):
        go.wait()
        go.clear()
        start = time.perf_counter()
        store.publish(weights.items(), version=rep + 1)
        times[rep] = time.perf_counter() - start
        done.set()
    go.wait()  # exit (and unmap everything) only after the last read, not during it


def weight_times(ctx, reps: int, threads: int) -> tuple[list, list, float, int]:
    """Seconds of each publish (other process) and read_into (this one), of one copy_ of the same bytes, and
    bytes."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from models.loader import resolve

    with torch.device("meta"):
        meta = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(resolve("smollm2-135m")))
    store = WeightStore.for_model(meta)
    shapes = {name: tuple(t.shape) for name, t in meta.state_dict().items() if name in store.names}
    nbytes = sum(4 * torch.Size(s).numel() for s in shapes.values())
    go, done = ctx.Event(), ctx.Event()
    publish_s = torch.zeros(reps, dtype=torch.float64).share_memory_()
    publisher = ctx.Process(target=_publish, args=(store, shapes, threads, go, done, publish_s), daemon=True)
    publisher.start()
    targets = {name: torch.zeros(shape) for name, shape in shapes.items()}
    read_s = []
    for rep in range(reps):
        go.set()
        assert done.wait(300), "publisher did not finish"
        done.clear()
        start = time.perf_counter()
        assert store.read_into(targets) == rep + 1
        read_s.append(time.perf_counter() - start)
    go.set()
    publisher.join(30)
    src = torch.cat([t.flatten() for t in targets.values()])
    del targets
    dst = torch.zeros_like(src)
    memcpy_s = []
    for _ in range(reps):
        start = time.perf_counter()
        dst.copy_(src)
        memcpy_s.append(time.perf_counter() - start)
    return publish_s.tolist(), read_s, memcpy_s, nbytes


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("--seconds", type=float, default=1.0,
                        help="measured time of each of ring, handoff, copy_ per case")
    parser.add_argument("--threads", type=int, default=1,
                        help="torch threads per process (the default run's)")
    parser.add_argument("--reps", type=int, default=5, help="weight publications")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    ctx = mp.get_context("spawn")

    print(f"{os.cpu_count()} cores, load average {os.getloadavg()[0]:.2f} before this run; {args.threads} "
          "torch thread(s) per process")
    print(f"ring: a producer process -> this process, {RING_SLOTS} slots; handoff: a bare shared buffer + "
          "semaphores, copy_ in, clone out; copy_: dst.copy_(src) of one group's bytes here. "
          f"{args.seconds:g} s each, in turns")
    print(f"{'case':11s} {'K':>3s} {'new':>5s} {'prompt':>6s} {'bytes/group':>11s} {'groups/s':>9s} "
          f"{'us/group':>8s} {'ring MB/s':>9s} {'copy_ MB/s':>10s} {'handoff MB/s':>12s} "
          f"{'ring/handoff':>12s} {'ring/copy_':>10s}")
    for case in RING_CASES:
        name, k, new_tokens, prompt_len = case
        nbytes = payload_bytes(make_group(k, new_tokens, prompt_len))
        rate = ring_rates(ctx, case, args.seconds, args.threads)
        ring, handoff, copy = rate["ring"], rate["handoff"], rate["copy_"]
        ring_vs_copy = ring / copy  # reported for the last case, the largest groups
        print(f"{name:11s} {k:3d} {new_tokens:5d} {prompt_len:6d} {nbytes:11d} {ring / nbytes:9.0f} "
              f"{1e6 * nbytes / ring:8.1f} {ring / 1e6:9.0f} {copy / 1e6:10.0f} {handoff / 1e6:12.0f} "
              f"{ring / handoff:12.2f} {ring / copy:10.2f}")

    publish_s, read_s, memcpy_s, nbytes = weight_times(ctx, args.reps, args.threads)
    # The first publish and read also map the shared pages into each process: steady state is the median
    # after.
    publish, read, memcpy = (statistics.median(times[1:]) for times in (publish_s, read_s, memcpy_s))
    print(f"weights: smollm2-135m fp32, {nbytes / 1e6:.0f} MB; publish in a child process, read_into here; "
          f"seconds per rep, then the median after the first")
    for name, times, median in (("publish", publish_s, publish), ("read_into", read_s, read),
                                ("copy_", memcpy_s, memcpy)):
        print(f"  {name:9s} " + " ".join(f"{t:.3f}" for t in times)
              + f"  -> {median:.3f} ({nbytes / median / 1e9:.1f} GB/s)")
    print(f"ring_vs_copy={ring_vs_copy:.2f}")
    print(f"weights_vs_memcpy={(publish + read) / memcpy:.2f}")


if __name__ == "__main__":
    main()
