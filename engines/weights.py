"""Weight publication from the trainer to the generation engines on CPU: one shared buffer per dtype plus a
seqlock.

The header holds a sequence counter and the version. The single writer makes the counter odd, copies the
weights, stores the version, then makes the counter even again; a reader copies the weights and keeps the
result only if the counter was even and unchanged across its copy, otherwise it copies again. So a reader
never keeps half-old, half-new weights and the writer never waits for anyone. A read that overlaps a
publish is retried; publishes come once per optimizer step, far apart compared with one copy.

Memory ordering: each step is a separate torch call from Python (the data copy joins its worker threads
before returning), and x86 keeps stores in order with stores and loads with loads, so the header is seen
only after the data it describes.

Copies run on torch's intra-op threads: keep the threads of all processes on a box within its cores, or every
per-tensor copy waits a scheduler slice for a descheduled thread (measured 15-30x slower on 2 busy cores).
"""
import time
from contextlib import contextmanager
from typing import Callable, Iterable

import torch

SEQ, VERSION = 0, 1


class WeightStore:
    """Full model weights in one shared buffer plus a version; a reader never sees half-old, half-new
    weights."""

    def __init__(self, shapes: dict[str, tuple[torch.Size, torch.dtype]]):
        """Allocate the shared buffers. Call in the launcher before spawning; pass the store as a Process
        arg."""
        # name -> (buffer dtype, offset, shape)
        self._layout: dict[str, tuple[torch.dtype, int, torch.Size]] = {}
        sizes: dict[torch.dtype, int] = {}
        for name, (shape, dtype) in shapes.items():
            if not dtype.is_floating_point:
                raise ValueError(f"weight {name!r} has dtype {dtype}; "
                                 "only floating-point weights are published")
            shape = torch.Size(shape)
            offset = sizes.get(dtype, 0)
            self._layout[name] = (dtype, offset, shape)
            sizes[dtype] = offset + shape.numel()
        # Views are rebuilt on demand rather than stored, so pickling the store sends one handle per dtype.
        self._buffers = {dtype: torch.zeros(n, dtype=dtype).share_memory_() for dtype, n in sizes.items()}
        self._header = torch.zeros(2, dtype=torch.int64).share_memory_()

    @classmethod
    def for_model(cls, model: torch.nn.Module, dtype: torch.dtype | None = None) -> "WeightStore":
        """A store for every floating-point entry of `model.state_dict()` (tied weights are kept under each
        name), held in `dtype` when given: the engines' own, so a bf16 engine's store is half an fp32 one and
        a publication rounds each weight to it once, as the engine's load would."""
        return cls({k: (v.shape, dtype or v.dtype) for k, v in model.state_dict().items()
                    if v.is_floating_point()})

    @property
    def version(self) -> int:
        """The latest completely published version (written after the data, so safe to poll)."""
        return int(self._header[VERSION])

    @property
    def names(self) -> list[str]:
        return list(self._layout)

    def follower(self, engine, index: int) -> Callable[[], list]:
        """A rollout worker's end: `sync()` between decode steps copies a newer version straight into
        `engine`'s weights through the engine contract (`weight_tensors`, `begin_weights`, `adopt_weights`);
        it returns the requests that finished meanwhile."""
        targets = engine.weight_tensors()
        if not targets:
            raise ValueError("the shared-memory weight store needs an engine that holds its weights in this "
                             "process (the built-in engine); SGLang takes its weights in buckets "
                             "(GPUWeights)")

        def sync() -> list:
            if self.version <= engine.version:
                return []
            finished = engine.begin_weights()
            return finished + engine.adopt_weights(self.read_into(targets))

        return sync

    def publisher(self, policy, lead: bool, stop) -> Callable:
        """A trainer rank's end: `publish(tensors, version)`, called by every rank with the full weights
        (their gathers are collectives); rank 0 writes them."""
        def publish(tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
            if lead:
                self.publish(tensors, version)
            else:
                for _ in tensors:
                    pass

        return publish

    def items(self) -> list[tuple[str, torch.Tensor]]:
        """(name, view into the shared buffers) for every weight: what a generator node on the GPU plan
        ships on to its engines once a version has arrived (cluster=ray, launch/agent.py)."""
        return [(name, self._view(name)) for name in self._layout]

    def _view(self, name: str) -> torch.Tensor:
        dtype, offset, shape = self._layout[name]
        return self._buffers[dtype][offset: offset + shape.numel()].view(shape)

    def publish(self, tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> None:
        """Copy `tensors` (any device or dtype) into the store as `version`. Single writer only."""
        items = list(tensors)
        for name, tensor in items:  # validate first, so a bad call cannot leave the counter odd
            if name not in self._layout:
                raise ValueError(f"unknown weight {name!r}: the store was built for {len(self._layout)} "
                                 "other names")
            if tensor.shape != self._layout[name][2]:
                raise ValueError(f"weight {name!r} has shape {tuple(tensor.shape)}, "
                                 f"the store expects {tuple(self._layout[name][2])}")
        with self.writing(version):
            for name, tensor in items:
                self._view(name).copy_(tensor.detach())

    @contextmanager
    def writing(self, version: int):
        """Write the buffers (`buffers()`) in the body; readers see `version` once it ends. Single writer
        only. A body that raises (a generator node's receive cut off part way, cluster=ray) leaves the store
        marked as being written: its buffers may hold parts of two versions, so readers wait until a later
        write completes."""
        if int(self._header[SEQ]) % 2 == 0:
            self._header[SEQ] += 1  # odd: a publish is in progress (still odd after one that failed)
        yield
        self._header[VERSION] = version
        self._header[SEQ] += 1  # even again: the snapshot is complete

    def buffers(self) -> list[torch.Tensor]:
        """The shared buffers, one per dtype, in an order every store built from the same model shares: what a
        generator node's store receives whole (cluster=ray, launch/ray_nodes.py)."""
        return [self._buffers[dtype] for dtype in sorted(self._buffers, key=str)]

    def read_buffers(self, targets: list[torch.Tensor]) -> int:
        """Copy one consistent snapshot of `buffers()` into `targets` (tensors of their shapes); its
        version."""
        def copy():
            for target, buffer in zip(targets, self.buffers(), strict=True):
                target.copy_(buffer)
        return self._consistent(copy)

    def read_into(self, targets: dict[str, torch.Tensor]) -> int:
        """Copy one consistent snapshot into `targets` (views and other dtypes are fine; unknown names
        skipped).

        Returns the version that was read."""
        names = [name for name in targets if name in self._layout]
        for name in names:
            if targets[name].shape != self._layout[name][2]:
                raise ValueError(f"target {name!r} has shape {tuple(targets[name].shape)}, "
                                 f"the store holds {tuple(self._layout[name][2])}")
        def copy():
            for name in names:
                targets[name].copy_(self._view(name))
        return self._consistent(copy)

    def _consistent(self, copy: Callable[[], None]) -> int:
        """Run `copy` until it ran while no publish did; the version it copied."""
        while True:
            seq = int(self._header[SEQ])
            # a publish is in progress: wait for it rather than copy data that will be thrown away
            if seq % 2:
                time.sleep(0.0005)
                continue
            version = int(self._header[VERSION])
            with torch.no_grad():
                copy()
            if int(self._header[SEQ]) == seq:
                return version
