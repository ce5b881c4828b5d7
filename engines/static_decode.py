"""The GPU plan's decode step: fixed shapes, one device-to-host copy, and on CUDA a graph replayed per shape.

    step = StaticDecode(model, k_cache, v_cache, slots, seed, max_len, graphs=True)
    handle = step.launch(rows=64, width=256, passes=Passes(False, False, False))  # queued, nothing waited for
    ...                                                                            # the host works meanwhile
    for token, logprob in step.read(handle): ...                                   # the step's one sync

A step decodes slots 0..rows-1 whatever runs in them: `rows` and the attention's `width` come from a few
buckets, so a handful of shapes serve a whole run and each can be captured once as a CUDA graph
(`torch.cuda.CUDAGraph`), its hundreds of kernel launches replayed as one. Everything a graph reads lives at a
fixed address: the engine's weights (a weight load copies into them), its KV cache (fixed width, never regrown
or freed) and the per-slot inputs in `slots` (`SlotState`). Idle slots in range decode too: their results are
dropped, and their keys and values land in their own slot at a position nothing reads (a free slot is
rewritten when admitted; a parked one holds only the positions before its last token, and its position only
grows).

Sampling branches on what the engine knows of its requests (`Passes`), never on the device. The step writes
its tokens and logprobs to one device buffer, copied to pinned host memory without blocking; `read` waits for
that copy only, so a caller that launches step t+1 before reading step t keeps the GPU busy while it
bookkeeps.

If capture fails, the step runs the same body eagerly and says so in one line; it never fails a run.
"""
import time
from dataclasses import dataclass

import torch

from engines.sampler import Passes, counter_uniform, sample


def row_buckets(max_batch: int) -> list[int]:
    """The batch sizes a step runs at: 1, 2, 4, 8, then multiples of 16, and max_batch
    (nano-vllm's choice)."""
    sizes = [b for b in (1, 2, 4, 8) if b < max_batch] + list(range(16, max_batch, 16)) + [max_batch]
    return sorted(set(sizes))


def width_buckets(max_len: int, first: int = 64) -> list[int]:
    """The cache widths attention reads: powers of two from `first`, and max_len. At most twice what is
    needed, and a few graphs per batch size even for long contexts."""
    widths, w = [], first
    while w < max_len:
        widths.append(w)
        w *= 2
    return widths + [max_len]


def bucket(sizes: list[int], need: int) -> int:
    return next(s for s in sizes if s >= need)


@dataclass
class SlotState:
    """The per-slot decode inputs, [max_batch] each, on the engine's device: what a step reads."""
    token: torch.Tensor  # the token to feed next
    pos: torch.Tensor  # its position = tokens already cached
    temperature: torch.Tensor
    top_p: torch.Tensor
    request: torch.Tensor  # request id: the sampling stream's key


@dataclass
class Launched:
    """A step in flight: how many rows it decoded and which host buffer receives them."""
    rows: int
    buffer: int


