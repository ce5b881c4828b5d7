"""The GPU plan: generation engines (SGLang, or the built-in engine on CUDA) and FSDP2/NCCL trainer ranks
where launch/layout.py puts them, weights from trainer rank 0 to every engine after each batch (CUDA IPC, or
NCCL for SGLang). docs/gpu.md tells the whole story.

    plan = gpu_plan(cfg.cluster, cfg.rollout, cfg.train.batch_groups // cfg.train.minibatches, meta_model,
                    torch.cuda.device_count(), gpu_bytes, engine="builtin")

train.py runs it exactly as it runs launch.plan.CPUPlan. Engines find their GPUs through SGLang's
`base_gpu_id` with every GPU left visible (no per-process CUDA_VISIBLE_DEVICES): an engine that opens rank 0's
CUDA IPC bucket must see rank 0's GPU. Trainer ranks bind theirs with `torch.cuda.set_device`.
"""
import multiprocessing as mp
import time
from dataclasses import dataclass
from typing import Callable

from launch.layout import Layout, plan_layout
from launch.plan import free_port


def gpu_plan(cluster, rollout, minibatch_groups: int, meta_model, num_gpus: int, gpu_bytes: int,
             engine: str) -> "GPUPlan":
    """The layout for these GPUs and this model; a one-line ValueError for what cannot work. `rollout`: the
    config's rollout section (its dtype is the engines'); `minibatch_groups`: the groups of one optimizer step
    (train.batch_groups / train.minibatches); `engine`: a name of engines.ENGINES
    (launch.plan.engine_kind)."""
    from engines import ENGINES

    model_bytes = 2 * sum(p.numel() for p in meta_model.parameters())  # bf16, as the engines hold it
    kv_heads = getattr(meta_model.config, "num_key_value_heads", None) or 0
    spec = ENGINES.get(engine).SPEC  # what this engine can do
    able = lambda capability: ", ".join(n for n in ENGINES.names()  # noqa
                                        if getattr(ENGINES.get(n).SPEC, capability))
    tp_size = cluster.tp_size if spec.tensor_parallel else 1
    if cluster.tp_size > 1 and not spec.tensor_parallel:
        raise ValueError(f"cluster.tp_size={cluster.tp_size}: the {engine} engine runs on one GPU; use "
                         f"rollout.engine={able('tensor_parallel')} for tensor parallelism")
    layout = plan_layout(num_gpus, cluster.gen_gpus, cluster.train_gpus, tp_size,
                         cluster.mem_fraction_static, model_bytes, gpu_bytes, kv_heads)
    if cluster.weight_sync == "nccl" and layout.time_shared:
        raise ValueError("cluster.weight_sync=nccl needs the engine and trainer rank 0 on different GPUs "
                         "(NCCL refuses two ranks on one GPU); use cluster.weight_sync=ipc on one GPU")
    if cluster.weight_sync == "nccl" and not spec.nccl_weights:
        raise ValueError(f"cluster.weight_sync=nccl needs rollout.engine={able('nccl_weights')}; "
                         f"the {engine} engine loads its weights over CUDA IPC (cluster.weight_sync=ipc)")
    if minibatch_groups % layout.num_trainer_ranks:
        raise ValueError(f"config key 'train.batch_groups' (per minibatch, if train.minibatches > 1) must be "
                         f"divisible by the layout's {layout.num_trainer_ranks} trainer ranks "
                         f"(got {minibatch_groups})")
    return GPUPlan(layout, cluster.weight_sync, cluster.bucket_mb, cluster.activation_checkpointing,
                   engine_kind=engine, engine_dtype=rollout.dtype, device_type=cluster.device,
                   cuda_graphs=rollout.cuda_graphs)


# On one GPU the trainer rank may take what the engine leaves, less this headroom for CUDA's own needs (its
# context, the engine's activations past its static share).
SHARED_GPU_HEADROOM = 0.05


@dataclass(frozen=True)
class GPUPlan:
    """One rollout worker per engine and one trainer rank per training GPU, as `layout` says. The values come
    from the config (`gpu_plan`); the last two are the tests' hooks."""
    layout: Layout
    weight_sync: str  # cluster.weight_sync: ipc | nccl
    bucket_mb: int  # cluster.bucket_mb: the weight-sync bucket on trainer rank 0's GPU
    checkpointing: bool  # cluster.activation_checkpointing, in the trainer ranks
    engine_kind: str  # rollout.engine, settled: a name of engines.ENGINES (launch.plan.engine_kind)
    engine_dtype: str  # rollout.dtype, settled: the engines' weights, as the trainer ships them
    device_type: str  # cluster.device: cuda, or cpu (trainer ranks on gloo, engines on the CPU)
    cuda_graphs: bool = True  # rollout.cuda_graphs: the built-in engine's decode step as CUDA graphs
    # builds each SGLang engine's backend (None: SGLang); the tests fake it
    engine_backend: Callable | None = None
    serialize: Callable | None = None  # a weight bucket -> per-TP-rank payloads (None: the engine kind's own)
    # A new engine could not pick up a weight version half-shipped to the one it replaces: no restarts yet.
    max_restarts = 0  # a class attribute, not a field

    @property
    def rollout_workers(self) -> int:
        return self.layout.num_engines

    @property
    def trainer_ranks(self) -> int:
        return self.layout.num_trainer_ranks

    def weights(self, meta_model, dtype: str = "float32"):  # dtype: buckets travel as the engines take them
        import torch

        from engines import ENGINES
        from engines.buckets import WeightChannel
        from engines.weight_sync import GPUWeights

        nccl = ("127.0.0.1", free_port()) if self.weight_sync == "nccl" else None
        # Buckets travel as this plan's engines take them (the engine kind's spec says how), or as the tests'
        # fake.
        payloads = self.serialize or ENGINES.get(self.engine_kind).SPEC.bucket_payloads
        return GPUWeights(WeightChannel(self.layout.num_engines, mp.get_context("spawn")),
                          [len(group) for group in self.layout.gen_groups], payloads, self.weight_sync,
                          self.bucket_mb << 20, getattr(torch, self.engine_dtype), nccl)

    def engine_device(self, worker: int) -> str:
        return f"cuda:{self.layout.base_gpu_id(worker)}" if self.device_type == "cuda" else "cpu"

    def engine(self, worker: int, max_batch: int, max_len: int, dtype: str):
        from engines import ENGINES

        return ENGINES.get(self.engine_kind).SPEC.on_gpu(self, worker, max_batch, max_len, dtype)

    def evaluator(self, max_len: int, dtype: str):
        """Evaluation on the engines: rank 0 asks each rollout worker for its shard of the test split."""
        from evaluate import EvalChannel

        return EvalChannel(self.layout.num_engines, mp.get_context("spawn"))

    def placement(self, rank: int):
        """A trainer rank on its GPU; on a GPU shared with an engine, capped at what the engine leaves."""
        from trainer.gpu_policy import GPUPlacement

        share = (1.0 - self.layout.mem_fraction_static - SHARED_GPU_HEADROOM if self.layout.time_shared
                 else 0.0)
        return GPUPlacement(self.layout.train_gpus[rank], self.checkpointing, self.device_type,
                            memory_fraction=share)

    def wait_for_engines(self, weights, sup) -> None:
        """One GPU: an engine sizes its KV cache from the memory free when it starts, so the trainer loads its
        model only once every engine is up (or a process has ended: the supervisor then says why)."""
        if not self.layout.time_shared:
            return
        while not weights.engines_ready() and not sup.ended():
            time.sleep(0.2)
