"""What every generation engine speaks, whatever it runs on: requests in, completions out, weights between
steps.

The vocabulary (`SamplingParams`, `Request`, `Completion`) and the two roles an engine plays are written here,
so that the rollout worker, the evaluation and the launcher depend on this file and never on one engine:

- `Engine`: the built-in engine (`engines/builtin.py`) and the SGLang adapter (`engines/sglang.py`).
- `EngineSpec`: how a rollout process builds its engine (`BuiltinEngineSpec`, `SGLangSpec`).
- `WeightPath`: the trainer's weights to the engines after every batch (`engines/weights.py` `WeightStore` in
  shared memory; `engines/weight_sync.py` `GPUWeights` in buckets over CUDA IPC or NCCL), through the engine's
  weight receipt (`weight_tensors`, `begin_weights`, `load_bucket`, `adopt_weights`), never its name.

`tests/test_contracts.py` runs every implementation through the same checks.
"""
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Callable, Iterable, Protocol, runtime_checkable


@dataclass
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0  # nucleus mass kept; 1 keeps the full vocabulary
    max_new_tokens: int = 16
    stop_token_ids: tuple[int, ...] = ()
    # Text that ends a sequence as a stop token does (a tool call's closing tag, `</calc>`), matched on the
    # text of the tokens sampled so far; the engine needs the text of every token id first
    # (`Engine.use_vocabulary`).
    stop_strings: tuple[str, ...] = ()


@dataclass
class Request:
    request_id: int
    prompt_ids: list[int]
    params: SamplingParams
    # Multi-turn episodes: `park` keeps the finished sequence's cache (its slot stays parked, evicted oldest
    # first when a slot is needed); `resume` names a parked request whose prompt and tokens begin this prompt,
    # so only the new tokens are prefilled. A resume whose sequence was evicted is a full prefill: correct,
    # slower. Engines without slots of their own (SGLang, whose radix cache finds the prefix) may ignore both.
    park: bool = False
    resume: int | None = None


@dataclass
class Completion:
    request_id: int
    prompt_ids: list[int]
    token_ids: list[int]  # generated tokens, the stop token included when one was sampled
    logprobs: list[float]  # log softmax(logits / T) over the full vocabulary at each sampled token
    versions: list[int]  # engine.version when each token was sampled
    finish_reason: str  # "stop" | "length"


def check_request(request: Request, max_len: int | None = None) -> None:
    """The promises every engine asks of a request, as one-line ValueErrors."""
    n_prompt, params = len(request.prompt_ids), request.params
    if n_prompt == 0:
        raise ValueError(f"request {request.request_id} has an empty prompt; give it at least one token")
    if params.max_new_tokens < 1:
        raise ValueError(f"request {request.request_id}: max_new_tokens must be >= 1, "
                         f"got {params.max_new_tokens}")
    if max_len is not None and n_prompt + params.max_new_tokens > max_len:
        raise ValueError(f"request {request.request_id}: prompt {n_prompt} + max_new_tokens "
                         f"{params.max_new_tokens} > max_len {max_len}; raise max_len or shorten it")
    if params.temperature < 0 or not 0 < params.top_p <= 1:
        raise ValueError(f"request {request.request_id}: need temperature >= 0 and 0 < top_p <= 1")


def completes_stop_string(text: str, piece: str, stop_strings: tuple[str, ...]) -> bool:
    """Whether `text`, which ends with the newest token's `piece`, now holds a stop string: one may end inside
    that token's text, never before it (it would have stopped earlier)."""
    tail = text[-(max(map(len, stop_strings)) + len(piece)):]
    return any(stop in tail for stop in stop_strings)


def cut_at_stop_string(completion: Completion, stop_strings: tuple[str, ...],
                       vocabulary: list[str]) -> Completion:
    """`completion` ended at the first token whose text completes a stop string (reason "stop"): for an engine
    that cannot stop on text itself, at the price of the tokens it sampled past it."""
    if not stop_strings:
        return completion
    text = ""
    for n, token in enumerate(completion.token_ids, 1):
        piece = vocabulary[token]
        text += piece
        if completes_stop_string(text, piece, stop_strings):
            return Completion(completion.request_id, completion.prompt_ids, completion.token_ids[:n],
                              completion.logprobs[:n], completion.versions[:n], "stop")
    return completion


def run_to_completion(engine: "Engine", requests: list[Request]) -> list[Completion]:
    """Every engine's `generate`: `requests` through add/step on an idle engine, completions in request
    order."""
    if engine.num_running() or engine.num_waiting():
        raise ValueError("generate() needs an idle engine; drive it with add()/step() when mixing requests")
    if len({r.request_id for r in requests}) != len(requests):
        raise ValueError("generate() got repeated request_ids; give every request its own id")
    for request in requests:
        engine.add(request)
    done = {}
    while engine.num_running() or engine.num_waiting():
        done.update((c.request_id, c) for c in engine.step())
    return [done[r.request_id] for r in requests]


