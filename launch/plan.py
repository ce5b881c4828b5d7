"""The device plan: where generation and training run, and the pieces each plan gives the launcher.

A plan (`Plan`: `CPUPlan` here, launch/gpu.py's `GPUPlan`) tells train.py how many rollout workers and trainer
ranks to start, what weight path joins them (`weights`), how each worker builds its engine (`engine`), where
each trainer rank runs (`placement`) and how rank 0 evaluates (`evaluator`); train.py's loops and the
processes' loops are the same for both.
"""
import importlib.util
import os
import socket
from dataclasses import dataclass
from typing import Protocol, runtime_checkable

from launch.layout import auto_plan


def device_plan(plan: str, num_gpus: int, device: str = "cuda") -> str:
    """`cpu` or `gpu`; `auto` is gpu when torch sees CUDA GPUs. device: cluster.device (cpu: the GPU plan may
    run without a GPU, on the CPU)."""
    chosen = auto_plan(num_gpus) if plan == "auto" else plan
    if chosen == "gpu" and num_gpus == 0 and device == "cuda":
        raise ValueError("cluster.plan=gpu needs CUDA GPUs and torch sees none; use cluster=cpu (or "
                         "cluster.device=cpu to try the GPU plan's code on the CPU)")
    return chosen


def compute_device(plan: str, device: str) -> str:
    """What the plan's processes compute on, for the choices that depend on it (precision, engine): `gpu` for
    the GPU plan on CUDA, `cpu` for the CPU plan and for the GPU plan run with cluster.device=cpu."""
    return "gpu" if plan == "gpu" and device == "cuda" else "cpu"


def native_bf16(plan: str) -> bool:
    """Whether the plan's devices compute bf16 natively: CUDA GPUs do; a CPU does with AVX-512 (oneDNN's bf16
    kernels). Without it, as on a CPU with AVX2 only, a bf16 matmul falls back to a generic loop, about 100x
    slower than float32 (0.7 vs 66 GFLOP/s measured on such a 2-core AMD EPYC)."""
    import torch

    return plan == "gpu" or torch.backends.cpu.get_cpu_capability().startswith("AVX512")


def resolve_precision(rollout_dtype: str, autocast: str, plan: str) -> tuple[str, str, str | None]:
    """`rollout.dtype` and `train.autocast` with `auto` settled for this machine, and a one-line notice when
    auto had to settle for float32."""
    native = native_bf16(plan)
    dtype = rollout_dtype if rollout_dtype != "auto" else ("bfloat16" if native else "float32")
    mixed = autocast if autocast != "auto" else ("bfloat16" if native else "none")
    notice = None
    if not native and "auto" in (rollout_dtype, autocast):
        notice = ("notice: this CPU has no native bf16 (no AVX-512), so generation and training run in "
                  "float32 (rollout.dtype=bfloat16 train.autocast=bfloat16 force bf16)")
    return dtype, mixed, notice


PLAN_NAMES = {"cpu": "the CPU plan", "gpu": "the GPU plan (CUDA GPUs)"}


def engine_kind(choice: str, plan: str) -> tuple[str, str | None]:
    """The engine (a name of engines.ENGINES) for `rollout.engine=choice` on this plan, and a one-line notice
    when auto had to settle for a slower one. Decided from what each engine's spec says it can do: the plans
    it runs on, the package it needs, its preference (engines/base.py EngineSpec), never from its name."""
    from engines import ENGINES

    specs = {name: ENGINES.get(name).SPEC for name in ENGINES.names()}
    runnable = sorted((n for n, s in specs.items() if plan in s.plans), key=lambda n: -specs[n].preference)

    def installed(name: str) -> bool:
        return specs[name].requires is None or importlib.util.find_spec(specs[name].requires) is not None

    if choice == "auto":
        chosen = next(n for n in runnable if installed(n))
        best = specs[runnable[0]]
        notice = None if chosen == runnable[0] else (
            f"notice: {best.requires} is not installed, so {PLAN_NAMES[plan].split(' (')[0]} generates with "
            f"the {chosen} engine (slower; {best.install} for {runnable[0]})")
        return chosen, notice
    spec = specs[choice]  # the schema has refused names that are not engines
    if plan not in spec.plans:
        instead = f"; use rollout.engine={runnable[0]} here" if runnable else ""
        raise ValueError(f"rollout.engine={choice} needs "
                         f"{' or '.join(PLAN_NAMES[p] for p in spec.plans)}{instead}")
    if not installed(choice):
        raise ValueError(f"rollout.engine={choice}: {spec.requires} is not installed; {spec.install}, or use "
                         f"rollout.engine={next(n for n in runnable if installed(n))}")
    return choice, None


