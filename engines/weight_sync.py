"""Weights from the FSDP2 trainer to the SGLang engines on GPU, in buckets, over CUDA IPC or NCCL.

Every trainer rank walks the state dict in the same order (`full_tensor()` is a collective); rank 0 copies
each full weight, in bf16 and under the engine's name, into a flat GPU bucket of at most `bucket_bytes`.
A full bucket is shipped to every engine, which loads it with SGLang's `load_format="flattened_bucket"`:

- IPC: the bucket crosses processes as CUDA IPC handles (`MultiprocessingSerializer`, one payload per TP
  rank) and `engine.update_weights_from_tensor` copies it into the engine's parameters. Needs the engines'
  GPUs to reach rank 0's (same GPU, or peer access over NVLink/PCIe).
- NCCL (fallback): the engines join a process group with rank 0 (`init_weights_update_group`) and
  `update_weights_from_distributed` receives the bucket that rank 0 broadcasts.

The bucket layout is SGLang's `FlattenedTensorBucket`: tensors' bytes back to back, in order, no padding.
Everything above the SGLang and NCCL calls is plain torch and tested on the CPU; sglang is imported lazily.
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


def engine_weights(named: Iterable[tuple[str, torch.Tensor]], tied: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """(engine name, full tensor) for every floating-point weight; a collective under FSDP2 (all ranks call it).

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
    """Group (name, shape, dtype) in order into buckets of at most `bucket_bytes`; a bigger tensor gets its own."""
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
    """Copy `tensor` (cast to the slot's dtype) into its byte range of the uint8 `buffer`."""
    assert tensor.shape == slot.shape, (slot.name, tensor.shape, slot.shape)
    buffer[slot.start:slot.end].copy_(tensor.detach().to(slot.dtype).contiguous().view(-1).view(torch.uint8))


def unpack(flat: torch.Tensor, slots: list[Slot]) -> list[tuple[str, torch.Tensor]]:
    """The inverse of `pack`, as views: what SGLang's FlattenedTensorBucket.reconstruct_tensors returns."""
    return [(s.name, flat[s.start:s.end].view(s.dtype).reshape(s.shape)) for s in slots]


def send_buckets(tensors: Iterable[tuple[str, torch.Tensor]], buckets: list[list[Slot]], device,
                 ship: Callable[[int, torch.Tensor, list[Slot]], None]) -> None:
    """Fill a flat bucket on `device` from the (name, tensor) stream and call ship(index, flat, slots), per bucket.

    A fresh bucket each time, not one reused buffer: torch keeps memory shared over CUDA IPC out of reuse until
    every process that mapped it has released it, after syncing its stream, so a late GPU copy in an engine
    never reads the next bucket's bytes. Ranks other than 0 pass device=None: they only join the gathers."""
    stream = iter(tensors)
    for i, slots in enumerate(buckets):
        flat = None if device is None else torch.empty(slots[-1].end, dtype=torch.uint8, device=device)
        for slot in slots:
            name, tensor = next(stream)
            if name != slot.name:
                raise RuntimeError(f"weight {name!r} arrived where the bucket plan has {slot.name!r}")
            if flat is not None:
                pack(slot, tensor, flat)
        if flat is not None:
            ship(i, flat, slots)


@dataclass
class BucketMessage:
    """What rank 0 tells one engine about one bucket."""
    version: int
    index: int
    last: bool  # the engine flushes its cache and adopts `version` after this one
    slots: list[Slot]
    payloads: list | None  # IPC: one serialized bucket per TP rank of the engine; None: an NCCL broadcast follows


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
        """Block until `count` engines acked bucket `index` of `version` (have loaded it), or `stop` is set."""
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