@runtime_checkable
class Engine(Protocol):
    """Continuous batching: `add` requests, call `step` (admit, decode) and collect what finishes. Every token
    records `version`, the policy version of the weights that sampled it; `set_version` changes it between
    two steps, when new weights have been loaded, and sequences in flight continue under them."""
    version: int

    def add(self, request: Request) -> None: ...

    def step(self) -> list[Completion]: ...

    def generate(self, requests: list[Request]) -> list[Completion]:
        """Run `requests` to completion on an idle engine; completions in the order of the requests (every
        engine's is `run_to_completion`)."""
        ...

    def set_version(self, version: int) -> None: ...

    def num_running(self) -> int: ...

    def num_waiting(self) -> int: ...

    def free_slots(self) -> int:
        """Sequences that could start decoding now (parked ones count: they are evicted when a slot is
        needed)."""
        ...

    def use_vocabulary(self, texts: list[str]) -> None:
        """The text of every token id, for `SamplingParams.stop_strings`."""
        ...

    # The weight receipt: how a new version arrives, between two steps. A weight path (engines/weights.py,
    # engines/weight_sync.py) calls begin_weights, then copies into weight_tensors() or hands over each bucket
    # with load_bucket, then adopt_weights; it never asks which engine it feeds.

    def weight_tensors(self) -> dict:
        """The weights this process holds, by Hugging Face name, to copy into in place; {} for an engine whose
        weights live elsewhere (SGLang's processes), which takes buckets only."""
        ...

    def begin_weights(self) -> list[Completion]:
        """A new version starts to arrive: decode nothing until it is adopted. Returns requests that finished
        meanwhile (an engine that interrupts its requests to load may finish some)."""
        ...

    def load_bucket(self, message) -> None:
        """One bucket of the version (engines/buckets.py `BucketMessage`), its payloads in the form this
        engine kind's spec asked for (`EngineSpec.bucket_payloads`)."""
        ...

    def adopt_weights(self, version: int) -> list[Completion]:
        """The version is complete: tokens from now on record it. Returns requests that finished meanwhile."""
        ...


@runtime_checkable
class EngineSpec(Protocol):
    """How a rollout process builds its engine: picklable, so it crosses the spawn; the engine itself does
    not. What the kind of engine can do is said here, as class attributes, so a plan asks its spec and never
    its name."""
    plans: tuple[str, ...]  # the device plans it runs on: cpu, gpu
    requires: str | None  # the package it needs beyond PyTorch (None: none), and how to install it
    install: str
    preference: int  # rollout.engine=auto takes the highest installed one a plan can run
    tensor_parallel: bool  # one engine over several GPUs (cluster.tp_size > 1)
    nccl_weights: bool  # takes weights by an NCCL broadcast from trainer rank 0 (cluster.weight_sync=nccl)
    # stops on text itself; else its completions are cut after the text (cut_at_stop_string)
    stop_strings: bool

    @classmethod
    def on_cpu(cls, max_batch: int, max_len: int, dtype: str) -> "EngineSpec":
        """Where the CPU plan puts its engines (launch/plan.py)."""
        ...

    @classmethod
    def on_gpu(cls, plan, worker: int, max_batch: int, max_len: int, dtype: str) -> "EngineSpec":
        """Where the GPU plan puts worker `worker`'s engine (launch/gpu.py `GPUPlan`: its layout and
        settings)."""
        ...

    @staticmethod
    def model_notice(model_config) -> str | None:
        """The one line the launcher prints about how this engine will run this model (None: nothing to say);
        a ValueError, one line, for a model it cannot run."""
        ...

    def open(self, weights_path: str, seed: int) -> AbstractContextManager[Engine]:
        """The engine with these weights; closing the context frees it (and any process it started)."""
        ...

    def bucket_payloads(self, flat, slots: list, tp_size: int) -> list:
        """How a weight bucket must travel to this kind of engine, one payload per TP rank (run by trainer
        rank 0, as a static method: the GPU plan's weight path asks the spec, not the engine's name)."""
        ...


@runtime_checkable
class WeightPath(Protocol):
    """From the trainer ranks to every engine, once per published batch (a policy version). Built by the
    launcher before the first spawn and handed to every process; a trainer rank takes the publisher end, a
    rollout worker the follower."""

    def publisher(self, policy, lead: bool, stop) -> Callable[[Iterable, int], None]:
        """`publish(named_tensors, version)`: every rank calls it with the full weights (gathering them is a
        collective); the lead rank ships them. Returns once the engines can load that version."""
        ...

    def follower(self, engine: Engine, index: int) -> Callable[[], list[Completion]]:
        """`sync()`, called by engine `index`'s worker between steps: loads a newer version if there is one,
        never half of one, and sets the engine's version. Returns requests that finished meanwhile."""
        ...
