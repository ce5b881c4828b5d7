"""The GPU layout: which GPUs run SGLang generation engines (in tensor-parallel groups) and which run FSDP2
ranks.

    plan_layout(8)                         # 4 generation engines (tp 1) on GPUs 0-3, 4 trainer ranks on 4-7
    plan_layout(8, gen_gpus=6)             # 6 engines + 2 trainer ranks
    plan_layout(8, gen_gpus=4, tp_size=2)  # 2 engines of 2 GPUs each + 4 trainer ranks
    plan_layout(1)                         # time-shared: one engine and one trainer rank on GPU 0

A pure function of numbers, so it is tested on machines without a GPU. Generation takes the low GPU ids,
each engine a contiguous block (SGLang's `base_gpu_id` with `gpu_id_step=1`); training takes the rest.
"""
from dataclasses import dataclass

# SGLang's `mem_fraction_static` (weights + KV cache, of the whole GPU) when an engine has its GPUs alone:
# the rest holds CUDA graphs and activations of the forward pass.
DEDICATED_MEM_FRACTION = 0.85
# On one GPU the trainer shares it. FSDP2 with fp32 master weights and AdamW needs ~16 bytes per parameter
# (+ activations), the engine ~2 (bf16) + the KV cache: 0.35 leaves 65% to training, enough for a 1.5B model
# on 80 GB (24 GB of optimizer state + activations) with ~25 GB of KV cache for generation.
SHARED_MEM_FRACTION = 0.35
TRAIN_BYTES_PER_MODEL_BYTE = 8  # fp32 weights + fp32 grads + two fp32 AdamW moments = 16 B/param = 8x bf16


@dataclass(frozen=True)
class Layout:
    gen_groups: tuple[tuple[int, ...], ...]  # GPU ids of each generation engine (its TP group)
    train_gpus: tuple[int, ...]  # one FSDP2 rank per GPU, rank i on train_gpus[i]
    time_shared: bool  # generation and training share the same GPU(s)
    mem_fraction_static: float  # SGLang's share of each of its GPUs (weights + KV cache)

    @property
    def tp_size(self) -> int:
        return len(self.gen_groups[0])

    @property
    def num_engines(self) -> int:
        return len(self.gen_groups)

    @property
    def num_trainer_ranks(self) -> int:
        return len(self.train_gpus)

    def base_gpu_id(self, engine: int) -> int:
        """SGLang's `base_gpu_id` for engine `engine`: the first GPU of its TP group."""
        return self.gen_groups[engine][0]

    def colocated(self) -> bool:
        """Whether every generation GPU also hosts a trainer rank (weights then never leave the GPU)."""
        return set(g for group in self.gen_groups for g in group) <= set(self.train_gpus)

    def describe(self) -> str:
        engines = ", ".join("+".join(map(str, g)) for g in self.gen_groups)
        share = " (time-shared)" if self.time_shared else ""
        return (f"generation: {self.num_engines} engine(s) tp={self.tp_size} on GPU {engines}; "
                f"training: {self.num_trainer_ranks} FSDP2 rank(s) on GPU "
                f"{','.join(map(str, self.train_gpus))}{share}; "
                f"mem_fraction_static={self.mem_fraction_static}")


