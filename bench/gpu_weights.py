"""The GPU plan's weight path into a built-in engine, against one device-to-device copy of the same bytes.

    python -m bench.gpu_weights --tokenizer DIR [--model qwen2.5-0.5b] [--device cuda] [--reps 3]
        [--bucket-mb 512] [--out bench_out/models] [--json FILE]

This process is trainer rank 0 (`GPUPlacement`: FSDP2 on one rank); a spawned child is a rollout worker with a
built-in engine on the same device, loading each version through `GPUWeights`' `sync()` (the engine contract's
`load_bucket`).
A version's time is `publish(full_state(policy), version)`: gather the full weights, cast them to the engine's
dtype into buckets of `--bucket-mb`, hand each bucket over (CUDA IPC on cuda, shared memory on the CPU) and wait
until the engine has copied it in and acked. Versions 1..`--reps`; the first is warm-up (IPC handles, allocator).
The yardstick is one `copy_` of all those bytes (the engine dtype's bytes of every weight shipped) within the
device, timed here: the least a weight update must move. Ends with
`weights_vs_memcpy=<median publish seconds / copy seconds>`.
"""
import argparse
import json
import multiprocessing
import queue
import statistics
import time

import torch
import torch.distributed as dist

from bench.shapes import add_model_arguments, random_model
from engines.buckets import WeightChannel, weight_specs
from engines.builtin import BuiltinEngine, BuiltinEngineSpec
from engines.weight_sync import GPUWeights
from launch.plan import free_port
from launch.shared import stop_when_dead
from trainer.gpu_policy import GPUPlacement
from trainer.policy import full_state

CHILD_START_S = 600  # the child loads the model and builds its engine before it reports ready
VERSION_S = 600  # a version must be loaded in this long, or the benchmark gives up


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":  # kernels run asynchronously: a timing ends when the last one has
        torch.cuda.synchronize(device)


def follow(weights: GPUWeights, path: str, device: str, dtype: torch.dtype, reps: int, loaded) -> None:
    """The rollout worker's side, in the child: an engine of its own, loading versions 1..reps by `sync()`.
    Puts (version, seconds of the sync() call that loaded it) on `loaded`, and (0, 0.0) once it is ready."""
    from transformers import AutoModelForCausalLM

    on = torch.device(device)
    if on.type == "cuda":
        torch.cuda.set_device(on)
    model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    engine = BuiltinEngine(model, max_batch=1, max_len=64, seed=0, dtype=dtype, device=on)  # no decoding: a small cache
    del model
    sync = weights.follower(engine, 0)
    loaded.put((0, 0.0))
    parent = multiprocessing.parent_process()
    for version in range(1, reps + 1):
        while engine.version != version:
            start = time.perf_counter()
            sync()  # as a rollout worker calls it between decode steps: returns at once while nothing arrived
            seconds = time.perf_counter() - start
            if not parent.is_alive():  # the benchmark died: do not spin on
                return
        loaded.put((version, seconds))


def wait_for(loaded, child, version: int, timeout_s: float) -> float:
    """The child's report that `version` is loaded (0: ready), unless it died first."""
    deadline = time.time() + timeout_s
    while time.time() < deadline:
        try:
            got, seconds = loaded.get(timeout=1.0)
        except queue.Empty:
            if not child.is_alive():
                raise RuntimeError(f"the engine process exited (code {child.exitcode}) before version {version}")
            continue
        if got != version:
            raise RuntimeError(f"the engine reported version {got}, expected {version}")
        return seconds
    raise RuntimeError(f"the engine did not report version {version} within {timeout_s:.0f} s")


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
    parser.add_argument("--reps", type=int, default=3, help="versions published; the first is warm-up")
    parser.add_argument("--bucket-mb", type=int, default=512, help="weight-sync bucket (cluster.bucket_mb)")
    args = parser.parse_args()
    if args.reps < 2:
        parser.error("--reps must be >= 2: the first version is warm-up")

    path = random_model(args.model, args.tokenizer, args.out)
    placement = GPUPlacement(gpu=0, device_type=args.device)
    device = placement.device
    dtype = torch.bfloat16 if device.type == "cuda" else torch.float32  # the engine's weights, as the plan sets them
    ctx = multiprocessing.get_context("spawn")
    placement.init_process_group(0, 1, free_port())
    try:
        policy = placement.load(path, 1)
        weights = GPUWeights(WeightChannel(1, ctx), [1], BuiltinEngineSpec.bucket_payloads, "ipc",
                             args.bucket_mb << 20, dtype)
        # What publish ships: every floating-point weight once (a tied lm_head is the embedding), in the engine dtype.
        specs = weight_specs(policy.state_dict().items(), policy.lm.config.tie_word_embeddings, dtype)
        nbytes = sum(shape.numel() * kind.itemsize for _, shape, kind in specs)
        print(f"{args.model} (random weights): {len(specs)} tensors, {nbytes / 2**20:.1f} MiB in {dtype}, buckets of "
              f"{args.bucket_mb} MiB, trainer (FSDP2, this process) -> built-in engine (a spawned process) on {device}")
        loaded = ctx.Queue()
        # daemon: should this process die, the child goes with it
        child = ctx.Process(target=follow, args=(weights, path, str(device), dtype, args.reps, loaded), daemon=True)
        child.start()
        publish = weights.publisher(policy, True, stop_when_dead(child))  # a dead engine: no 600 s wait for acks
        try:
            wait_for(loaded, child, 0, CHILD_START_S)
            publish_s, sync_s = [], []
            for version in range(1, args.reps + 1):
                synchronize(device)
                start = time.perf_counter()
                publish(full_state(policy), version)  # returns once the engine has acked every bucket
                synchronize(device)
                publish_s.append(time.perf_counter() - start)
                sync_s.append(wait_for(loaded, child, version, VERSION_S))
                print(f"version {version}: publish {publish_s[-1] * 1e3:8.1f} ms, engine's sync() "
                      f"{sync_s[-1] * 1e3:8.1f} ms{'  (warm-up)' if version == 1 else ''}")
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
    median = statistics.median(publish_s[1:])
    ratio = median / copy_s
    print(f"publish, median of {len(publish_s) - 1}: {median * 1e3:.1f} ms ({nbytes / median / 1e9:.2f} GB/s)  "
          f"one copy_ of {nbytes / 2**20:.1f} MiB: {copy_s * 1e3:.2f} ms ({nbytes / copy_s / 1e9:.2f} GB/s)")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"benchmark": "gpu_weights", "model": args.model, "device": str(device), "dtype": str(dtype),
                       "bucket_mb": args.bucket_mb, "bytes": nbytes, "publish_seconds": publish_s,
                       "engine_sync_seconds": sync_s, "publish_median_s": median, "copy_s": copy_s,
                       "weights_vs_memcpy": ratio}, f)
    print(f"weights_vs_memcpy={ratio:.2f}")


if __name__ == "__main__":
    main()
