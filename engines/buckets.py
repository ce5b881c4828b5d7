"""The bucket format weights travel in, from the trainer to the engines (the GPU plan's weight path), and the
queues between them: the neutral vocabulary of `engines/weight_sync.py`, of every engine's `load_bucket`
(`engines/builtin.py`, `engines/sglang.py`) and of the trainer's names (`engine_name`).

Every trainer rank walks the full weights in the same order (their gathers are collectives:
trainer/gather.py); rank 0 casts each full weight, in the engines' dtype and under the engine's name, into a
flat bucket of at most `bucket_bytes`: the tensors' bytes back to back, in order, no padding (the layout of
SGLang's `FlattenedTensorBucket`).
"""
import queue
import time
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator

import torch

# Wrapper modules whose attribute names appear inside parameter names: torch.compile, FSDP1, activation
# checkpointing. DDP's `module.` and our TokenLogprobs' `lm.` (trainer/policy.py) only ever lead.
WRAPPERS = ("_orig_mod", "_fsdp_wrapped_module", "_checkpoint_wrapped_module")
LEADING = ("module", "lm")


def engine_name(name: str) -> str:
    """FSDP/trainer parameter name -> the Hugging Face name that SGLang's `load_weights` expects."""
    parts = [p for p in name.split(".") if p not in WRAPPERS]
    while len(parts) > 1 and parts[0] in LEADING:
        parts = parts[1:]
    return ".".join(parts)


