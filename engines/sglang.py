"""The GPU generation engine: SGLang's offline `Engine` behind engines.base.Engine, with interruptible
generation.

    with SGLangSpec(tp_size=1, base_gpu_id=0, mem_fraction_static=0.85, max_batch=64, dtype="bfloat16").open(
            model_path, seed=0) as engine:
    engine.add(Request(0, prompt_ids, SamplingParams(temperature=1.0, max_new_tokens=256)))
    finished = engine.step()               # Completions, as from any engines.base.Engine
    begin_weights(); load_bucket(m)...; adopt_weights(v)   # a new version, through engines/weight_sync.py

A new weight version interrupts the requests in flight (AReaL): SGLang aborts them and returns what each
generated so far; after the load each is resubmitted as prompt + tokens so far with the remaining budget, so
its later tokens record the new version. `Partial` holds that bookkeeping; everything that talks to SGLang
is in `SGLangBackend`, so the rest runs on the CPU in tests against a fake backend.
"""
import asyncio
from collections import deque
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

from engines.base import (
    Completion,
    Request,
    SamplingParams,
    check_request,
    cut_at_stop_string,
    run_to_completion,
)


def sampling_params(params: SamplingParams, max_new_tokens: int) -> dict:
    """An engine-neutral SamplingParams in SGLang's names. SGLang's logprobs are log softmax(logits / T) over
    the full vocabulary (before top-p), as the built-in engine's and the trainer's are. SGLang stops on the
    stop strings itself (a tool call's closing tag), keeping the token that completes one (no_stop_trim)."""
    return {"temperature": params.temperature, "top_p": params.top_p, "max_new_tokens": max_new_tokens,
            "stop_token_ids": list(params.stop_token_ids), "stop": list(params.stop_strings),
            "skip_special_tokens": False, "no_stop_trim": True}


@dataclass
class Partial:
    """One request and what it has generated so far, across interruptions."""
    request: Request
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)

    def remaining(self) -> int:
        return self.request.params.max_new_tokens - len(self.token_ids)

    def resume_input(self) -> list[int]:
        """What to submit next: the prompt followed by every token generated so far."""
        return self.request.prompt_ids + self.token_ids

    def merge(self, output: dict, version: int) -> str | None:
        """Append one SGLang output (finished or aborted) sampled under `version`.

        Returns "stop" or "length" when the request is complete, None when it was interrupted."""
        meta = output["meta_info"]
        for logprob, token, *_ in meta.get("output_token_logprobs") or []:
            self.token_ids.append(int(token))
            self.logprobs.append(float(logprob))
            self.versions.append(version)
        if self.token_ids and self.token_ids[-1] in self.request.params.stop_token_ids:
            return "stop"
        if self.remaining() <= 0:
            return "length"
        reason = (meta.get("finish_reason") or {}).get("type")
        return reason if reason in ("stop", "length") else None  # "abort": resubmit

    def completion(self, reason: str) -> Completion:
        return Completion(self.request.request_id, self.request.prompt_ids, self.token_ids, self.logprobs,
                          self.versions, reason)