class Publisher:
    """Trainer side of a weight sync: every rank calls `publish` (the gathers are collectives); rank 0 ships.

    mode "ipc": each engine gets CUDA IPC handles of rank 0's bucket; "nccl": rank 0 broadcasts the bucket to
    a process group of itself and every engine TP rank. Either way rank 0 fills the next bucket only after
    every engine has acked this one: one bucket of extra GPU memory, and versions never interleave.
    Once `stop` is set rank 0 ships nothing more but still walks the weights, so the other ranks' gathers end.
    """

    def __init__(self, named, tied: bool, channel: WeightChannel, engine_tp_sizes: list[int], lead: bool,
                 device, bucket_bytes: int = 512 << 20, mode: str = "ipc", dtype=torch.bfloat16,
                 nccl_address: tuple[str, int] | None = None, serialize=None, group_name: str = "ringrl-weights",
                 stop=None):
        if mode not in ("ipc", "nccl"):
            raise ValueError(f"weight sync mode must be ipc or nccl, got {mode!r}")
        self.tied, self.channel, self.tp_sizes, self.mode = tied, channel, list(engine_tp_sizes), mode
        self.buckets = plan_buckets(weight_specs(named, tied, dtype), bucket_bytes)
        self.device = device if lead else None
        self.serialize = serialize or ipc_payloads
        self.stop = stop
        self.group = None
        if lead and mode == "nccl":
            self.group = nccl_trainer_group(*nccl_address, 1 + sum(self.tp_sizes), group_name)

    def publish(self, named, version: int) -> None:
        def ship(index, flat, slots):
            if self.stop is not None and self.stop.is_set():
                return
            last = index == len(self.buckets) - 1
            for engine, tp in enumerate(self.tp_sizes):
                payloads = self.serialize(flat, slots, tp) if self.mode == "ipc" else None
                self.channel.send(engine, BucketMessage(version, index, last, slots, payloads))
            if self.group is not None:
                nccl_broadcast(flat, self.group)
            self.channel.wait_acks(version, index, len(self.tp_sizes), self.stop)

        send_buckets(engine_weights(named, self.tied), self.buckets, self.device, ship)


class GPUWeights:
    """The GPU plan's weight path, built by the launcher and handed to every process (as the CPU plan hands
    out its WeightStore): a rollout worker takes `follower`, a trainer rank `publisher`.

    loader: what the engines are. "sglang": SGLang loads each bucket (CUDA IPC handles in its serialized format,
    or an NCCL broadcast). "builtin": the built-in engine copies each bucket, sent as a tensor (CUDA IPC on a GPU,
    shared memory on the CPU), into its own weights (`load_buckets`).
    serialize: a bucket -> one payload per TP rank (None: the loader's own); the CPU tests pass plain bytes.
    dtype: the engines' weights; the buckets carry the weights cast to it.
    """

    def __init__(self, channel: WeightChannel, engine_tp_sizes: list[int], mode: str = "ipc",
                 bucket_bytes: int = 512 << 20, nccl_address: tuple[str, int] | None = None, serialize=None,
                 loader: str = "sglang", dtype: torch.dtype = torch.bfloat16):
        if loader not in ("sglang", "builtin"):
            raise ValueError(f"weight loader must be sglang or builtin, got {loader!r}")
        self.channel, self.tp_sizes, self.mode, self.bucket_bytes = channel, list(engine_tp_sizes), mode, bucket_bytes
        self.nccl_address, self.loader, self.dtype = nccl_address, loader, dtype
        self.serialize = serialize or (tensor_payloads if loader == "builtin" else None)
        self.ready = torch.zeros(len(self.tp_sizes), dtype=torch.uint8).share_memory_()  # per engine: it is up

    def follower(self, engine, index: int) -> Callable[[], list]:
        """Engine `index`'s end: `sync()` between steps loads a new version if rank 0 ships one (SGLang interrupts
        and resubmits the requests in flight); it returns the requests that finished meanwhile."""
        self.ready[index] = 1  # before the NCCL join, which waits for rank 0, which may wait for this flag
        if self.loader == "builtin":
            return lambda: load_buckets(engine, self.channel, index)
        if self.mode == "nccl":
            engine.join_weight_group(*self.nccl_address, 1 + sum(self.tp_sizes[:index]), 1 + sum(self.tp_sizes))
        return lambda: engine.sync_weights(self.channel, index)

    def engines_ready(self) -> bool:
        return bool(self.ready.all())

    def publisher(self, policy, lead: bool, stop) -> Callable:
        """A trainer rank's end: `publish(tensors, version)`, called by every rank with the full weights. The
        buckets are planned from what the policy says it will stream (`published_shapes`: a LoRA model's merged
        weights), not from its state dict."""
        device = next(policy.parameters()).device
        return Publisher(policy.published_shapes(), policy.lm.config.tie_word_embeddings, self.channel,
                         self.tp_sizes, lead, device, self.bucket_bytes, self.mode, dtype=self.dtype,
                         nccl_address=self.nccl_address, serialize=self.serialize, stop=stop).publish


# ---- the built-in engine's end (torch only) ----

def tensor_payloads(flat: torch.Tensor, slots: list[Slot], tp_size: int) -> list[torch.Tensor]:
    """The bucket itself, for a built-in engine: the queue pickles a CUDA tensor as a CUDA IPC handle (torch's
    reductions) and a CPU tensor as shared memory. Its bytes are in place before anyone maps them."""
    if flat.is_cuda:
        torch.cuda.current_stream(flat.device).synchronize()
    return [flat] * tp_size