def engine_weights(named: Iterable[tuple[str, torch.Tensor]],
                   tied: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """(engine name, full tensor) for every floating-point weight; a collective under FSDP2
    (all ranks call it).

    With tied embeddings the engine's lm_head *is* embed_tokens, so lm_head.weight is not sent."""
    for name, value in named:
        name = engine_name(name)
        if not value.is_floating_point() or (tied and name == "lm_head.weight"):
            continue
        yield name, (value.full_tensor() if hasattr(value, "full_tensor") else value)


@dataclass(frozen=True)
class Slot:
    """One tensor's byte range in a flat bucket (the fields of SGLang's FlattenedTensorMetadata)."""
    name: str
    shape: torch.Size
    dtype: torch.dtype
    start: int
    end: int


def plan_buckets(specs: Iterable[tuple[str, torch.Size, torch.dtype]], bucket_bytes: int) -> list[list[Slot]]:
    """Group (name, shape, dtype) in order into buckets of at most `bucket_bytes`; a bigger tensor gets its
    own."""
    if bucket_bytes < 1:
        raise ValueError(f"bucket_bytes must be >= 1, got {bucket_bytes}")
    buckets: list[list[Slot]] = []
    used = 0
    for name, shape, dtype in specs:
        size = torch.Size(shape).numel() * dtype.itemsize
        if not buckets or (used + size > bucket_bytes and buckets[-1]):
            buckets.append([])
            used = 0
        buckets[-1].append(Slot(name, torch.Size(shape), dtype, used, used + size))
        used += size
    return buckets


def weight_specs(named: Iterable[tuple[str, torch.Tensor]], tied: bool, dtype: torch.dtype):
    """(engine name, global shape, dtype) without gathering anything: a DTensor's shape is already global."""
    return [(engine_name(n), v.shape, dtype) for n, v in named
            if v.is_floating_point() and not (tied and engine_name(n) == "lm_head.weight")]


def pack(slot: Slot, tensor: torch.Tensor, buffer: torch.Tensor) -> None:
    """Copy `tensor` (cast to the slot's dtype) into its byte range of the uint8 `buffer`: one kernel, which
    casts as it writes, with no cast or contiguous copy on the way."""
    assert tensor.shape == slot.shape, (slot.name, tensor.shape, slot.shape)
    buffer[slot.start:slot.end].view(slot.dtype).view(slot.shape).copy_(tensor.detach())


def unpack(flat: torch.Tensor, slots: list[Slot]) -> list[tuple[str, torch.Tensor]]:
    """The inverse of `pack`, as views: what SGLang's FlattenedTensorBucket.reconstruct_tensors returns."""
    return [(s.name, flat[s.start:s.end].view(s.dtype).reshape(s.shape)) for s in slots]


class Stopwatch:
    """Seconds per phase of a weight push, added into `phases` when it is given (a benchmark's timings);
    without it a lap is one test and nothing more. On a GPU each lap first waits for the device, so that the
    kernels a phase queued count in that phase: it slows the push it times."""

    def __init__(self, phases: dict[str, float] | None = None, device=None):
        self.phases = phases
        self.cuda = device is not None and torch.device(device).type == "cuda"
        self.device, self.start = device, time.perf_counter()

    def lap(self, phase: str) -> None:
        if self.phases is None:
            return
        if self.cuda:
            torch.cuda.synchronize(self.device)
        now = time.perf_counter()
        self.phases[phase] = self.phases.get(phase, 0.0) + now - self.start
        self.start = now


def send_buckets(tensors: Iterable[tuple[str, torch.Tensor]], buckets: list[list[Slot]], device,
                 ship: Callable[[int, torch.Tensor, list[Slot]], None],
                 clock: Stopwatch | None = None) -> None:
    """Fill a flat bucket on `device` from the (name, tensor) stream and call ship(index, flat, slots), per
    bucket.

    A fresh bucket each time, not one reused buffer: torch keeps memory shared over CUDA IPC out of reuse
    until every process that mapped it has released it, after syncing its stream, so a late GPU copy in an
    engine never reads the next bucket's bytes. Ranks other than 0 pass device=None: they only join the
    gathers. clock: laps "alloc" (a fresh bucket), "gather" (the stream's next tensor) and "pack"; `ship` laps
    its own."""
    clock = clock or Stopwatch()
    stream = iter(tensors)
    for i, slots in enumerate(buckets):
        flat = None if device is None else torch.empty(slots[-1].end, dtype=torch.uint8, device=device)
        clock.lap("alloc")
        for slot in slots:
            name, tensor = next(stream)
            clock.lap("gather")
            if name != slot.name:
                raise RuntimeError(f"weight {name!r} arrived where the bucket plan has {slot.name!r}")
            if flat is not None:
                pack(slot, tensor, flat)
                clock.lap("pack")
        if flat is not None:
            ship(i, flat, slots)


@dataclass
class BucketMessage:
    """What rank 0 tells one engine about one bucket."""
    version: int
    index: int
    last: bool  # the engine flushes its cache and adopts `version` after this one
    slots: list[Slot]
    # IPC: one serialized bucket per TP rank of the engine; None: an NCCL broadcast follows
    payloads: list | None


class WeightChannel:
    """Queues between trainer rank 0 and the engines; build in the launcher before spawning, pass to both."""

    def __init__(self, num_engines: int, ctx):
        self.inboxes = [ctx.Queue() for _ in range(num_engines)]
        self.acks = ctx.Queue()

    def send(self, engine: int, message: BucketMessage) -> None:
        self.inboxes[engine].put(message)

    def receive(self, engine: int, timeout: float = 0.0) -> BucketMessage | None:
        try:
            return self.inboxes[engine].get(timeout=timeout) if timeout else self.inboxes[engine].get_nowait()
        except queue.Empty:
            return None

    def ack(self, engine: int, version: int, index: int) -> None:
        self.acks.put((engine, version, index))

    def wait_acks(self, version: int, index: int, count: int, stop=None, timeout_s: float = 600.0) -> None:
        """Block until `count` engines acked bucket `index` of `version` (have loaded it), or `stop` is
        set."""
        seen, deadline = set(), time.time() + timeout_s
        while len(seen) < count:
            if stop is not None and stop.is_set():
                return
            if time.time() > deadline:
                raise RuntimeError(f"engines did not load weight bucket {index} of version {version} in time")
            try:
                engine, v, i = self.acks.get(timeout=0.5)
            except queue.Empty:
                continue
            if (v, i) == (version, index):
                seen.add(engine)

    def close(self) -> None:
        for q in (*self.inboxes, self.acks):
            q.close()
            q.join_thread()