class SGLangEngine:
    def __init__(self, backend, max_batch: int, poll_s: float = 0.005):
        """backend: SGLangBackend (SGLangSpec.open builds it), or the tests' fake; max_batch: requests in
        flight."""
        self.backend = backend
        self.max_batch, self.poll_s = max_batch, poll_s
        self.version = 0
        self.vocabulary: list[str] = []  # token id -> text, for stop strings (use_vocabulary)
        self.waiting: deque[Partial] = deque()
        # task -> (request, version it runs under)
        self.running: dict[asyncio.Future, tuple[Partial, int]] = {}

    def set_version(self, version: int) -> None:
        self.version = version

    def num_running(self) -> int:
        return len(self.running)

    def num_waiting(self) -> int:
        return len(self.waiting)

    def free_slots(self) -> int:
        return self.max_batch - len(self.running)

    def add(self, request: Request) -> None:
        check_request(request)
        self.waiting.append(Partial(request))

    def step(self) -> list[Completion]:
        """Submit waiting requests, wait up to poll_s for SGLang, and return the requests that finished."""
        while self.waiting and len(self.running) < self.max_batch:
            self._submit(self.waiting.popleft())
        return self._collect(self.poll_s) if self.running else []

    def generate(self, requests: list[Request]) -> list[Completion]:
        return run_to_completion(self, requests)

    # The weight receipt (engines/base.py): a new version interrupts the requests in flight.

    def begin_weights(self) -> list[Completion]:
        """Pause: SGLang aborts every request in flight and refuses new ones until `adopt_weights`; the
        aborted requests return what they generated so far and wait, in order, for resubmission. Returns the
        requests that completed meanwhile (hand them on like step()'s)."""
        self.backend.pause()
        finished = self._collect(None) if self.running else []
        assert not self.running, "SGLang left requests running after an abort"
        self.backend.begin_update()
        return finished

    def load_bucket(self, message, group_name: str = "ringrl-weights") -> None:
        """One bucket: CUDA IPC handles (this spec's `bucket_payloads`), or an NCCL broadcast from rank 0."""
        if message.payloads is not None:
            self.backend.load_ipc(message.payloads, flush_cache=message.last)
        else:
            self.backend.load_nccl(message.slots, group_name, flush_cache=message.last)

    def adopt_weights(self, version: int) -> list[Completion]:
        self.backend.end_update()
        self.backend.resume()
        self.version = version
        return []

    def weight_tensors(self) -> dict:
        return {}  # the weights live in SGLang's own processes: they arrive in buckets only

    def use_vocabulary(self, texts: list[str]) -> None:
        """SGLang stops on a request's stop strings itself; they are matched here again on what it returns,
        which cuts a turn right after its stop string where SGLang could not see it whole (one that straddles
        a weight update's interruption: SGLang matches the text of what it generated since the resubmission).
        Unrun on a GPU so far."""
        self.vocabulary = list(texts)

    def join_weight_group(self, address: str, port: int, rank_offset: int, world_size: int,
                          group_name: str = "ringrl-weights") -> None:
        """NCCL weight sync only: join trainer rank 0's group (blocks until every member joins)."""
        self.backend.join_nccl(address, port, rank_offset, world_size, group_name)

    def shutdown(self) -> None:
        self.backend.shutdown()

    def _submit(self, partial: Partial) -> None:
        coroutine = self.backend.generate(partial.resume_input(), sampling_params(partial.request.params,
                                                                                  partial.remaining()))
        self.running[self.backend.loop.create_task(coroutine)] = (partial, self.version)

    def _collect(self, timeout: float | None) -> list[Completion]:
        """Wait for at least one task (all of them with timeout=None), merge the outputs, requeue the
        aborted."""
        when = asyncio.ALL_COMPLETED if timeout is None else asyncio.FIRST_COMPLETED
        done, _ = self.backend.loop.run_until_complete(asyncio.wait(list(self.running), timeout=timeout,
                                                                    return_when=when))
        finished, interrupted = [], []
        for task in done:
            partial, version = self.running.pop(task)
            reason = partial.merge(task.result(), version)
            if reason is None:
                interrupted.append(partial)
            else:
                finished.append(cut_at_stop_string(partial.completion(reason),
                                                   partial.request.params.stop_strings, self.vocabulary))
        # Interrupted requests go back to the front, in request order: they are the oldest in flight.
        interrupted.sort(key=lambda p: p.request.request_id)
        self.waiting.extendleft(reversed(interrupted))
        return finished


@dataclass(frozen=True)
class SGLangSpec:
    """How a rollout worker on the GPU plan builds its engine (launch/gpu.py fills it from the layout)."""
    tp_size: int  # GPUs of this engine
    base_gpu_id: int  # the first of them; the rest follow (SGLang's gpu_id_step=1)
    mem_fraction_static: float  # SGLang's share of each of its GPUs: weights + KV cache
    max_batch: int  # requests in flight at once
    dtype: str  # rollout.dtype, settled: the engine's weights
    # Builds the backend from SGLangBackend's arguments; None: SGLang itself. The CPU tests pass a fake.
    backend: Callable | None = None

    # What it can do (engines/base.py EngineSpec); class attributes, not fields
    plans = ("gpu",)
    requires, install = "sglang", "pip install -r requirements-gpu.txt (docs/gpu.md)"
    preference = 1  # the faster engine, where it is installed
    tensor_parallel = True
    nccl_weights = True
    # SGLang stops on text itself (sampling_params' `stop`); cut_at_stop_string stays the guard
    stop_strings = True

    @classmethod
    def on_cpu(cls, max_batch: int, max_len: int, dtype: str):
        raise ValueError("rollout.engine=sglang needs the GPU plan (CUDA GPUs); "
                         "use rollout.engine=builtin here")

    @classmethod
    def on_gpu(cls, plan, worker: int, max_batch: int, max_len: int, dtype: str) -> "SGLangSpec":
        """On the GPU plan (launch/gpu.py): the worker's block of tp_size GPUs and its static memory share."""
        layout = plan.layout
        return cls(layout.tp_size, layout.base_gpu_id(worker), layout.mem_fraction_static, max_batch, dtype,
                   plan.engine_backend)

    @staticmethod
    def model_notice(model_config) -> None:
        return None  # SGLang says itself which models it runs

    @staticmethod
    def bucket_payloads(flat, slots: list, tp_size: int) -> list[bytes]:
        """How a weight bucket travels to an SGLang engine: CUDA IPC handles, one payload per TP rank."""
        return ipc_payloads(flat, slots, tp_size)

    @contextmanager
    def open(self, weights_path: str, seed: int):
        make = self.backend or SGLangBackend
        engine = SGLangEngine(make(weights_path, self.tp_size, self.base_gpu_id, self.mem_fraction_static,
                                   seed, self.dtype), self.max_batch)
        try:
            yield engine
        finally:
            engine.shutdown()  # SGLang's scheduler processes go with it


