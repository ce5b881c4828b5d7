"""The GPU plan's weight path into a built-in engine, against one device-to-device copy of the same bytes.

    python -m bench.gpu_weights --tokenizer DIR [--model qwen2.5-0.5b] [--device cuda] [--reps 3]
        [--bucket-mb 512] [--out bench_out/models] [--json FILE]

This process is trainer rank 0 (`GPUPlacement`: FSDP2 on one rank); a spawned child is a rollout worker with a
built-in engine on the same device, loading each version through `GPUWeights`' `sync()` (the engine contract's
`load_bucket`).
A version's time is `publish(full_state(policy), version)`: gather the full weights, cast them to the engine's
dtype into buckets of `--bucket-mb`, hand each bucket over (CUDA IPC on cuda, shared memory on the CPU) and
wait until the engine has copied it in and acked. Versions 1..`--reps`; the first is warm-up (IPC handles,
allocator). Then `--reps` more versions with the publish's phases timed (`Publisher.publish(phases=...)`,
which synchronises the device between phases, so these are not the headline): a fresh bucket (alloc), the full
tensors (gather: full_state's collectives and copies), the cast into buckets (pack), the queue send
(hand-off), the engine's load until its ack (acks), and the engine's own `load_bucket` seconds; each version
also counts the all-gathers this process made (torch.distributed's and `DTensor.full_tensor`'s). The yardstick
is one `copy_` of all those bytes (the engine dtype's bytes of every weight shipped) within the device, timed
here: the least a weight update must move. Ends with
`weights_vs_memcpy=<median publish seconds / copy seconds>`.
"""
import argparse
import json
import multiprocessing
import queue
import statistics
import time
from contextlib import contextmanager
from unittest import mock

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from bench.shapes import add_model_arguments, random_model
from engines.buckets import WeightChannel, weight_specs
from engines.builtin import BuiltinEngine, BuiltinEngineSpec
from engines.weight_sync import GPUWeights
from launch.plan import free_port
from runtime.shared import stop_when_dead
from trainer.gpu_policy import GPUPlacement
from trainer.policy import full_state

CHILD_START_S = 600  # the child loads the model and builds its engine before it reports ready
VERSION_S = 600  # a version must be loaded in this long, or the benchmark gives up
# A publish's phases, in the order they come (engines/buckets.py Stopwatch); rest: its time outside them (the
# last bucket freed, the calls in between)
PHASES = ("alloc", "gather", "pack", "hand-off", "acks", "rest")


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":  # kernels run asynchronously: a timing ends when the last one has
        torch.cuda.synchronize(device)


def follow(weights: GPUWeights, path: str, device: str, dtype: torch.dtype, reps: int, loaded) -> None:
    """The rollout worker's side, in the child: an engine of its own, loading versions 1..reps by `sync()`.
    Puts (version, seconds of the sync() call that loaded it, seconds in its load_bucket calls) on `loaded`,
    and (0, 0.0, 0.0) once it is ready."""
    from transformers import AutoModelForCausalLM

    on = torch.device(device)
    if on.type == "cuda":
        torch.cuda.set_device(on)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    # no decoding: a small cache
    engine = BuiltinEngine(model, max_batch=1, max_len=64, seed=0, dtype=dtype, device=on)
    del model
    load_s, load_bucket = [0.0], engine.load_bucket

    def timed_load(message):  # the built-in engine's load_bucket waits for its copies: its time is the load's
        start = time.perf_counter()
        load_bucket(message)
        load_s[0] += time.perf_counter() - start

    engine.load_bucket = timed_load
    sync = weights.follower(engine, 0)
    loaded.put((0, 0.0, 0.0))
    parent = multiprocessing.parent_process()
    for version in range(1, reps + 1):
        load_s[0] = 0.0
        while engine.version != version:
            start = time.perf_counter()
            sync()  # as a rollout worker calls it between decode steps: returns at once while nothing arrived
            seconds = time.perf_counter() - start
            if not parent.is_alive():  # the benchmark died: do not spin on
                return
        loaded.put((version, seconds, load_s[0]))


def wait_for(loaded, child, version: int, timeout_s: float) -> tuple[float, float]:
    """The child's report that `version` is loaded (0: ready), unless it died first: (seconds of the sync()
    that loaded it, seconds of its load_bucket calls)."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            got, seconds, load_s = loaded.get(timeout=1.0)
        except queue.Empty:
            if not child.is_alive():
                raise RuntimeError(f"the engine process exited (code {child.exitcode}) before "
                                   f"version {version}")
            continue
        if got != version:
            raise RuntimeError(f"the engine reported version {got}, expected {version}")
        return seconds, load_s
    raise RuntimeError(f"the engine did not report version {version} within {timeout_s:.0f} s")


@contextmanager
def counted_gathers():
    """Inside: a function that says how many all-gathers this process has entered: torch.distributed's (what
    trainer/gather.py calls) and `DTensor.full_tensor`'s (one collective of its own each)."""
    with (mock.patch.object(dist, "all_gather_single", wraps=dist.all_gather_single) as single,
          mock.patch.object(dist, "all_gather", wraps=dist.all_gather) as gather,
          mock.patch.object(DTensor, "full_tensor", autospec=True, side_effect=DTensor.full_tensor) as full):
        yield lambda: single.call_count + gather.call_count + full.call_count


