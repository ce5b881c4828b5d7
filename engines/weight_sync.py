"""The GPU plan's weight path: from the FSDP2 trainer to the engines after every optimizer step, in buckets
(`engines/buckets.py`), over CUDA IPC or NCCL.

- Trainer side (`Publisher`): every rank walks the weights (a collective); rank 0 fills a bucket, hands it to
  every engine in the form the engine kind asked for (its spec's `bucket_payloads`: CUDA IPC handles for
  SGLang, the tensor itself for the built-in engine) or broadcasts it over NCCL, and waits for every engine's
  ack before the next bucket: one bucket of extra GPU memory, and versions never interleave.
- Engine side (`receive_version`, an engine's `sync()`): through the engine contract only (engines/base.py):
  `begin_weights`, `load_bucket` for each bucket, `adopt_weights` at the last; this file names no engine.

Everything above the SGLang and NCCL calls is plain torch and tested on the CPU; sglang is imported lazily.
"""
from typing import Callable

import torch

from engines.buckets import (
    BucketMessage,
    Stopwatch,
    WeightChannel,
    engine_weights,
    plan_buckets,
    send_buckets,
    weight_specs,
)

RECEIVE_TIMEOUT_S = 600.0  # an engine waits this long for the next bucket of a version it has begun


class GPUWeights:
    """The GPU plan's weight path, built by the launcher and handed to every process (as the CPU plan hands
    out its WeightStore): a rollout worker takes `follower`, a trainer rank `publisher`.

    payloads: how a bucket travels to this plan's engines (their spec's `bucket_payloads`; the CPU tests pass
    plain bytes); mode: ipc (payloads through the queues) or nccl (a broadcast from rank 0); dtype: the
    engines' weights, which the buckets carry."""

    def __init__(self, channel: WeightChannel, engine_tp_sizes: list[int], payloads: Callable, mode: str,
                 bucket_bytes: int, dtype: torch.dtype, nccl_address: tuple[str, int] | None = None):
        if mode not in ("ipc", "nccl"):
            raise ValueError(f"weight sync mode must be ipc or nccl, got {mode!r}")
        self.channel, self.tp_sizes, self.payloads, self.mode = channel, list(engine_tp_sizes), payloads, mode
        self.bucket_bytes, self.dtype, self.nccl_address = bucket_bytes, dtype, nccl_address
        # per engine: it is up
        self.ready = torch.zeros(len(self.tp_sizes), dtype=torch.uint8).share_memory_()

    def follower(self, engine, index: int) -> Callable[[], list]:
        """Engine `index`'s end: `sync()` between steps loads a new version if rank 0 ships one; it returns
        the requests that finished meanwhile (an engine that interrupts its requests to load may finish
        some)."""
        self.ready[index] = 1  # before the NCCL join, which waits for rank 0, which may wait for this flag
        if self.mode == "nccl":
            engine.join_weight_group(*self.nccl_address, 1 + sum(self.tp_sizes[:index]),
                                     1 + sum(self.tp_sizes))
        return lambda: receive_version(engine, self.channel, index)

    def engines_ready(self) -> bool:
        return bool(self.ready.all())

    def publisher(self, policy, lead: bool, stop) -> Callable:
        """A trainer rank's end: `publish(tensors, version)`, called by every rank with the full weights. The
        buckets are planned from what the policy says it will stream (`published_shapes`: a LoRA model's
        merged weights), not from its state dict."""
        device = next(policy.parameters()).device
        return Publisher(self, policy.published_shapes(), policy.lm.config.tie_word_embeddings, lead, device,
                         stop).publish


class Publisher:
    """Trainer side of a weight sync: every rank calls `publish` (the gathers are collectives); rank 0 ships.
    Once `stop` is set rank 0 ships nothing more but still walks the weights, so the other ranks' gathers
    end."""

    def __init__(self, path: GPUWeights, named, tied: bool, lead: bool, device, stop=None,
                 group_name: str = "ringrl-weights"):
        self.path, self.tied, self.stop = path, tied, stop
        self.buckets = plan_buckets(weight_specs(named, tied, path.dtype), path.bucket_bytes)
        self.device = device if lead else None
        self.group = None
        if lead and path.mode == "nccl":
            self.group = nccl_trainer_group(*path.nccl_address, 1 + sum(path.tp_sizes), group_name)

    def publish(self, named, version: int, phases: dict[str, float] | None = None) -> None:
        """Ship the weights `named` streams as `version`; returns once every engine has loaded them. phases:
        where the time went, in seconds added into it, per phase (engines/buckets.py `Stopwatch`: alloc,
        gather, pack, hand-off, acks), the device synchronised between phases: for benchmarks only."""
        path = self.path
        clock = Stopwatch(phases, self.device)

        def ship(index, flat, slots):
            if self.stop is not None and self.stop.is_set():
                return
            last = index == len(self.buckets) - 1
            for engine, tp in enumerate(path.tp_sizes):
                payloads = path.payloads(flat, slots, tp) if path.mode == "ipc" else None
                path.channel.send(engine, BucketMessage(version, index, last, slots, payloads))
            if self.group is not None:
                nccl_broadcast(flat, self.group)
            clock.lap("hand-off")
            path.channel.wait_acks(version, index, len(path.tp_sizes), self.stop)
            clock.lap("acks")

        send_buckets(engine_weights(named, self.tied), self.buckets, self.device, ship, clock)


def receive_version(engine, channel: WeightChannel, index: int, timeout_s: float = RECEIVE_TIMEOUT_S) -> list:
    """An engine's `sync()`: if rank 0 has started shipping a version, take every bucket of it through the
    engine contract, acking each once loaded (rank 0 then frees it), then adopt the version: no token is ever
    sampled from half of a version. Returns the requests that finished meanwhile."""
    message = channel.receive(index)
    if message is None:
        return []
    finished = engine.begin_weights()
    while True:
        engine.load_bucket(message)
        message.payloads = None  # this process's hold on the bucket's memory ends here
        channel.ack(index, message.version, message.index)
        if message.last:
            break
        message = channel.receive(index, timeout=timeout_s)
        if message is None:
            raise RuntimeError("the trainer stopped sending a weight version half-way")
    return finished + engine.adopt_weights(message.version)


# ---- the trainer's side of an NCCL weight sync (SGLang engines only; run only with CUDA and sglang) ----

def nccl_trainer_group(address: str, port: int, world_size: int, group_name: str):
    """Trainer rank 0 joins the weight group as rank 0; the engines' TP ranks are 1 .. world_size - 1."""
    from sglang.srt.utils import init_custom_process_group

    return init_custom_process_group(backend="nccl", init_method=f"tcp://{address}:{port}",
                                     world_size=world_size, rank=0, group_name=group_name)


def nccl_broadcast(flat: torch.Tensor, group) -> None:
    torch.distributed.broadcast(flat, src=0, group=group)
