"""The typed run configuration: dataclasses with defaults, strict parsing and one-line errors.

Hydra composes `conf/`; `parse` turns the composed dict into these dataclasses, refusing unknown keys and
out-of-range values. `check_overrides` runs before Hydra so that a mistyped override gets the same
one-line message instead of Hydra's multi-line report.
"""
import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any, get_type_hints

CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")
GROUPS = ("algo", "task", "model", "cluster")


@dataclass
class ModelConfig:
    path: str = "smollm2-135m"  # embedded model name, a local Hugging Face folder, or a hub id

    def check(self):
        _require(bool(self.path), "model.path", "must name a model", self.path)


@dataclass
class ClusterConfig:
    plan: str = "auto"  # auto | cpu | gpu: where generation and training run
    rollout_workers: int = 1  # generation processes (CPU plan; on the GPU plan, one per SGLang engine)
    trainer_ranks: int = 1  # FSDP2 training processes (CPU plan; on the GPU plan, one per training GPU)
    threads_per_process: int = 1  # torch threads per process, so the cores are not oversubscribed
    max_restarts: int = 3  # a rollout worker that dies is restarted this many times before the run stops (CPU plan)
    oversubscribe: bool = False  # allow more threads than cores (slower; for trying layouts on a small machine)
    # GPU plan only (conf/cluster/gpu8.yaml, gpu1.yaml; docs/gpu.md):
    gen_gpus: int = 0  # GPUs running SGLang engines (0: half, in whole tensor-parallel groups)
    train_gpus: int = 0  # GPUs running FSDP2 ranks (0: the rest)
    tp_size: int = 1  # GPUs per SGLang engine (0: the smallest that fits the model)
    mem_fraction_static: float = 0.0  # SGLang's share of a generation GPU (0: the layout's default)
    weight_sync: str = "ipc"  # ipc (CUDA IPC handles) | nccl (broadcast from trainer rank 0)
    bucket_mb: int = 512  # weight-sync bucket size
    activation_checkpointing: bool = False  # recompute activations in backward: less memory, more compute

    def check(self):
        _require(self.plan in ("auto", "cpu", "gpu"), "cluster.plan", "must be auto, cpu or gpu", self.plan)
        _require(self.rollout_workers >= 1, "cluster.rollout_workers", "must be >= 1", self.rollout_workers)
        _require(self.trainer_ranks >= 1, "cluster.trainer_ranks", "must be >= 1", self.trainer_ranks)
        _require(self.threads_per_process >= 1, "cluster.threads_per_process", "must be >= 1", self.threads_per_process)
        _require(self.max_restarts >= 0, "cluster.max_restarts", "must be >= 0", self.max_restarts)
        _require(self.gen_gpus >= 0 and self.train_gpus >= 0 and self.tp_size >= 0, "cluster.gen_gpus",
                 "cluster.train_gpus and cluster.tp_size must be >= 0", (self.gen_gpus, self.train_gpus, self.tp_size))
        _require(0 <= self.mem_fraction_static < 1, "cluster.mem_fraction_static", "must be in [0, 1)",
                 self.mem_fraction_static)
        _require(self.weight_sync in ("ipc", "nccl"), "cluster.weight_sync", "must be ipc or nccl", self.weight_sync)
        _require(self.bucket_mb >= 1, "cluster.bucket_mb", "must be >= 1", self.bucket_mb)


@dataclass
class RolloutConfig:
    group_size: int = 8  # K completions sampled per prompt
    temperature: float = 1.0  # sampling temperature (also applied to the trainer's logprobs)
    top_p: float = 1.0  # nucleus sampling threshold
    max_new_tokens: int = 16  # completion budget per sample
    max_batch: int = 64  # sequences decoded together per rollout worker (engine slots)
    max_prompt_len: int = 0  # prompt token budget; longer prompts are skipped or cut (0: the longest in the data)
    long_prompts: str = "skip"  # skip | truncate: what happens to a prompt over max_prompt_len (both counted)
    dtype: str = "bfloat16"  # bfloat16 | float32: the engine's weights and matmuls

    def check(self):
        _require(self.group_size >= 2, "rollout.group_size", "must be >= 2", self.group_size)
        _require(self.temperature > 0, "rollout.temperature", "must be > 0", self.temperature)
        _require(0 < self.top_p <= 1, "rollout.top_p", "must be in (0, 1]", self.top_p)
        _require(self.max_new_tokens >= 1, "rollout.max_new_tokens", "must be >= 1", self.max_new_tokens)
        _require(self.max_batch >= self.group_size, "rollout.max_batch", "must be >= rollout.group_size", self.max_batch)
        _require(self.dtype in ("bfloat16", "float32"), "rollout.dtype", "must be bfloat16 or float32", self.dtype)
        _require(self.max_prompt_len >= 0, "rollout.max_prompt_len", "must be >= 0 (0: no limit)", self.max_prompt_len)
        _require(self.long_prompts in ("skip", "truncate"), "rollout.long_prompts", "must be skip or truncate",
                 self.long_prompts)