def one_version(publish, policy, version: int, device: torch.device, loaded, child, timed: bool) -> dict:
    """Publish `version` and wait for the engine's word that it is loaded: the publish's seconds, the engine's
    sync() and load_bucket seconds, the all-gathers made, and (`timed`) the seconds of each phase."""
    phases = {} if timed else None
    with counted_gathers() as gathers:
        synchronize(device)
        start = time.perf_counter()
        publish(full_state(policy), version, phases=phases)  # returns once the engine has acked every bucket
        synchronize(device)
        seconds = time.perf_counter() - start
    if timed:
        phases["rest"] = seconds - sum(phases.values())
    sync_s, load_s = wait_for(loaded, child, version, VERSION_S)
    return {"publish_s": seconds, "sync_s": sync_s, "load_bucket_s": load_s, "collectives": gathers(),
            "phases": phases}


def copy_seconds(nbytes: int, device: torch.device, repeats: int = 5) -> float:
    """Median time of one copy_ of `nbytes` bytes from one buffer to another on `device`."""
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # warm-up
    times = []
    for _ in range(repeats):
        synchronize(device)
        start = time.perf_counter()
        dst.copy_(src)
        synchronize(device)
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    add_model_arguments(parser)
    parser.add_argument("--reps", type=int, default=3,
                        help="versions published (the first is warm-up), then as many with "
                             "their phases timed")
    parser.add_argument("--bucket-mb", type=int, default=512, help="weight-sync bucket (cluster.bucket_mb)")
    args = parser.parse_args()
    if args.reps < 2:
        parser.error("--reps must be >= 2: the first version is warm-up")

    path = random_model(args.model, args.tokenizer, args.out)
    placement = GPUPlacement(gpu=0, device_type=args.device)
    device = placement.device
    # the engine's weights, as the plan sets them
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
    ctx = multiprocessing.get_context("spawn")
    placement.init_process_group(0, 1, free_port())
    try:
        policy = placement.load(path, 1)
        weights = GPUWeights(WeightChannel(1, ctx), [1], BuiltinEngineSpec.bucket_payloads, "ipc",
                             args.bucket_mb << 20, dtype)
        # What publish ships: every floating-point weight once (a tied lm_head is the embedding), in the
        # engine dtype.
        specs = weight_specs(policy.state_dict().items(), policy.lm.config.tie_word_embeddings, dtype)
        nbytes = sum(shape.numel() * kind.itemsize for _, shape, kind in specs)
        print(f"{args.model} (random weights): {len(specs)} tensors, {nbytes / 2**20:.1f} MiB in {dtype}, "
              f"buckets of {args.bucket_mb} MiB, trainer (FSDP2, this process) -> built-in engine (a spawned "
              f"process) on {device}")
        loaded = ctx.Queue()
        # daemon: should this process die, the child goes with it
        child = ctx.Process(target=follow, args=(weights, path, str(device), dtype, 2 * args.reps, loaded),
                            daemon=True)
        child.start()
        # a dead engine: no 600 s wait for acks
        publish = weights.publisher(policy, True, stop_when_dead(child))
        try:
            wait_for(loaded, child, 0, CHILD_START_S)
            plain, timed = [], []
            for version in range(1, 2 * args.reps + 1):
                row = one_version(publish, policy, version, device, loaded, child, timed=version > args.reps)
                (timed if row["phases"] is not None else plain).append(row)
                if row["phases"] is None:
                    print(f"version {version}: publish {row['publish_s'] * 1e3:8.1f} ms, "
                          f"{row['collectives']} all-gathers; engine's sync() {row['sync_s'] * 1e3:8.1f} ms, "
                          f"its load_bucket {row['load_bucket_s'] * 1e3:8.1f} ms"
                          f"{'  (warm-up)' if version == 1 else ''}")
                else:
                    print(f"version {version}, phases timed: publish {row['publish_s'] * 1e3:8.1f} ms = "
                          + ", ".join(f"{p} {row['phases'].get(p, 0.0) * 1e3:.2f}" for p in PHASES)
                          + f" ms; engine's load_bucket {row['load_bucket_s'] * 1e3:.2f} ms")
            copy_s = copy_seconds(nbytes, device)
        finally:
            weights.channel.close()
            child.join(timeout=60)
            if child.is_alive():  # only on a failure above: it still waits for a version that will not come
                child.terminate()
                child.join()
            loaded.close()
            loaded.join_thread()
    finally:
        dist.destroy_process_group()
    median = statistics.median(row["publish_s"] for row in plain[1:])
    ratio = median / copy_s
    phases = {p: statistics.median(row["phases"].get(p, 0.0) for row in timed) for p in PHASES}
    load_s = statistics.median(row["load_bucket_s"] for row in timed)
    collectives = max(row["collectives"] for row in plain + timed)
    print(f"publish, median of {len(plain) - 1}: {median * 1e3:.1f} ms ({nbytes / median / 1e9:.2f} GB/s), "
          f"at most {collectives} all-gathers  one copy_ of {nbytes / 2**20:.1f} MiB: {copy_s * 1e3:.2f} ms "
          f"({nbytes / copy_s / 1e9:.2f} GB/s)")
    print(f"phases, median of {len(timed)}: " + ", ".join(f"{p} {s * 1e3:.2f}" for p, s in phases.items())
          + f" ms; engine's load_bucket {load_s * 1e3:.2f} ms")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "gpu_weights", "model": args.model, "device": str(device),
                       "dtype": str(dtype), "bucket_mb": args.bucket_mb, "bytes": nbytes,
                       "publish_seconds": [row["publish_s"] for row in plain],
                       "engine_sync_seconds": [row["sync_s"] for row in plain],
                       "publish_median_s": median, "copy_s": copy_s, "collectives_per_publish": collectives,
                       "phases_median_s": phases, "engine_load_bucket_median_s": load_s,
                       "phased_publish_seconds": [row["publish_s"] for row in timed],
                       "weights_vs_memcpy": ratio}, f)
    print(f"weights_vs_memcpy={ratio:.2f}")


if __name__ == "__main__":
    main()