@runtime_checkable
class Plan(Protocol):
    rollout_workers: int  # rollout processes, one engine each
    trainer_ranks: int  # trainer processes, one Placement each
    max_restarts: int  # a dead rollout worker is restarted this many times

    def weights(self, meta_model, dtype: str = "float32"):
        """The weight path (engines.base.WeightPath) for this model's parameters, built before any spawn.
        `dtype`: the engines' (rollout.dtype, settled), in which the CPU plan's store holds them."""
        ...

    def engine(self, worker: int, max_batch: int, max_len: int, dtype: str):
        """How rollout worker `worker` builds its engine (an engines.base.EngineSpec)."""
        ...

    def placement(self, rank: int):
        """Where trainer rank `rank` runs (a trainer.policy.Placement)."""
        ...

    def evaluator(self, max_len: int, dtype: str):
        """How rank 0 evaluates (an evaluate.Evaluator); max_len: the longest evaluation request."""
        ...

    def wait_for_engines(self, weights, sup) -> None:
        """Block until the trainer ranks may start (after the engines have claimed their memory)."""
        ...


@dataclass(frozen=True)
class CPUPlan:
    """CPU engines (the built-in one unless rollout.engine names another), FSDP2 over gloo, weights through a
    shared-memory WeightStore."""
    rollout_workers: int
    trainer_ranks: int
    max_restarts: int  # a dead rollout worker is restarted this many times
    engine_kind: str  # rollout.engine, settled for this plan (engine_kind): a module of engines.ENGINES
    checkpointing: bool = False  # cluster.activation_checkpointing, in the trainer ranks

    def weights(self, meta_model, dtype: str = "float32"):
        import torch

        from engines.weights import WeightStore

        return WeightStore.for_model(meta_model, getattr(torch, dtype))

    def engine(self, worker: int, max_batch: int, max_len: int, dtype: str):
        from engines import ENGINES

        return ENGINES.get(self.engine_kind).SPEC.on_cpu(max_batch, max_len, dtype)

    def placement(self, rank: int):
        from trainer.policy import CPUPlacement

        return CPUPlacement(self.checkpointing)

    def evaluator(self, max_len: int, dtype: str):
        """Evaluation on a built-in engine of rank 0's own that follows the weight store."""
        from evaluate import EngineEvaluator

        return EngineEvaluator(self.engine(0, 64, max_len, dtype))

    def wait_for_engines(self, weights, sup) -> None:
        """CPU engines claim no memory that the trainers must leave them: the trainers start at once."""


def cores_for(cluster, plan: Plan, max_staleness: int):
    """Who gets the cores (runtime/cores.py): shared by phase on the CPU plan with threads_per_process=0, else
    a fixed count per process (1 on the GPU plan, whose processes compute on the GPU)."""
    from runtime.cores import Cores

    workers, ranks = plan.rollout_workers, plan.trainer_ranks
    fixed = cluster.threads_per_process or (0 if isinstance(plan, CPUPlan) else 1)
    return Cores(len(os.sched_getaffinity(0)), workers, ranks, max_staleness, fixed)


def quiet_libraries() -> None:
    """Before loading anything: no tokenizer threads beside ours, one progress bar (ours), not one per
    load."""
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def pin_threads(threads: int) -> None:
    """Before spawning: children inherit these, so no process's thread pools grow past `threads`."""
    for var in ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS"):
        os.environ[var] = str(threads)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