@dataclass
class TrainConfig:
    batch_groups: int = 8  # B: prompts (groups of K) per optimizer step
    micro_groups: int = 8  # groups per forward/backward pass, at most (memory vs speed)
    micro_tokens: int = 4096  # padded tokens per pass, at most: long completions go a few groups at a time (0: off)
    lr: float = 2e-5  # AdamW learning rate
    weight_decay: float = 0.0  # AdamW weight decay
    grad_clip: float = 1.0  # max global gradient norm
    autocast: str = "bfloat16"  # bfloat16 | none: mixed precision of the forward/backward (weights stay fp32)
    # torch.compile the decoder stack: about 1.5x faster bf16 steps on the CPU after a compile of one to three
    # minutes (inductor caches it: seconds in later runs); pays off in runs of a hundred steps or more
    compile: bool = False

    def check(self):
        _require(self.batch_groups >= 1, "train.batch_groups", "must be >= 1", self.batch_groups)
        _require(self.micro_groups >= 1, "train.micro_groups", "must be >= 1", self.micro_groups)
        _require(self.micro_tokens >= 0, "train.micro_tokens", "must be >= 0", self.micro_tokens)
        _require(self.lr > 0, "train.lr", "must be > 0", self.lr)
        _require(self.weight_decay >= 0, "train.weight_decay", "must be >= 0", self.weight_decay)
        _require(self.grad_clip > 0, "train.grad_clip", "must be > 0", self.grad_clip)
        _require(self.autocast in ("bfloat16", "none"), "train.autocast", "must be bfloat16 or none", self.autocast)


@dataclass
class EvalConfig:
    every: int = 10  # evaluate on the test split every N steps, and always at the end (0: only at the end)
    k: int = 4  # samples per prompt for pass@k (greedy pass@1 is always reported)
    temperature: float = 1.0  # sampling temperature of the pass@k samples
    max_examples: int = 0  # evaluate on the first N test examples (0: all)
    only: bool = False  # evaluate model.path on the test split and stop, no training

    def check(self):
        _require(self.every >= 0, "eval.every", "must be >= 0", self.every)
        _require(self.k >= 1, "eval.k", "must be >= 1", self.k)
        _require(self.temperature > 0, "eval.temperature", "must be > 0", self.temperature)
        _require(self.max_examples >= 0, "eval.max_examples", "must be >= 0", self.max_examples)


@dataclass
class RewardConfig:
    workers: int = 1  # verifier processes per rollout worker (0: score in the rollout process, no timeout)
    timeout_s: float = 5.0  # a verifier slower than this is killed; the completion scores 0 (counted)

    def check(self):
        _require(self.workers >= 0, "reward.workers", "must be >= 0", self.workers)
        _require(self.timeout_s > 0, "reward.timeout_s", "must be > 0", self.timeout_s)


@dataclass
class BufferConfig:
    sampler: str = "auto"  # auto (the loss's own choice) | fifo | tba
    recent_prob: float = 0.5  # tba: chance that a group is the newest data rather than a replay
    inv_temp: float = 1.0  # tba: replay draws completions with probability ~ exp(inv_temp * reward)
    per_prompt_capacity: int = 64  # tba: newest completions kept per prompt

    def check(self):
        _require(self.sampler in ("auto", "fifo", "tba"), "buffer.sampler", "must be auto, fifo or tba", self.sampler)
        _require(0 <= self.recent_prob <= 1, "buffer.recent_prob", "must be in [0, 1]", self.recent_prob)
        _require(self.inv_temp >= 0, "buffer.inv_temp", "must be >= 0", self.inv_temp)
        _require(self.per_prompt_capacity >= 1, "buffer.per_prompt_capacity", "must be >= 1",
                 self.per_prompt_capacity)


@dataclass
class CheckpointConfig:
    every: int = 0  # save every N steps (0: only at the end)
    keep: int = 0  # newest checkpoints kept on disk (0: all)

    def check(self):
        _require(self.every >= 0, "checkpoint.every", "must be >= 0", self.every)
        _require(self.keep >= 0, "checkpoint.keep", "must be >= 0", self.keep)