class SGLangBackend:
    """The only code that calls SGLang: an offline `sglang.Engine` (its own scheduler processes) per
    engine."""

    def __init__(self, model_path: str, tp_size: int, base_gpu_id: int, mem_fraction_static: float, seed: int,
                 dtype: str):
        import sglang

        # Token ids in and out, but with SGLang's tokenizer: it matches stop strings on the text of what it
        # generated (Req.tail_str decodes with it; with skip_tokenizer_init=True a request with stop strings
        # would fail in its scheduler).
        self.engine = sglang.Engine(model_path=model_path, tp_size=tp_size, base_gpu_id=base_gpu_id,
                                    mem_fraction_static=mem_fraction_static, random_seed=seed, dtype=dtype,
                                    skip_tokenizer_init=False, log_level="error")
        self.loop = self.engine.loop

    def generate(self, input_ids: list[int], sampling: dict):
        return self.engine.async_generate(input_ids=input_ids, sampling_params=sampling, return_logprob=True)

    def pause(self) -> None:
        """Abort everything in flight; aborted requests return their partial output (finish_reason abort)."""
        from sglang.srt.managers.io_struct import PauseGenerationReqInput

        manager = self.engine.tokenizer_manager
        self.loop.run_until_complete(manager.pause_generation(PauseGenerationReqInput(mode="abort")))

    def resume(self) -> None:
        from sglang.srt.managers.io_struct import ContinueGenerationReqInput

        manager = self.engine.tokenizer_manager
        self.loop.run_until_complete(manager.continue_generation(ContinueGenerationReqInput()))

    def begin_update(self) -> None:
        # sglang 0.5.21 refuses update_weights_from_tensor/_distributed outside begin/end_weight_update;
        # older versions have no sessions. Both answer (success, message): a refusal stops the worker with it.
        if hasattr(self.engine, "begin_weight_update"):
            check_sglang(self.engine.begin_weight_update(), "begin_weight_update")

    def end_update(self) -> None:
        if hasattr(self.engine, "end_weight_update"):
            check_sglang(self.engine.end_weight_update(), "end_weight_update")

    def load_ipc(self, payloads: list, flush_cache: bool) -> None:
        """Load one IPC bucket (SGLang copies it into its own parameters before returning)."""
        check_sglang(self.engine.update_weights_from_tensor(payloads, load_format="flattened_bucket",
                                                            flush_cache=flush_cache))

    def join_nccl(self, address: str, port: int, rank_offset: int, world_size: int, group_name: str) -> None:
        """Join trainer rank 0's weight group (blocks until rank 0 joins it too)."""
        check_sglang(self.engine.init_weights_update_group(address, port, rank_offset, world_size, group_name,
                                                           backend="nccl"))

    def load_nccl(self, slots: list, group_name: str, flush_cache: bool) -> None:
        """Receive the bucket rank 0 broadcasts and load it."""
        check_sglang(self.engine.update_weights_from_distributed(
            [s.name for s in slots], [str(s.dtype).removeprefix("torch.") for s in slots],
            [list(s.shape) for s in slots], group_name=group_name, flush_cache=flush_cache,
            load_format="flattened_bucket"))

    def shutdown(self) -> None:
        self.engine.shutdown()



SPEC = SGLangSpec  # what engines.ENGINES.get("sglang") offers

def ipc_payloads(flat, slots: list, tp_size: int) -> list[bytes]:
    """The bucket as CUDA IPC handles, one payload per TP rank (each rank deserializes its own copy, which
    keeps torch's IPC reference counts right), in the format `update_weights_from_tensor` takes."""
    import torch
    from sglang.srt.utils import MultiprocessingSerializer
    from sglang.srt.weight_sync.tensor_bucket import FlattenedTensorMetadata
    try:
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions
    except ImportError:  # sglang < 0.5
        from sglang.srt.patch_torch import monkey_patch_torch_reductions

    monkey_patch_torch_reductions()  # handles name the device by UUID, so CUDA_VISIBLE_DEVICES may differ
    torch.cuda.current_stream(flat.device).synchronize()  # the bytes are in place before anyone maps them
    metadata = [FlattenedTensorMetadata(s.name, s.shape, s.dtype, s.start, s.end, s.end - s.start)
                for s in slots]
    return [MultiprocessingSerializer.serialize({"flattened_tensor": flat, "metadata": metadata})
            for _ in range(tp_size)]


def check_sglang(result, call: str = "the weight update") -> None:
    """SGLang's control calls answer (success, message) (some a dict or an object with those fields): a
    refusal is an error that names the call and carries SGLang's message."""
    if isinstance(result, dict):
        result = (result.get("success", True), result.get("message", ""))
    elif hasattr(result, "success"):
        result = (result.success, getattr(result, "message", ""))
    if isinstance(result, tuple) and result and not result[0]:
        raise RuntimeError(f"SGLang refused {call}: {result[1] if len(result) > 1 else result}")
