"""The full weights out of FSDP2's shards in a few collectives: one all-gather per batch of weights, not one
each.

    for name, tensor in full_tensors(policy.state_dict().items()):   # on every rank: it runs collectives

FSDP2 holds each weight as a DTensor sharded on dim 0 over a 1-D mesh the way torch.chunk splits it:
ceil(dim 0 / world) rows to a rank, the last ranks fewer or none. `DTensor.full_tensor()` is one all-gather
per weight (about 290 at Qwen2.5-0.5B, each paying a collective's fixed cost); here a run of weights of one
mesh travels in one: each rank packs its shards' bytes, each padded to the chunk's rows, into one flat buffer,
one `all_gather_single` brings every rank's buffer, and each weight is cut back out of them: bit for bit what
`full_tensor()` gives.
"""
import itertools
import math
from typing import Iterable, Iterator

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Shard

# Full-tensor bytes one all-gather carries, by device. A GPU's: a 0.5B model's fp32 weights in under 10, the
# batch's buffers a small part of its memory. The CPU's is smaller: gloo moves about 1 GB/s whatever the
# count, and bigger buffers cost more than the collectives they save (SmolLM2-135M on 2 ranks: a walk of
# 0.63 s at 32 MiB, 1.0 s at 256 MiB, 0.79 s by one full_tensor() per weight)
GATHER_BYTES = {"cuda": 256 << 20, "cpu": 32 << 20}
# each weight's bytes start at a multiple of the widest element size, so that they view as its dtype
ALIGN = 16


def full_tensors(named: Iterable[tuple[str, torch.Tensor]],
                 budget: int | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) -> (name, full tensor), in order; collectives when sharded, so every rank must call it.

    DTensors sharded on dim 0 of a 1-D mesh are gathered in batches: consecutive ones of one mesh, whatever
    their dtypes, up to `budget` bytes of full tensors (default: the device's GATHER_BYTES; a bigger weight
    alone). Other DTensors gather by `full_tensor()`; plain tensors pass through. Holds one batch at a time,
    never the model."""
    batch: list[tuple[str, DTensor]] = []
    size = 0
    for name, value in named:
        limit = budget or GATHER_BYTES.get(value.device.type, GATHER_BYTES["cpu"])
        if batch and not (_joins(batch[0][1], value) and size + _nbytes(value) <= limit):
            yield from _gathered(batch)
            batch, size = [], 0
        if _row_sharded(value):
            batch.append((name, value))
            size += _nbytes(value)
        else:
            yield name, (value.full_tensor() if isinstance(value, DTensor) else value)
    if batch:
        yield from _gathered(batch)


def _row_sharded(value: torch.Tensor) -> bool:
    return (isinstance(value, DTensor) and value.device_mesh.ndim == 1
            and tuple(value.placements) == (Shard(0),))


def _joins(first: DTensor, value: torch.Tensor) -> bool:
    """Whether `value` can share one all-gather with the batch `first` opened."""
    return _row_sharded(value) and value.device_mesh == first.device_mesh and value.device == first.device


def _nbytes(value: torch.Tensor) -> int:
    return value.numel() * value.dtype.itemsize  # a DTensor's numel is its full tensor's


def _gathered(batch: list[tuple[str, DTensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """The batch's full tensors, in order, from one all-gather of every rank's shards as bytes (so that
    weights of several dtypes, a LoRA model's bf16 base and fp32 adapters, share it); none on a mesh of one
    rank."""
    mesh = batch[0][1].device_mesh
    world = mesh.size()
    if world == 1:
        yield from ((name, value.to_local()) for name, value in batch)
        return
    rows = [-(-value.shape[0] // world) for _, value in batch]  # torch.chunk's rows per rank
    sizes = [r * math.prod(value.shape[1:]) * value.dtype.itemsize for r, (_, value) in zip(rows, batch)]
    starts = list(itertools.accumulate((-(-size // ALIGN) * ALIGN for size in sizes), initial=0))
    # padding: never read
    local = torch.empty(starts[-1], dtype=torch.uint8, device=batch[0][1].to_local().device)
    for (_, value), start in zip(batch, starts):
        shard = value.to_local().detach().reshape(-1)
        local[start:start + shard.numel() * shard.itemsize].view(shard.dtype).copy_(shard)
    everyone = torch.empty(world * local.numel(), dtype=torch.uint8, device=local.device)
    dist.all_gather_single(everyone, local, group=mesh.get_group())
    by_rank = everyone.view(world, -1)
    for (name, value), r, start, size in zip(batch, rows, starts, sizes):
        # rank by rank
        full = by_rank[:, start:start + size].view(value.dtype).reshape(world * r, *value.shape[1:])
        yield name, full[:value.shape[0]]