class StaticDecode:
    def __init__(self, model, k_cache: torch.Tensor, v_cache: torch.Tensor, slots: SlotState, seed: int,
                 max_len: int, graphs: bool):
        self.model, self.k_cache, self.v_cache, self.slots = model, k_cache, v_cache, slots
        self.seed, self.max_len = seed, max_len
        self.device = k_cache.device
        max_batch = slots.token.shape[0]
        self.rows, self.widths = row_buckets(max_batch), width_buckets(max_len)
        self.index = torch.arange(max_batch, device=self.device)
        self.sampled = torch.zeros(max_batch, dtype=torch.long, device=self.device)
        # tokens and logprobs side by side, so one copy brings both back (float64 holds every token id
        # exactly)
        self.out = torch.zeros(max_batch, 2, dtype=torch.float64, device=self.device)
        cuda = self.device.type == "cuda"
        # two, so step t's results are not overwritten by step t+1's copy before they are read
        self.host = [torch.zeros(max_batch, 2, dtype=torch.float64, pin_memory=cuda) for _ in range(2)]
        self.done = [torch.cuda.Event() if cuda else None for _ in range(2)]
        self.turn = 0
        self.graphs: dict[tuple, torch.cuda.CUDAGraph] = {}
        self.pool = None
        self.use_graphs = graphs and cuda
        self.capture_s = 0.0  # seconds spent capturing graphs, warm-ups included

    def shape(self, rows_needed: int, width_needed: int) -> tuple[int, int]:
        """The bucketed (rows, width) that covers slots 0..rows_needed-1 and positions 0..width_needed-1."""
        return bucket(self.rows, rows_needed), bucket(self.widths, width_needed)

    def launch(self, rows: int, width: int, passes: Passes) -> Launched:
        """Queue one decode of slots 0..rows-1 (a bucket), attention over positions 0..width-1 (a bucket),
        then the slots' next inputs and the copy of the results to the host. Waits for nothing on the
        device."""
        graph = self._graph(rows, width, passes) if self.use_graphs else None
        if graph is None:
            self._body(rows, width, passes)
        else:
            graph.replay()
        # Outside the graph: a capture's warm-up runs the body once more, which must not move any slot on.
        self.slots.token[:rows].copy_(self.sampled[:rows])
        self.slots.pos[:rows] += 1
        buffer = self.turn
        self.turn ^= 1
        self.host[buffer][:rows].copy_(self.out[:rows], non_blocking=True)
        if self.done[buffer] is not None:
            self.done[buffer].record(torch.cuda.current_stream(self.device))
        return Launched(rows, buffer)

    def read(self, launched: Launched) -> list[list[float]]:
        """[token, logprob] for slots 0..rows-1 of a launched step: the step's one wait on the device."""
        if self.done[launched.buffer] is not None:
            self.done[launched.buffer].synchronize()
        return self.host[launched.buffer][:launched.rows].tolist()

    def _body(self, rows: int, width: int, passes: Passes) -> None:
        """Decode and sample slots 0..rows-1 into `out` and `sampled`; the only state it writes besides them
        is each slot's keys and values at its position."""
        s = self.slots
        # An idle slot's position may have run past the cache (it moves on every step): it writes at the last
        # one.
        pos = s.pos[:rows].clamp(max=self.max_len - 1)
        logits = self.model.decode(self.k_cache, self.v_cache, s.token[:rows], pos, self.index[:rows], width,
                                   dense=True)
        u = counter_uniform(self.seed, s.request[:rows], pos)
        tokens, logprobs = sample(logits, s.temperature[:rows], s.top_p[:rows], u, passes)
        self.sampled[:rows].copy_(tokens)
        self.out[:rows, 0].copy_(tokens)
        self.out[:rows, 1].copy_(logprobs)

    def _graph(self, rows: int, width: int, passes: Passes):
        """The graph for this shape, captured at its first use; None (and eager from then on) if capture
        fails."""
        key = (rows, width, passes)
        if key in self.graphs:
            return self.graphs[key]
        start = time.perf_counter()
        try:
            graph = self._capture(rows, width, passes)
        except Exception as e:  # the eager body computes the same: a failed capture must never fail a run
            self.use_graphs = False
            print(f"cuda graphs: capturing a decode step of {rows} rows x {width} positions failed "
                  f"({type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}); the engine decodes "
                  "eagerly (rollout.cuda_graphs=false does so from the start)", flush=True)
            torch.cuda.synchronize(self.device)
            return None
        self.capture_s += time.perf_counter() - start
        self.graphs[key] = graph
        return graph

    def _capture(self, rows: int, width: int, passes: Passes) -> torch.cuda.CUDAGraph:
        # Warm-up on a side stream first (lazy initialisation of kernels and workspaces must not be captured),
        # as torch.cuda.graph's documentation does; it writes only what the replay then writes again.
        with torch.cuda.device(self.device):
            current = torch.cuda.current_stream()
            side = torch.cuda.Stream()
            side.wait_stream(current)
            with torch.cuda.stream(side):
                self._body(rows, width, passes)
            current.wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            # One memory pool for every shape: steps never run at once, and each writes its results out of the
            # pool. thread_local: another thread's CUDA calls (a queue's, a library's) do not break this
            # capture.
            with torch.cuda.graph(graph, pool=self.pool, capture_error_mode="thread_local"):
                self._body(rows, width, passes)
        self.pool = self.pool or graph.pool()
        return graph
