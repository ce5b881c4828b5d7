"""A stand-in engine for measuring the plumbing around generation (bench/ray_scaling.py): no model runs. Each
`step` waits a fixed delay (a decode step's time, using no core) and gives every running sequence one token
drawn at random, with the logprob of a uniform choice; sequences end at max_new_tokens or a stop token. It
takes its weights like the built-in engine (`weight_tensors`: the model's tensors, held but never read), so
the weight path is exercised whole.

    rollout.engine=simulated                # the delay: RINGRL_SIMULATED_STEP_S seconds (default 0.05),
                                              read where the plan builds the engine's spec

Never chosen by rollout.engine=auto. What it generates is noise: a run's rewards mean nothing.
"""
import math
import os
import random
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from engines.base import Completion, Request, check_request, run_to_completion

DEFAULT_STEP_S = 0.05


class SimulatedEngine:
    def __init__(self, weights: dict, vocab_size: int, max_batch: int, step_s: float, seed: int = 0):
        self.weights, self.vocab_size, self.max_batch, self.step_s = weights, vocab_size, max_batch, step_s
        self.version = 0
        self.rng = random.Random(seed)
        self.waiting: list[Request] = []
        self.running: dict[int, tuple[Request, list[int], list[int]]] = {}  # id: request, tokens, versions

    def add(self, request: Request) -> None:
        check_request(request)
        self.waiting.append(request)

    def step(self) -> list[Completion]:
        while self.waiting and len(self.running) < self.max_batch:
            request = self.waiting.pop(0)
            self.running[request.request_id] = (request, [], [])
        if not self.running:
            return []
        time.sleep(self.step_s)
        done = []
        for rid, (request, tokens, versions) in list(self.running.items()):
            token = self.rng.randrange(self.vocab_size)
            tokens.append(token)
            versions.append(self.version)
            params = request.params
            stopped = token in params.stop_token_ids
            if stopped or len(tokens) >= params.max_new_tokens:
                del self.running[rid]
                done.append(Completion(rid, list(request.prompt_ids), tokens,
                                       [-math.log(self.vocab_size)] * len(tokens), versions,
                                       "stop" if stopped else "length"))
        return done

    def generate(self, requests: list[Request]) -> list[Completion]:
        return run_to_completion(self, requests)

    def set_version(self, version: int) -> None:
        self.version = version

    def num_running(self) -> int:
        return len(self.running)

    def num_waiting(self) -> int:
        return len(self.waiting)

    def free_slots(self) -> int:
        return self.max_batch - len(self.running)

    def use_vocabulary(self, texts: list[str]) -> None:
        pass  # its tokens are random: a stop string would only end them at random too

    def weight_tensors(self) -> dict:
        return self.weights

    def begin_weights(self) -> list[Completion]:
        return []

    def load_bucket(self, message) -> None:
        raise ValueError("the simulated engine takes its weights from the shared-memory store (the CPU plan)")

    def adopt_weights(self, version: int) -> list[Completion]:
        self.version = version
        return []


@dataclass
class SimulatedEngineSpec:
    """How a rollout process builds a simulated engine."""
    max_batch: int
    step_s: float  # a decode step's delay

    plans = ("cpu",)
    requires, install = None, ""
    preference = -1  # rollout.engine=auto never takes it
    tensor_parallel = False
    nccl_weights = False
    stop_strings = False

    @classmethod
    def on_cpu(cls, max_batch: int, max_len: int, dtype: str) -> "SimulatedEngineSpec":
        step_s = float(os.environ.get("RINGRL_SIMULATED_STEP_S", DEFAULT_STEP_S))
        if not step_s >= 0:
            raise ValueError(f"RINGRL_SIMULATED_STEP_S={step_s} must be >= 0 (seconds a decode step takes)")
        return cls(max_batch, step_s)

    @classmethod
    def on_gpu(cls, plan, worker: int, max_batch: int, max_len: int, dtype: str) -> "SimulatedEngineSpec":
        raise ValueError("rollout.engine=simulated runs on the CPU plan only")

    @staticmethod
    def model_notice(model_config) -> str:
        return "engine: simulated (random tokens after a fixed delay a step: for plumbing benches only)"

    @staticmethod
    def bucket_payloads(flat, slots: list, tp_size: int) -> list:
        return [flat] * tp_size

    @contextmanager
    def open(self, weights_path: str, seed: int):
        from models import facts

        meta = facts.meta_model(weights_path)
        weights = {name: torch.zeros(t.shape, dtype=t.dtype) for name, t in meta.state_dict().items()}
        yield SimulatedEngine(weights, facts.checked_config(weights_path).vocab_size, self.max_batch,
                              self.step_s, seed)


SPEC = SimulatedEngineSpec
