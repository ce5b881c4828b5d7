"""The built-in generation engine: continuous batching over a slot-based KV cache, on the CPU or a CUDA GPU.

    engine = BuiltinEngine(hf_model, max_batch=64, max_len=256, seed=0, device="cpu")  # or "cuda:0", bfloat16
    completions = engine.generate([Request(i, ids, SamplingParams(temperature=1.0)) for i, ids in ...])

Or drive it yourself: `add()` requests, call `step()` (admit + one decode step) and collect what
finishes. Between steps a rollout worker may `.copy_()` new weights into `weight_tensors()` and then call
`adopt_weights(v)`: sequences in flight keep their cache and their later tokens record version v. A parked
sequence's next turn does not: a cache with values of older weights is reused by no new request, prompt or
continuation, so that turn is prefilled again in full under the new weights (`stale_resumes`). (On a bf16 CPU
the matmuls read blocked copies of the weights: `adopt_weights` drops them, and the next step makes them from
the new weights; `set_version` alone would leave them on the old ones.)
"""
import heapq
from collections import OrderedDict, deque
from contextlib import contextmanager
from dataclasses import dataclass, field

import torch

from engines.arch import forward_for
from engines.base import Completion, Request, check_request, completes_stop_string, run_to_completion
from engines.buckets import unpack
from engines.llama import Llama
from engines.sampler import Passes, counter_uniform, sample
from engines.static_decode import SlotState, StaticDecode
from heap import KEEP_TOP, keep_freed_chunks, release_free_heap


@dataclass
class Sequence:
    """A request occupying a cache slot, and what it has generated so far."""
    request: Request
    slot: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)
    text: str = ""  # what the tokens read as, kept only for stop strings
    # The weights its prompt's cache was computed with (the engine's `weights_seen` then); None: a
    # continuation, whose cache holds earlier turns. Only a current prompt cache is copied.
    prompt_weights: int | None = None
    # the weights its whole cache was made under at admission (a continuation resumes only a cache made under
    # the current ones): parked with it
    cache_weights: int = 0
    # decode steps launched for it: its tokens, and one more while the static step's result is unread
    fed: int = 0
    # what prefill caches: the prompt but its last token
    prefix: tuple[int, ...] = field(init=False, repr=False)

    def __post_init__(self):
        self.prefix = tuple(self.request.prompt_ids[:-1])

    def finish_reason(self, vocabulary: list[str] | None) -> str | None:
        params, token = self.request.params, self.token_ids[-1]
        if token in params.stop_token_ids:
            return "stop"
        if params.stop_strings:
            piece = vocabulary[token]
            self.text += piece
            if completes_stop_string(self.text, piece, params.stop_strings):
                return "stop"
        return "length" if len(self.token_ids) >= params.max_new_tokens else None

    def completion(self, reason: str) -> Completion:
        return Completion(self.request.request_id, self.request.prompt_ids, self.token_ids, self.logprobs,
                          self.versions, reason)