@dataclass
class Config:
    steps: int = 30  # optimizer steps to run
    seed: int = 0  # fixes data order, sampling and initialisation
    max_staleness: int = 2  # eta: how many versions older than the learner the data may be (0 = synchronous)
    algo: dict = field(default_factory=dict)  # the loss module's knobs, checked by the module's own Config
    task: dict = field(default_factory=dict)  # the task's knobs, checked by the task's own Config
    model: ModelConfig = field(default_factory=ModelConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    progress: bool = True  # show a progress bar
    logger: str = "none"  # none | tensorboard | wandb: where metrics go besides metrics.jsonl
    resume: str = ""  # a run directory: continue it in place from its latest checkpoint

    def check(self):
        _require(self.steps >= 1, "steps", "must be >= 1", self.steps)
        _require(self.max_staleness >= 0, "max_staleness", "must be >= 0", self.max_staleness)
        _require(self.logger in ("none", "tensorboard", "wandb"), "logger", "must be none, tensorboard or wandb",
                 self.logger)
        _require(self.buffer.sampler != "tba" or self.buffer.per_prompt_capacity >= self.rollout.group_size,
                 "buffer.per_prompt_capacity", f"must be >= rollout.group_size={self.rollout.group_size}",
                 self.buffer.per_prompt_capacity)
        c = self.cluster
        threads = (c.rollout_workers + c.trainer_ranks) * c.threads_per_process
        cores = len(os.sched_getaffinity(0))
        _require(c.plan == "gpu" or c.oversubscribe or threads <= cores, "cluster.rollout_workers",
                 f"+ cluster.trainer_ranks, times cluster.threads_per_process, must fit the {cores} cores here "
                 "(or set cluster.oversubscribe=true)", f"{c.rollout_workers} + {c.trainer_ranks} x {c.threads_per_process}")
        _require(self.train.batch_groups % self.cluster.trainer_ranks == 0, "train.batch_groups",
                 f"must be divisible by cluster.trainer_ranks={self.cluster.trainer_ranks}", self.train.batch_groups)


def _require(ok: bool, key: str, what: str, got: Any) -> None:
    if not ok:
        raise ValueError(f"config key '{key}' {what} (got {got!r})")


def build(cls, data: dict, prefix: str = ""):
    """Build dataclass `cls` from a plain dict: unknown keys and wrong types raise a one-line ValueError."""
    hints = get_type_hints(cls)
    names = {f.name for f in dataclasses.fields(cls)}
    values = {}
    for key, value in (data or {}).items():
        full = f"{prefix}{key}"
        if key not in names:
            raise ValueError(f"unknown config key '{full}' (known: {', '.join(sorted(names))})")
        values[key] = _coerce(hints[key], value, full)
    obj = cls(**values)
    for f in dataclasses.fields(obj):
        if dataclasses.is_dataclass(getattr(obj, f.name)) and f.name not in values:
            getattr(obj, f.name).check()
    if hasattr(obj, "check"):
        obj.check()
    return obj


def _coerce(kind, value, key):
    if dataclasses.is_dataclass(kind):
        if not isinstance(value, dict):
            raise ValueError(f"config key '{key}' must be a mapping (got {value!r})")
        return build(kind, value, key + ".")
    if kind is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if kind is dict and isinstance(value, dict):
        return value
    if kind in (int, float, str, bool, dict) and not (isinstance(value, kind) and not (kind is int and isinstance(value, bool))):
        raise ValueError(f"config key '{key}' must be of type {kind.__name__} (got {value!r})")
    return value


def check_overrides(args: list[str]) -> None:
    """Refuse command-line overrides that name a key the config does not have, before Hydra sees them."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from omegaconf import OmegaConf

    overrides = [a for a in args if "=" in a and not a.startswith("-")]
    parsed = OverridesParser.create().parse_overrides(overrides)
    choices = {}
    for item in OmegaConf.load(os.path.join(CONF_DIR, "config.yaml")).defaults:
        if OmegaConf.is_dict(item):
            choices.update(dict(item))
    for o in parsed:
        key = o.key_or_group
        if key in GROUPS and not o.is_add() and not o.is_delete():
            options = list(o.sweep_string_iterator()) if o.is_sweep_override() else [str(o.value())]
            for option in options:
                if not os.path.exists(os.path.join(CONF_DIR, key, f"{option}.yaml")):
                    known = sorted(f[:-5] for f in os.listdir(os.path.join(CONF_DIR, key)) if f.endswith(".yaml"))
                    raise ValueError(f"unknown {key} '{option}' (choose one of: {', '.join(known)})")
            choices[key] = options
    for o in parsed:
        key = o.key_or_group
        if o.is_add() or o.is_delete() or key in GROUPS or key.startswith("hydra"):
            continue
        head, _, rest = key.partition(".")
        if head in ("algo", "task") and rest:
            options = choices.get(head)
            for option in options if isinstance(options, list) else [options]:
                known = group_keys(head, option)
                if rest.split(".")[0] not in known:
                    raise ValueError(f"unknown config key '{key}' for {head}={option} (known: {', '.join(sorted(known))})")
            continue
        _check_path(Config, key.split("."), key)


def group_keys(group: str, option: str) -> dict:
    """What conf/<group>/<option>.yaml sets under `group`: a `# @package _global_` file (a task that also sets
    rollout keys) nests it under the group's name."""
    from omegaconf import OmegaConf

    with open(os.path.join(CONF_DIR, group, f"{option}.yaml")) as f:
        text = f.read()
    data = OmegaConf.to_container(OmegaConf.create(text))
    return data.get(group, {}) if text.startswith("# @package _global_") else data


def _check_path(cls, parts, key):
    names = {f.name: f for f in dataclasses.fields(cls)}
    if parts[0] not in names:
        raise ValueError(f"unknown config key '{key}' (known here: {', '.join(sorted(names))})")
    kind = get_type_hints(cls)[parts[0]]
    if len(parts) > 1:
        if not dataclasses.is_dataclass(kind):
            raise ValueError(f"unknown config key '{key}': '{parts[0]}' has no sub-keys")
        _check_path(kind, parts[1:], key)