def load_buckets(engine, channel: WeightChannel, index: int, timeout_s: float = 600.0) -> list:
    """A built-in engine's `sync()`: if rank 0 has started shipping a version, copy every bucket of it into the
    engine's weights, then adopt the version. The engine decodes nothing in between, so no token is sampled from
    half of a version; sequences in flight keep their cache and continue under the new weights. Each bucket is
    acked once copied (rank 0 then frees it). Returns no finished requests: nothing is interrupted."""
    message = channel.receive(index)
    if message is None:
        return []
    targets = engine.weight_tensors()
    while True:
        flat = message.payloads[0]
        with torch.no_grad():
            for name, tensor in unpack(flat, message.slots):
                if name not in targets:
                    raise RuntimeError(f"weight {name!r} is not one of the engine's; the trainer and the engine "
                                       "hold different architectures")
                targets[name].copy_(tensor)  # across GPUs too: the bucket may live on the trainer's GPU
        if flat.is_cuda:
            torch.cuda.synchronize(flat.device)  # copied before the ack lets rank 0 free the bucket
        del flat
        message.payloads = None  # this process's hold on the bucket's memory ends here
        channel.ack(index, message.version, message.index)
        if message.last:
            break
        message = channel.receive(index, timeout=timeout_s)
        if message is None:
            raise RuntimeError("the trainer stopped sending a weight version half-way")
    engine.set_version(message.version)
    return []


# ---- the SGLang and NCCL calls (run only with CUDA and sglang installed) ----

def ipc_payloads(flat: torch.Tensor, slots: list[Slot], tp_size: int) -> list[bytes]:
    """The bucket as CUDA IPC handles, one payload per TP rank (each rank deserializes its own copy, which
    keeps torch's IPC reference counts right), in the format `update_weights_from_tensor` takes."""
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata
    try:
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    except ImportError:  # sglang < 0.5
        from sglang.srt.patch_torch import monkey_patch_torch_reductions

    monkey_patch_torch_reductions()  # handles name the device by UUID, so CUDA_VISIBLE_DEVICES may differ
    torch.cuda.current_stream(flat.device).synchronize()  # the bytes are in place before anyone maps them
    metadata = [FlattenedTensorMetadata(s.name, s.shape, s.dtype, s.start, s.end, s.end - s.start) for s in slots]
    return [MultiprocessingSerializer.serialize({"flattened_tensor": flat, "metadata": metadata})
            for _ in range(tp_size)]


def load_ipc(engine, payloads: list[bytes], flush_cache: bool) -> None:
    """Engine side: load one IPC bucket (the engine copies it into its own parameters before returning)."""
    check_sglang(engine.update_weights_from_tensor(payloads, load_format="flattened_bucket", flush_cache=flush_cache))


def nccl_trainer_group(address: str, port: int, world_size: int, group_name: str):
    """Trainer rank 0 joins the weight group as rank 0; the engines' TP ranks are 1 .. world_size - 1."""
    from sglang.srt.utils import init_custom_process_group

    return init_custom_process_group(backend="nccl", init_method=f"tcp://{address}:{port}",
                                     world_size=world_size, rank=0, group_name=group_name)


def nccl_engine_join(engine, address: str, port: int, rank_offset: int, world_size: int, group_name: str) -> None:
    """Engine side (blocks until rank 0 joins too, so call it while rank 0 calls `nccl_trainer_group`)."""
    check_sglang(engine.init_weights_update_group(address, port, rank_offset, world_size, group_name, backend="nccl"))


def nccl_broadcast(flat: torch.Tensor, group) -> None:
    torch.distributed.broadcast(flat, src=0, group=group)


def load_nccl(engine, slots: list[Slot], group_name: str, flush_cache: bool) -> None:
    """Engine side: receive the bucket rank 0 broadcasts and load it."""
    check_sglang(engine.update_weights_from_distributed(
        [s.name for s in slots], [str(s.dtype).removeprefix("torch.") for s in slots],
        [list(s.shape) for s in slots], group_name=group_name, flush_cache=flush_cache,
        load_format="flattened_bucket"))


def check_sglang(result, call: str = "the weight update") -> None:
    """SGLang's control calls answer (success, message) (some a dict or an object with those fields): a refusal
    is an error that names the call and carries SGLang's message."""
    if isinstance(result, dict):
        result = (result.get("success", True), result.get("message", ""))
    elif hasattr(result, "success"):
        result = (result.success, getattr(result, "message", ""))
    if isinstance(result, tuple) and result and not result[0]:
        raise RuntimeError(f"SGLang refused {call}: {result[1] if len(result) > 1 else result}")