class BuiltinEngine:
    """The same code on every device: the weights, the KV cache and the per-slot decode state live on
    `device`; only the bookkeeping of requests and slots is Python."""
    # On the CPU an idle engine (nothing running, waiting or parked) hands a KV cache this large back to the
    # OS, and zeroes a new one when requests come: GSM8K's 32 slots x 632 tokens in bf16 are 444 MB, free
    # while a synchronous run's trainer takes its step, for about 0.1 s of zeroing a batch. Such a cache is
    # first made by the first requests, not at construction: rank 0's evaluation engine is idle until its
    # first evaluation. Smaller caches (the default task's) are made at once and kept: zeroing them would cost
    # more of a short step than they free.
    IDLE_RELEASE_BYTES = 128 << 20
    # On the CPU the fast path's cache starts this many positions wide (or max_len, if less) and widens in
    # place, GROWTH positions at a time up to max_len, as the longest sequence needs: decode attention reads
    # the cache's whole width where that is the faster way (engines/llama.py `decode`), so the width follows
    # what is in flight. Its memory is reserved max_len wide and mapped by the OS as it is written. The
    # default task's cache is narrower than FIRST_WIDTH from the start.
    FIRST_WIDTH = 64
    GROWTH = 32

    def __init__(self, model, max_batch: int, max_len: int, seed: int = 0,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 fallback: bool = False, static: bool = False, cuda_graphs: bool = False):
        """static: decode with engines/static_decode.py's step (the GPU plan's; the fast path only): fixed
        shapes, one host sync a step, read one step late; cuda_graphs: that step as CUDA graphs where the
        device is CUDA."""
        self.device = torch.device(device)
        # normal tensors, so callers can copy_() into them outside inference mode
        with torch.inference_mode(False):
            # engines/arch.py: the fast path, or the fallback (also where `fallback` asks for it)
            self.model = forward_for(model, dtype, max_len, self.device, fallback)
        self.max_batch, self.max_len = max_batch, max_len
        if static and not isinstance(self.model, Llama):
            print(f"note: the static decode step runs the fast path only; {type(model).__name__} decodes "
                  "through the fallback, step by step", flush=True)
            static = False
        # The static step's graphs read the cache at fixed addresses: it is made once, full width, and kept.
        self.release_when_idle = (self.device.type == "cpu" and not static
                                  and self.model.cache_bytes(max_batch, max_len) >= self.IDLE_RELEASE_BYTES)
        self.k_cache = self.v_cache = None
        self.grows = self.device.type == "cpu" and hasattr(self.model, "grow_cache") and not static
        if not self.release_when_idle:
            self.k_cache, self.v_cache = self._new_cache()
        self.seed = seed
        self.version = 0
        self.waiting: deque[Request] = deque()
        self.running: dict[int, Sequence] = {}  # slot -> sequence
        self.free = list(range(max_batch))      # a min-heap: low slots first keeps running slots dense
        # Finished sequences kept for a continuation (Request.park), oldest first: request id -> (slot, its
        # tokens, prompt and generated; the cache holds all but the last; the weights of its cache's start:
        # weights loaded since it was admitted leave older values in it).
        self.parked: OrderedDict[int, tuple[int, list[int], int]] = OrderedDict()
        # weight loads and version changes so far: a prompt cache is copied under its own only
        self.weights_seen = 0
        self.prefix_copies = 0  # admitted samples whose prompt's cache was copied from a running sibling
        # continuations that prefilled only their new tokens, and the others; of those, the ones whose parked
        # cache held values of older weights (prefilled again in full under the current ones)
        self.resumed = self.resume_misses = self.stale_resumes = 0
        self.vocabulary: list[str] | None = None  # token id -> text, for stop strings
        # Per-slot decode inputs, kept as tensors so a step needs no Python loop to build its batch.
        on = {"device": self.device}
        long = dict(dtype=torch.long, **on)
        self.slots = SlotState(token=torch.zeros(max_batch, **long), pos=torch.zeros(max_batch, **long),
                               temperature=torch.ones(max_batch, **on), top_p=torch.ones(max_batch, **on),
                               request=torch.zeros(max_batch, **long))
        self.decoder = None  # the static step, or None: each step decodes exactly the running slots (_decode)
        # the static step launched last and not read yet: (Launched, its sequences, version)
        self.in_flight = None
        if static:
            with torch.inference_mode(False):
                self.decoder = StaticDecode(self.model, self.k_cache, self.v_cache, self.slots, seed, max_len,
                                            cuda_graphs)

    def weight_tensors(self) -> dict[str, torch.Tensor]:
        return self.model.weight_tensors()

    def set_version(self, version: int) -> None:
        self.version = version
        self.weights_seen += 1

    # The weight receipt (engines/base.py): weights are copied in between two decode steps; sequences in
    # flight keep their cache and continue under the new weights, nothing is interrupted.

    def begin_weights(self) -> list[Completion]:
        return []

    def load_bucket(self, message) -> None:
        """Copy one bucket (engines/buckets.py; its spec's `bucket_payloads`: the tensor, possibly on another
        GPU) into the engine's weights, done before the ack lets rank 0 free it."""
        flat, targets = message.payloads[0], self.weight_tensors()
        with torch.no_grad():
            for name, tensor in unpack(flat, message.slots):
                if name not in targets:
                    raise RuntimeError(f"weight {name!r} is not one of the engine's; the trainer and the "
                                       "engine hold different architectures")
                targets[name].copy_(tensor)
        if flat.is_cuda:
            torch.cuda.synchronize(flat.device)

    def adopt_weights(self, version: int) -> list[Completion]:
        # the copies the matmuls read are made from these weights before the next step
        self.model.drop_blocked()
        self.version = version
        self.weights_seen += 1
        return []

    def num_running(self) -> int:
        return len(self.running)

    def num_waiting(self) -> int:
        return len(self.waiting)

    def free_slots(self) -> int:
        return len(self.free) + len(self.parked)

    def use_vocabulary(self, texts: list[str]) -> None:
        self.vocabulary = list(texts)

    def add(self, request: Request) -> None:
        check_request(request, self.max_len)
        if request.params.stop_strings and self.vocabulary is None:
            raise ValueError(f"request {request.request_id} has stop strings; "
                             "call use_vocabulary(texts) first")
        self.waiting.append(request)

    def step(self) -> list[Completion]:
        """Admit waiting requests into free slots, then decode one token for every running sequence."""
        with torch.inference_mode():
            if self.k_cache is None and self.waiting:
                self.k_cache, self.v_cache = self._new_cache()
            if self.waiting or self.running:
                self.model.block_weights()  # once a version (engines/llama.py)
            self._admit()
            finished = self._decode() if self.running else []
            if self.release_when_idle and not (self.running or self.waiting or self.parked):
                self.k_cache = self.v_cache = None
                # their memory too, while a synchronous run's trainer takes its step
                self.model.drop_blocked()
                release_free_heap()  # a few MB a matrix: glibc would keep their pages
            return finished

    def _new_cache(self):
        if not self.grows:
            return self.model.new_cache(self.max_batch, self.max_len)
        return self.model.new_cache(self.max_batch, min(self.max_len, self.FIRST_WIDTH),
                                    capacity=self.max_len)

    def _fit_cache(self, positions: int) -> None:
        """Make the cache at least `positions` wide (a multiple of GROWTH, up to max_len), keeping what it
        holds."""
        width = self.k_cache.shape[3] if self.grows else self.max_len
        if positions > width:
            width = min(self.max_len, -(-positions // self.GROWTH) * self.GROWTH)
            self.k_cache, self.v_cache = self.model.grow_cache(self.k_cache, self.v_cache, width)

    def generate(self, requests: list[Request]) -> list[Completion]:
        return run_to_completion(self, requests)

    def _admit(self) -> None:
        """Move waiting requests into free slots and cache every prompt token but the last one.

        The last prompt token is fed by the next decode step, so the first generated token comes out
        of the same batched sampling as all the others, and prefill never computes logits.
        """
        admitted = []
        while self.waiting and (self.free or self.parked):
            request = self.waiting.popleft()
            slot = self._continue(request)
            resumed = slot is not None
            if not resumed:
                slot = heapq.heappop(self.free) if self.free else self.parked.popitem(last=False)[1][0]
                admitted.append((request, slot))
            self.running[slot] = Sequence(request, slot, cache_weights=self.weights_seen,
                                          prompt_weights=None if resumed else self.weights_seen)
        if not admitted:
            return
        requests = [r for r, _ in admitted]
        slots = self._tensor([slot for _, slot in admitted])
        self.slots.token[slots] = self._tensor([r.prompt_ids[-1] for r in requests])
        self.slots.pos[slots] = self._tensor([len(r.prompt_ids) - 1 for r in requests])
        self.slots.temperature[slots] = self._tensor([r.params.temperature for r in requests], torch.float32)
        self.slots.request[slots] = self._tensor([r.request_id for r in requests])
        self.slots.top_p[slots] = self._tensor([r.params.top_p for r in requests], torch.float32)
        # K samples of one prompt share its prefix: copied from a slot that already holds it (a sibling
        # admitted earlier, still running: continuous batching admits the K samples as slots free up), else
        # computed once for all of them here.
        pending = {slot for _, slot in admitted}
        held = self._held_prefixes({len(self.running[slot].prefix) for slot in pending}, pending)
        to_prefill = []
        for request, slot in admitted:
            prefix = self.running[slot].prefix
            if prefix in held:
                self.model.copy_prefix(self.k_cache, self.v_cache, held[prefix], slot, len(prefix))
                self.prefix_copies += 1
            else:
                to_prefill.append((request, slot))
        admitted = to_prefill
        prefixes: dict[tuple[int, ...], int] = {}
        rows = [prefixes.setdefault(self.running[slot].prefix, len(prefixes)) for _, slot in admitted]
        longest = max((len(p) for p in prefixes), default=0)
        if longest == 0:
            return
        slots = self._tensor([slot for _, slot in admitted])
        ids = torch.zeros(len(prefixes), longest, dtype=torch.long)
        for row, prefix in enumerate(prefixes):
            ids[row, :len(prefix)] = torch.tensor(prefix, dtype=torch.long)
        self._fit_cache(longest)
        self.model.prefill(self.k_cache, self.v_cache, self._on_device(ids), self._tensor(rows), slots)

    def _held_prefixes(self, lengths: set[int], pending: set[int]) -> dict[tuple[int, ...], int]:
        """Prompt prefixes (all but the last prompt token) of these lengths that a running slot's cache holds,
        made with the current weights -> that slot. A slot never rewrites its cache below its prompt's length;
        `pending` slots are not filled yet."""
        return {seq.prefix: slot for slot, seq in self.running.items() if slot not in pending and seq.prefix
                and seq.prompt_weights == self.weights_seen and len(seq.prefix) in lengths}

    def _continue(self, request: Request) -> int | None:
        """The parked slot that `request` continues, its cache extended by the new prompt tokens; None when it
        continues nothing, or a sequence evicted meanwhile, or one whose cache holds values of older weights
        (one rule with `_held_prefixes`: only a cache of the current weights is reused), or the model cannot
        extend a cache (a full prefill)."""
        if request.resume is None:
            return None
        parked = self.parked.pop(request.resume, None)
        if parked is None:
            self.resume_misses += 1
            return None
        slot, tokens, weights = parked
        prompt = request.prompt_ids
        stale = weights != self.weights_seen
        if (stale or len(prompt) < len(tokens) or prompt[:len(tokens)] != tokens
                or not hasattr(self.model, "extend")):
            self.resume_misses += 1
            self.stale_resumes += stale
            heapq.heappush(self.free, slot)
            return None
        new = prompt[len(tokens) - 1:-1]  # the cache holds all but the parked sequence's last token
        if new:
            self._fit_cache(len(prompt) - 1)
            self.model.extend(self.k_cache, self.v_cache, self._tensor(new), slot, len(tokens) - 1)
        self._set_slot(slot, request)
        self.resumed += 1
        return slot

    def _set_slot(self, slot: int, request: Request) -> None:
        s = self.slots  # scalar writes: device fills, no wait
        s.token[slot], s.pos[slot] = request.prompt_ids[-1], len(request.prompt_ids) - 1
        s.temperature[slot], s.top_p[slot] = request.params.temperature, request.params.top_p
        s.request[slot] = request.request_id

    def _tensor(self, values: list, dtype: torch.dtype = torch.long) -> torch.Tensor:
        return self._on_device(torch.tensor(values, dtype=dtype))

    def _on_device(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.device.type == "cpu":
            return tensor
        # From pinned memory without blocking: a pageable copy would wait for every step queued before it.
        return tensor.pin_memory().to(self.device, non_blocking=True)

    def _decode(self) -> list[Completion]:
        """One token for each running sequence; the static step returns the step before this one's."""
        if self.decoder is not None:
            launched = self._launch()
            finished = self._collect(*self.in_flight) if self.in_flight else []
            self.in_flight = launched
            return finished
        running = [self.running[slot] for slot in sorted(self.running)]
        active = self._tensor([seq.slot for seq in running])
        pos = self.slots.pos[active]
        # positions 0..pos, as the host knows
        length = max(len(seq.request.prompt_ids) + seq.fed for seq in running)
        self._fit_cache(length)
        dense = {"dense": running[-1].slot == len(running) - 1} if isinstance(self.model, Llama) else {}
        logits = self.model.decode(self.k_cache, self.v_cache, self.slots.token[active], pos, active, length,
                                   **dense)
        u = counter_uniform(self.seed, self.slots.request[active], pos)
        tokens, logprobs = sample(logits, self.slots.temperature[active], self.slots.top_p[active], u,
                                  Passes.of(seq.request.params for seq in running))
        self.slots.token[active] = tokens
        self.slots.pos[active] += 1
        finished = []
        for seq, token, logprob in zip(running, tokens.tolist(), logprobs.tolist()):
            seq.fed += 1
            self._record(seq, token, logprob, self.version, finished)
        return finished

    def _launch(self):
        """Queue a static step for every sequence that may still need a token: (the step, them, the version
        its tokens come from), or None when every running sequence has had its last token launched."""
        live = [seq for seq in self.running.values() if seq.fed < seq.request.params.max_new_tokens]
        if not live:
            return None
        rows, width = self.decoder.shape(max(seq.slot for seq in live) + 1,
                                         max(len(seq.request.prompt_ids) + seq.fed for seq in live))
        launched = self.decoder.launch(rows, width, Passes.of(seq.request.params for seq in live))
        for seq in live:
            seq.fed += 1
        return launched, live, self.version

    def _collect(self, launched, live: list[Sequence], version: int) -> list[Completion]:
        """Record a static step's tokens. A sequence that finished at the step before was decoded in vain: its
        slot is free, or another's now, and its row is dropped."""
        values = self.decoder.read(launched)
        finished = []
        for seq in live:
            if self.running.get(seq.slot) is seq:
                token, logprob = values[seq.slot]
                self._record(seq, int(token), logprob, version, finished)
        return finished

    def _record(self, seq: Sequence, token: int, logprob: float, version: int, finished: list) -> None:
        seq.token_ids.append(token)
        seq.logprobs.append(logprob)
        seq.versions.append(version)
        reason = seq.finish_reason(self.vocabulary)
        if reason is not None:
            finished.append(seq.completion(reason))
            self._release(seq.slot)

    def _release(self, slot: int) -> None:
        seq = self.running.pop(slot)
        if seq.request.park:
            self.parked[seq.request.request_id] = (slot, seq.request.prompt_ids + seq.token_ids,
                                                   seq.cache_weights)
        else:
            heapq.heappush(self.free, slot)


@dataclass(frozen=True)
class BuiltinEngineSpec:
    """How a rollout process builds a built-in engine (engines/sglang.py's SGLangSpec builds the other
    kind)."""
    max_batch: int  # sequences decoded together (cache slots)
    max_len: int  # prompt + completion tokens of the longest sequence
    dtype: str  # rollout.dtype, settled: the engine's weights, float32 | bfloat16
    device: str  # cpu | cuda:N
    # A GPU shared with a trainer rank (the one-GPU layout): the most of it this process may take (0: no cap)
    memory_fraction: float = 0.0
    # the GPU plan's decode step (engines/static_decode.py); the CPU plan's decodes its rows
    static: bool = False
    cuda_graphs: bool = False  # rollout.cuda_graphs: that step as CUDA graphs, where the device is a GPU

    # What it can do (engines/base.py EngineSpec); class attributes, not fields
    plans = ("cpu", "gpu")
    requires, install = None, ""
    preference = 0
    tensor_parallel = False  # one GPU per engine
    nccl_weights = False  # weights over CUDA IPC (or shared memory on the CPU)
    stop_strings = True

    @classmethod
    def on_cpu(cls, max_batch: int, max_len: int, dtype: str) -> "BuiltinEngineSpec":
        return cls(max_batch, max_len, dtype, "cpu")

    @classmethod
    def on_gpu(cls, plan, worker: int, max_batch: int, max_len: int, dtype: str) -> "BuiltinEngineSpec":
        """On the GPU plan (launch/gpu.py): on the worker's GPU, capped where it shares that GPU with a
        trainer rank."""
        layout = plan.layout
        share = layout.mem_fraction_static if layout.time_shared and plan.device_type == "cuda" else 0.0
        return cls(max_batch, max_len, dtype, plan.engine_device(worker), memory_fraction=share, static=True,
                   cuda_graphs=plan.cuda_graphs)

    @staticmethod
    def model_notice(model_config) -> str:
        from engines.arch import engine_path

        path, architecture = engine_path(model_config)
        return f"engine: {'fast path' if path == 'fast' else 'fallback'} ({architecture})"

    @staticmethod
    def bucket_payloads(flat: torch.Tensor, slots: list, tp_size: int) -> list[torch.Tensor]:
        """How a weight bucket travels to a built-in engine: the tensor itself. The queue pickles a CUDA
        tensor as a CUDA IPC handle (torch's reductions) and a CPU tensor as shared memory; its bytes are in
        place first."""
        if flat.is_cuda:
            torch.cuda.current_stream(flat.device).synchronize()
        return [flat] * tp_size

    @contextmanager
    def open(self, weights_path: str, seed: int):
        from transformers import AutoModelForCausalLM

        device = torch.device(self.device)
        if device.type == "cuda":
            torch.cuda.set_device(device)
            if self.memory_fraction:
                torch.cuda.set_per_process_memory_fraction(self.memory_fraction, device)
        # The engine copies the weights into its own layout; the Hugging Face model is dropped at once.
        engine = BuiltinEngine(AutoModelForCausalLM.from_pretrained(weights_path, dtype=torch.float32),
                               self.max_batch, self.max_len, seed, getattr(torch, self.dtype), device,
                               static=self.static, cuda_graphs=self.cuda_graphs)
        if device.type == "cpu" and not engine.release_when_idle:
            # Such an engine frees its blocked weights every version and makes them again at once
            # (engines/llama.py), and its decode steps' logits every step: chunks that glibc would unmap or
            # trim, and the next ones fault their pages in again (about 70 of the 120 ms of blocking SmolLM2's
            # weights). Kept resident instead: the default run's wait for its batch about 0.9x (463deef,
            # docs/benchmarks.md).
            keep_freed_chunks(True, top=KEEP_TOP + sum(t.nbytes for t in engine.weight_tensors().values()))
        yield engine


SPEC = BuiltinEngineSpec  # what engines.ENGINES.get("builtin") offers