def plan_layout(num_gpus: int, gen_gpus: int = 0, train_gpus: int = 0, tp_size: int = 0,
                mem_fraction: float = 0.0, model_bytes: int = 0, gpu_bytes: int = 0,
                num_kv_heads: int = 0) -> Layout:
    """Split `num_gpus` GPUs between generation and training.

    gen_gpus / train_gpus: GPUs for each side (0: half each, generation rounded to whole TP groups).
    tp_size: GPUs per engine (0: the smallest power of two whose share of the bf16 weights, `model_bytes`,
        fits half of an engine's static memory, so the other half is KV cache; 1 when sizes are unknown).
    mem_fraction: SGLang's `mem_fraction_static` (0: 0.85 with dedicated GPUs, 0.35 when time-shared).
    num_kv_heads: the model's KV heads, which TP must divide (0: unchecked).
    """
    if num_gpus < 1:
        raise ValueError("no CUDA GPU is visible; use cluster=cpu, or check CUDA_VISIBLE_DEVICES")
    if gen_gpus < 0 or train_gpus < 0 or tp_size < 0:
        raise ValueError(f"GPU counts must be >= 0 "
                         f"(got gen_gpus={gen_gpus}, train_gpus={train_gpus}, tp_size={tp_size})")
    if not 0 <= mem_fraction < 1:
        raise ValueError(f"cluster.mem_fraction_static must be in (0, 1) (0: the default), "
                         f"got {mem_fraction}")
    if num_gpus == 1:
        return _time_shared(gen_gpus, train_gpus, tp_size, mem_fraction, model_bytes, gpu_bytes)

    fraction = mem_fraction or DEDICATED_MEM_FRACTION
    tp = tp_size or _auto_tp(model_bytes, gpu_bytes, fraction, num_kv_heads, limit=num_gpus - 1)
    if num_kv_heads and num_kv_heads % tp:
        raise ValueError(f"tp_size={tp} does not divide the model's {num_kv_heads} KV heads; pick a divisor")
    if gen_gpus == 0:
        gen_gpus = max(tp, (num_gpus - train_gpus if train_gpus else num_gpus // 2) // tp * tp)
    if train_gpus == 0:
        train_gpus = num_gpus - gen_gpus
    if gen_gpus % tp:
        raise ValueError(f"tp_size={tp} does not divide the {gen_gpus} generation GPUs; "
                         f"use a multiple of {tp}")
    if train_gpus < 1 or gen_gpus + train_gpus > num_gpus:
        raise ValueError(f"{gen_gpus} generation + {train_gpus} training GPUs do not fit in the {num_gpus} "
                         f"visible; lower cluster.gen_gpus or cluster.train_gpus")
    _check_trainer_fits(model_bytes, gpu_bytes, train_gpus, 1.0)
    gen = tuple(tuple(range(start, start + tp)) for start in range(0, gen_gpus, tp))
    train = tuple(range(gen_gpus, gen_gpus + train_gpus))
    return Layout(gen, train, time_shared=False, mem_fraction_static=fraction)


def generation_layout(num_gpus: int, tp_size: int = 1, mem_fraction: float = 0.0) -> Layout:
    """A generator node's GPUs (cluster=ray, launch/agent.py): engines only, `tp_size` GPUs each, and no
    trainer rank (the trainer node trains)."""
    tp = tp_size or 1
    if num_gpus < 1 or num_gpus % tp:
        raise ValueError(f"a generator node's {num_gpus} GPUs must be a positive multiple of "
                         f"cluster.tp_size={tp}")
    gen = tuple(tuple(range(start, start + tp)) for start in range(0, num_gpus, tp))
    return Layout(gen, (), time_shared=False, mem_fraction_static=mem_fraction or DEDICATED_MEM_FRACTION)


def _time_shared(gen_gpus, train_gpus, tp_size, mem_fraction, model_bytes, gpu_bytes) -> Layout:
    """One GPU: one engine and one trainer rank in separate processes on GPU 0, memory split statically."""
    if gen_gpus > 1 or train_gpus > 1 or tp_size > 1:
        raise ValueError(f"one GPU visible: generation and training share it (got gen_gpus={gen_gpus}, "
                         f"train_gpus={train_gpus}, tp_size={tp_size}); leave them at 0 or 1")
    fraction = mem_fraction or SHARED_MEM_FRACTION
    if model_bytes and gpu_bytes and model_bytes > fraction * gpu_bytes / 2:
        raise ValueError(f"the bf16 weights ({model_bytes / 2**30:.1f} GiB) take over half of the engine's "
                         f"{fraction} of the GPU; raise cluster.mem_fraction_static or use more GPUs")
    _check_trainer_fits(model_bytes, gpu_bytes, 1, 1.0 - fraction)
    return Layout(((0,),), (0,), time_shared=True, mem_fraction_static=fraction)


def _auto_tp(model_bytes, gpu_bytes, fraction, num_kv_heads, limit) -> int:
    """Smallest power of two (<= limit) whose weight share fits half of the static memory of one GPU."""
    if not (model_bytes and gpu_bytes):
        return 1
    tp = 1
    while model_bytes / tp > fraction * gpu_bytes / 2 or (num_kv_heads and num_kv_heads % tp):
        tp *= 2
        if tp > limit:
            raise ValueError(f"the model ({model_bytes / 2**30:.1f} GiB in bf16) does not fit a generation "
                             f"engine of up to {limit} GPUs; use a smaller model or more GPUs")
    return tp


def _check_trainer_fits(model_bytes: int, gpu_bytes: int, ranks: int, share: float) -> None:
    """FSDP2 shards weights, gradients and optimizer state over the ranks; activations need room on top."""
    if not (model_bytes and gpu_bytes):
        return
    need = TRAIN_BYTES_PER_MODEL_BYTE * model_bytes / ranks
    if need > 0.8 * share * gpu_bytes:
        raise ValueError(f"training state of {need / 2**30:.1f} GiB per rank "
                         f"does not fit {share * gpu_bytes / 2**30:.1f} "
                         f"GiB of GPU memory; give training more GPUs (cluster.train_gpus)")


def auto_plan(num_gpus: int) -> str:
    """`cluster=auto`: the CPU plan without CUDA, the GPU plan (layout from the GPU count) with it."""
    return "gpu" if num_gpus > 0 else "cpu"
