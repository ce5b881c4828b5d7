"""The run configuration's schema: one typed dataclass per section, every key with its default and comment.

This file is the only place a default is stated: constructors elsewhere take values. Each section's `check`
refuses an out-of-range value in one line naming the key (registry.require); `Config.check` adds the checks
that span sections. How Hydra composes and parses these: launch/config.py.
"""
import math
import os
from dataclasses import dataclass, field, fields
from typing import Any

from omegaconf import MISSING

from registry import require


@dataclass
class ModelConfig:
    path: str = "smollm2-135m"  # embedded model name, a local Hugging Face folder, or a hub id
    # options of the model's chat template, passed to apply_chat_template for every prompt (rollouts and
    # evaluation alike), e.g. +model.chat_template.enable_thinking=false for Qwen3
    chat_template: dict[str, Any] = field(default_factory=dict)

    def check(self):
        require(bool(self.path), "model.path", "must name a model", self.path)


@dataclass
class RayNode:
    """One machine of a cluster=ray run (docs/design.md, "Past one machine")."""
    # trainer: the node train.py runs on, with the trainer ranks, the main ring and the staleness gate
    # (exactly one); generator: rollout workers only, whose groups are forwarded to the trainer node
    role: str = "generator"
    cores: int = 1  # CPU cores the node's processes get (Ray reserves them; a simulated node is given them)
    # GPUs of the node: a generator node with GPUs runs the GPU plan's generation on them (one engine per
    # cluster.tp_size GPUs, weights to its engines over CUDA IPC; cluster.device=cpu tries it on the CPU); the
    # trainer node computes on the CPU so far (0)
    gpus: int = 0
    rollout_workers: int = 1  # as cluster.rollout_workers, on this node (the trainer node may have none)
    trainer_ranks: int = 0  # as cluster.trainer_ranks, on this node (the trainer node's only)

    def check(self, where: str):
        require(self.role in ("trainer", "generator"), f"{where}.role", "must be trainer or generator",
                self.role)
        require(self.cores >= 1, f"{where}.cores", "must be >= 1", self.cores)
        require(self.gpus >= 0, f"{where}.gpus", "must be >= 0", self.gpus)
        require(self.gpus == 0 or self.role == "generator", f"{where}.gpus",
                "must be 0 on the trainer node: it trains on the CPU plan so far (generator nodes may have "
                "GPUs)", self.gpus)
        require(self.rollout_workers >= (self.role == "generator"), f"{where}.rollout_workers",
                "must be >= 1 on a generator node and >= 0 on the trainer node", self.rollout_workers)
        require((self.trainer_ranks >= 1) == (self.role == "trainer"), f"{where}.trainer_ranks",
                "must be >= 1 on the trainer node and 0 on a generator node", self.trainer_ranks)


def _two_nodes() -> list:
    return [RayNode(role="trainer", cores=1, rollout_workers=0, trainer_ranks=1), RayNode(role="generator")]


@dataclass
class RayConfig:
    """cluster=ray: generator nodes feeding the trainer node over Ray (conf/cluster/ray.yaml; pip install -r
    requirements-ray.txt). Ray is imported only when this is on."""
    enabled: bool = False  # set by cluster=ray
    # "": start Ray here and simulate the nodes on this machine (testing); HOST:PORT (or "auto"): join the
    # cluster that `ray start --head` began, from its head node, which is then the trainer node
    address: str = ""
    object_store_mb: int = 256  # each node's object store (groups cross it; weights go over gloo)
    health_check_period_s: float = 1.0  # how often Ray checks a node; lost after 3 missed checks
    # every ray.get and every collective's set-up: a node that does not answer is lost
    call_timeout_s: float = 120.0
    # a generator node whose call or weight push takes longer is fenced: its lease goes back to the gate and
    # the run goes on without waiting for it, until it answers again (launch/ray_nodes.py)
    node_deadline_s: float = 30.0
    # generator nodes placed before the run starts (0: all of them); each other one starts when a machine with
    # its cores joins the cluster
    min_nodes: int = 0
    forward_groups: int = 8  # groups one forwarding call brings from a generator node, at most
    # with every generator node lost and no rollout worker on the trainer node: how long to wait for a machine
    # to replace one (`ray start --address=...` there) before the run ends in one line; 0: end at once
    replace_timeout_s: float = 600.0
    nodes: list[RayNode] = field(default_factory=_two_nodes)

    def check(self):
        if not self.enabled:
            return
        for i, node in enumerate(self.nodes):
            node.check(f"cluster.ray.nodes[{i}]")
        roles = [n.role for n in self.nodes]
        require(roles.count("trainer") == 1 and len(roles) >= 2, "cluster.ray.nodes",
                "must hold exactly one trainer node and at least one generator node", roles)
        require(self.object_store_mb >= 64, "cluster.ray.object_store_mb", "must be >= 64",
                self.object_store_mb)
        require(self.health_check_period_s > 0, "cluster.ray.health_check_period_s", "must be > 0",
                self.health_check_period_s)
        require(self.call_timeout_s > 0, "cluster.ray.call_timeout_s", "must be > 0", self.call_timeout_s)
        require(self.node_deadline_s > 0, "cluster.ray.node_deadline_s", "must be > 0", self.node_deadline_s)
        require(0 <= self.min_nodes <= len(self.generator_nodes), "cluster.ray.min_nodes",
                f"must be between 0 (all) and the {len(self.generator_nodes)} generator nodes of "
                "cluster.ray.nodes", self.min_nodes)
        require(self.forward_groups >= 1, "cluster.ray.forward_groups", "must be >= 1", self.forward_groups)
        require(self.replace_timeout_s >= 0, "cluster.ray.replace_timeout_s", "must be >= 0",
                self.replace_timeout_s)

    @property
    def trainer_node(self) -> RayNode:
        return next(n for n in self.nodes if n.role == "trainer")

    @property
    def generator_nodes(self) -> list[RayNode]:
        return [n for n in self.nodes if n.role == "generator"]


@dataclass
class ClusterConfig:
    plan: str = "auto"  # auto | cpu | gpu: where generation and training run (auto: gpu when torch sees CUDA)
    rollout_workers: int = 1  # generation processes (CPU plan; on the GPU plan, one per SGLang engine)
    trainer_ranks: int = 1  # FSDP2 training processes (CPU plan; on the GPU plan, one per training GPU)
    # torch threads per process. 0 (auto): on the CPU plan the cores go to the side that is working, changed
    # at step boundaries from the run's state (runtime/cores.py); 1 on the GPU plan. N: every process N,
    # always
    threads_per_process: int = 0
    # a rollout worker that dies is restarted this many times before the run stops (CPU plan)
    max_restarts: int = 3
    # a process that makes no progress this long is stuck: named, dumped, killed
    hang_timeout_s: float = 300.0
    slow_timeout_s: float = 1800.0  # the same in phases that are legitimately long: evaluation, a checkpoint,
    # the first training step (it may compile); runtime/heartbeat.py SLOW_PHASES
    start_timeout_s: float = 1800.0  # the same for a process's start-up (imports, loading its model)
    # allow more threads than cores (slower; for trying layouts on a small machine)
    oversubscribe: bool = False
    # GPU plan only (conf/cluster/gpu8.yaml, gpu1.yaml; docs/gpu.md):
    gen_gpus: int = 0  # GPUs running SGLang engines (0: half, in whole tensor-parallel groups)
    train_gpus: int = 0  # GPUs running FSDP2 ranks (0: the rest)
    tp_size: int = 1  # GPUs per SGLang engine (0: the smallest that fits the model)
    # SGLang's share of a generation GPU: bf16 weights + KV cache (0: the layout's)
    mem_fraction_static: float = 0.0
    # ipc (CUDA IPC handles, GPUs with peer access) | nccl (broadcast from trainer rank 0)
    weight_sync: str = "ipc"
    bucket_mb: int = 512  # weight-sync bucket: extra GPU memory on trainer rank 0, and the unit of transfer
    # cuda | cpu: where the GPU plan's processes compute. cpu runs the one-GPU plan's own classes (the
    # built-in engine, FSDP2 on gloo, weight buckets through shared memory) on the CPU: the GPU path tried
    # without a GPU
    device: str = "cuda"
    # recompute each decoder layer's activations in the backward pass, on the CPU and GPU plans: less memory,
    # about 30% more compute
    activation_checkpointing: bool = False
    ray: RayConfig = field(default_factory=RayConfig)  # past one machine: conf/cluster/ray.yaml

    def check(self):
        self.ray.check()
        if self.ray.enabled:
            tp = self.tp_size or 1
            for i, node in enumerate(self.ray.nodes):
                if node.gpus:
                    require(node.gpus % tp == 0 and node.rollout_workers == node.gpus // tp,
                            f"cluster.ray.nodes[{i}].rollout_workers",
                            f"must be {node.gpus // tp} on a node of {node.gpus} GPUs (one rollout worker "
                            f"per engine of cluster.tp_size={tp} GPUs, which must divide them)",
                            node.rollout_workers)
        require(self.plan in ("auto", "cpu", "gpu"), "cluster.plan", "must be auto, cpu or gpu", self.plan)
        require(self.rollout_workers >= 1, "cluster.rollout_workers", "must be >= 1", self.rollout_workers)
        require(self.trainer_ranks >= 1, "cluster.trainer_ranks", "must be >= 1", self.trainer_ranks)
        require(self.threads_per_process >= 0, "cluster.threads_per_process", "must be >= 0 (0: auto)",
                self.threads_per_process)
        require(self.max_restarts >= 0, "cluster.max_restarts", "must be >= 0", self.max_restarts)
        require(self.hang_timeout_s > 0, "cluster.hang_timeout_s", "must be > 0", self.hang_timeout_s)
        for key in ("slow_timeout_s", "start_timeout_s"):
            require(getattr(self, key) >= self.hang_timeout_s, f"cluster.{key}",
                    f"must be >= cluster.hang_timeout_s={self.hang_timeout_s}", getattr(self, key))
        require(self.gen_gpus >= 0 and self.train_gpus >= 0 and self.tp_size >= 0, "cluster.gen_gpus",
                "cluster.train_gpus and cluster.tp_size must be >= 0",
                (self.gen_gpus, self.train_gpus, self.tp_size))
        require(0 <= self.mem_fraction_static < 1, "cluster.mem_fraction_static", "must be in [0, 1)",
                self.mem_fraction_static)
        require(self.weight_sync in ("ipc", "nccl"), "cluster.weight_sync", "must be ipc or nccl",
                self.weight_sync)
        require(self.bucket_mb >= 1, "cluster.bucket_mb", "must be >= 1", self.bucket_mb)
        require(self.device in ("cuda", "cpu"), "cluster.device", "must be cuda or cpu", self.device)


@dataclass
class RolloutConfig:
    group_size: int = 8  # K completions sampled per prompt
    temperature: float = 1.0  # sampling temperature (also applied to the trainer's logprobs)
    top_p: float = 1.0  # nucleus sampling threshold
    # completion budget per sample. The default task's answer, "7 + 8 = 15" and its end of turn, is 9 of
    # SmolLM2's tokens; 12 leave room for it and cut the chatter sooner than 16 (4d745e2, docs/benchmarks.md).
    # A task's preset sets its own: gsm8k 512
    max_new_tokens: int = 12
    # sequences decoded together per rollout worker (engine slots), at most: never more than the staleness
    # bound lets be in flight, (max_staleness + 1) x train.batch_groups x group_size (buffer/staleness.py
    # engine_slots)
    max_batch: int = 64
    # prompt token budget; longer prompts are skipped or cut (0: the longest in the data)
    max_prompt_len: int = 0
    long_prompts: str = "skip"  # skip | truncate: what happens to a prompt over max_prompt_len (both counted)
    # auto | bfloat16 | float32: the engine's weights and matmuls. auto: bfloat16 where the device computes it
    # natively (a CUDA GPU, a CPU with AVX-512), float32 elsewhere (bf16 there is ~100x slower than fp32)
    dtype: str = "auto"
    # auto | builtin | sglang (engines.ENGINES): the generation engine. auto: SGLang on the GPU plan when it
    # is installed, else the built-in engine (engines/builtin.py, the CPU plan's, on CUDA); sglang needs the
    # GPU plan
    engine: str = "auto"
    # the built-in engine on the GPU plan: capture its decode step as CUDA graphs, one per batch and width
    # bucket, at first use (false: the same fixed-shape step, launched kernel by kernel). No effect on the CPU
    # plan
    cuda_graphs: bool = True

    def check(self):
        require(self.group_size >= 2, "rollout.group_size", "must be >= 2", self.group_size)
        require(self.temperature > 0, "rollout.temperature", "must be > 0", self.temperature)
        require(0 < self.top_p <= 1, "rollout.top_p", "must be in (0, 1]", self.top_p)
        require(self.max_new_tokens >= 1, "rollout.max_new_tokens", "must be >= 1", self.max_new_tokens)
        require(self.max_batch >= self.group_size, "rollout.max_batch", "must be >= rollout.group_size",
                self.max_batch)
        require(self.dtype in ("auto", "bfloat16", "float32"), "rollout.dtype",
                "must be auto, bfloat16 or float32", self.dtype)
        require(self.max_prompt_len >= 0, "rollout.max_prompt_len", "must be >= 0 (0: no limit)",
                self.max_prompt_len)
        require(self.long_prompts in ("skip", "truncate"), "rollout.long_prompts", "must be skip or truncate",
                self.long_prompts)
        from engines import ENGINES

        require(self.engine == "auto" or self.engine in ENGINES.names(), "rollout.engine",
                f"must be auto or one of {', '.join(ENGINES.names())}", self.engine)


@dataclass
class LoraConfig:
    rank: int = 0  # LoRA adapters of this rank on a frozen base, trained instead of every weight (0: off)
    alpha: float = 32.0  # the adapters' scale is alpha / rank
    # peft's target_modules: [all-linear] (every linear layer but the output head), or names: [q_proj,v_proj]
    target_modules: list[str] = field(default_factory=lambda: ["all-linear"])
    # auto | bfloat16 | float32: how the frozen base is held. auto: bfloat16 where the trainer computes in
    # bf16 (train.autocast=bfloat16, the GPU plan), else float32
    base_dtype: str = "auto"

    def check(self):
        require(self.rank >= 0, "train.lora.rank", "must be >= 0", self.rank)
        require(self.alpha > 0, "train.lora.alpha", "must be > 0", self.alpha)
        require(bool(self.target_modules), "train.lora.target_modules", "must name modules, or [all-linear]",
                self.target_modules)
        require(self.base_dtype in ("auto", "bfloat16", "float32"), "train.lora.base_dtype",
                "must be auto, bfloat16 or float32", self.base_dtype)


@dataclass
class TrainConfig:
    # B: prompts (groups of K) per batch, one policy version (4: fastest to reward, bench/time_to_reward.py)
    batch_groups: int = 4
    # M: optimizer steps per batch, each on B / M of its groups; the weights are published, and the policy
    # version advances, once per batch (so max_staleness still counts batches). At 1, ppo's and grpo's ratio
    # is exactly 1 on fresh data and their clip never acts (no trust region); 1 is the fastest to reward here
    minibatches: int = 1
    # passes over each batch (PPO's epochs, GRPO's mu): E x M optimizer steps a batch, every one's ratio
    # against the weights before the first (pi_prox), so the clip bites from the second on; still one publish
    # and one version
    epochs: int = 1
    micro_groups: int = 8  # groups per forward/backward pass, at most (memory vs speed)
    # padded tokens per pass, at most: long completions go a few groups at a time. -1: by device
    # (trainer/batch.py PASS_TOKENS: a GPU's several times the CPU's, for the learner's tokens/s at no more
    # memory, docs/gpu.md); 0: no bound
    micro_tokens: int = -1
    # AdamW learning rate; 2.5e-5 crosses 0.8 in a median of 7 steps over 10 seeds of the default run, 2e-5 in
    # 7.5 (b668b66, docs/benchmarks.md, "Faster to a reward")
    lr: float = 2.5e-5
    # the learning rate rises linearly from lr / (N + 1) to lr over the first N steps (0: off)
    warmup_steps: int = 0
    # then falls linearly from lr to min_lr over the next N steps and stays there (0: off)
    decay_steps: int = 0
    min_lr: float = 0.0  # where decay_steps ends
    weight_decay: float = 0.0  # AdamW weight decay
    adam_beta1: float = 0.9  # AdamW's first-moment decay
    # AdamW's second-moment decay (RL recipes often take 0.99 for noisier gradients)
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8  # AdamW's epsilon
    grad_clip: float = 1.0  # max global gradient norm
    # each minibatch's loss gets - coef x the policy's token-mean entropy on its completion tokens (verl's
    # entropy_coeff): > 0 an entropy bonus, < 0 entropy minimisation, which the default task's preset sets
    # (conf/task/arithmetic.yaml: 6 steps to 0.8 against 8, f5dcf5d, docs/benchmarks.md)
    entropy_coef: float = 0.0
    # steps in a row with a non-finite loss or gradient (each skipped) before the run stops
    max_bad_steps: int = 3
    # auto | bfloat16 | none: mixed precision of the forward/backward on the CPU (weights stay fp32). auto: as
    # rollout.dtype's auto
    autocast: str = "auto"
    # torch.compile the decoder stack: about 1.5x faster bf16 steps on the CPU after a compile of one to three
    # minutes (inductor caches it: seconds in later runs); pays off in runs of a hundred steps or more
    compile: bool = False
    # train.lora.rank > 0: LoRA instead of full fine-tuning
    lora: LoraConfig = field(default_factory=LoraConfig)
    # partial fine-tuning: the first N decoder layers are not trained (no gradient, no AdamW state; the
    # backward stops above them)
    freeze_layers: int = 0
    # the input embeddings, and a head tied to them, are not trained: a fifth of SmolLM2-135M's weights, whose
    # gradient and AdamW update cost a default step 0.8x as long; no more steps to 0.8 (docs/benchmarks.md)
    freeze_embeddings: bool = True
    # leave out of the forward and backward the groups whose K rewards all tie, under a rule that gives them
    # zero advantage (ppo, grpo, gspo, cispo, rloo: algos/__init__.py): the same update for less work (but for
    # train.entropy_coef's term, which they then leave out too); the per-token diagnostics
    # (entropy, mismatch/*) are then over the groups trained on
    skip_tied_groups: bool = True
    # compute the prompts' common prefix (a system prompt, an instruction, few-shot examples) once a pass, in
    # one row whose keys the others read (trainer/batch.py hoist_prefix): the same logprobs up to rounding,
    # fewer tokens (the default task's 4-group learner step 1.2x faster: docs/benchmarks.md); false: every row
    # computes its own copy, bit for bit as before it existed
    share_prefix: bool = True

    def check(self):
        self.lora.check()
        require(self.lora.base_dtype != "bfloat16" or self.autocast != "none", "train.lora.base_dtype",
                "bfloat16 needs train.autocast=bfloat16 on the CPU (or base_dtype=float32)",
                self.lora.base_dtype)
        require(self.freeze_layers >= 0, "train.freeze_layers", "must be >= 0", self.freeze_layers)
        require(not self.lora.rank or not self.freeze_layers, "train.freeze_layers",
                "LoRA already trains only its adapters: set train.lora.rank=0 or train.freeze_layers=0",
                self.freeze_layers)
        require(self.batch_groups >= 1, "train.batch_groups", "must be >= 1", self.batch_groups)
        require(self.minibatches >= 1, "train.minibatches", "must be >= 1", self.minibatches)
        require(self.batch_groups % self.minibatches == 0, "train.minibatches",
                f"must divide train.batch_groups={self.batch_groups}", self.minibatches)
        require(self.epochs >= 1, "train.epochs", "must be >= 1", self.epochs)
        require(self.micro_groups >= 1, "train.micro_groups", "must be >= 1", self.micro_groups)
        require(self.micro_tokens >= -1, "train.micro_tokens", "must be >= 0 (or -1: by device)",
                self.micro_tokens)
        require(self.lr > 0, "train.lr", "must be > 0", self.lr)
        require(self.weight_decay >= 0, "train.weight_decay", "must be >= 0", self.weight_decay)
        require(self.warmup_steps >= 0, "train.warmup_steps", "must be >= 0", self.warmup_steps)
        require(self.decay_steps >= 0, "train.decay_steps", "must be >= 0", self.decay_steps)
        require(0 <= self.min_lr <= self.lr, "train.min_lr", f"must be in [0, train.lr={self.lr}]",
                self.min_lr)
        require(0 <= self.adam_beta1 < 1, "train.adam_beta1", "must be in [0, 1)", self.adam_beta1)
        require(0 < self.adam_beta2 < 1, "train.adam_beta2", "must be in (0, 1)", self.adam_beta2)
        require(self.adam_eps > 0, "train.adam_eps", "must be > 0", self.adam_eps)
        require(self.grad_clip > 0, "train.grad_clip", "must be > 0", self.grad_clip)
        require(math.isfinite(self.entropy_coef), "train.entropy_coef", "must be a finite number",
                self.entropy_coef)
        require(self.max_bad_steps >= 1, "train.max_bad_steps", "must be >= 1", self.max_bad_steps)
        require(self.autocast in ("auto", "bfloat16", "none"), "train.autocast",
                "must be auto, bfloat16 or none", self.autocast)


@dataclass
class EnvConfig:
    """Multi-turn episodes (a task with an environment, envs/): the limits of one episode. Its tokens after
    the prompt, the policy's and the environment's, are bounded by rollout.max_new_tokens."""
    max_turns: int = 4  # policy turns per episode (a task's preset may change it)
    max_turn_tokens: int = 48  # new tokens per policy turn
    # an observation longer than this is cut in the middle (episode/observations_cut)
    max_observation_tokens: int = 128
    step_timeout_s: float = 10.0  # an environment step slower than this ends its episode (env_timeout)
    episode_timeout_s: float = 300.0  # wall clock of one episode, model and environment together
    threads: int = 64  # threads stepping environments beside the engine (waits, remote calls, sandboxed runs)
    # a remote tool's stand-in: each step waits a log-normal delay of this mean (seconds; 0: none), using no
    # core
    latency_s: float = 0.0
    latency_sigma: float = 1.0  # the delay's log-normal shape: 1 gives a long tail (p99 about 7x the median)
    check_every: int = 16  # every N-th episode is compared with its conversation rendered at once (0: never)
    # finish reasons (buffer/ring.py FINISH_REASONS) whose samples are kept out of the loss (episode/masked);
    # their rewards still count in their group's baseline. Add truncation (budget, context, max_turns) to mask
    # it too; budget also masks a one-shot task's completions cut at rollout.max_new_tokens
    mask: list[str] = field(default_factory=lambda: ["env_error", "env_timeout"])

    def check(self):
        from buffer.ring import FINISH_REASONS, MAX_TURNS

        require(self.max_turns >= 1, "env.max_turns", "must be >= 1", self.max_turns)
        require(self.max_turns <= MAX_TURNS, "env.max_turns",
                f"must be <= {MAX_TURNS} (buffer/ring.py MAX_TURNS: the turn rewards a ring slot holds)",
                self.max_turns)
        require(self.max_turn_tokens >= 1, "env.max_turn_tokens", "must be >= 1", self.max_turn_tokens)
        require(self.max_observation_tokens >= 8, "env.max_observation_tokens", "must be >= 8",
                self.max_observation_tokens)
        require(self.step_timeout_s > 0, "env.step_timeout_s", "must be > 0", self.step_timeout_s)
        require(self.episode_timeout_s > 0, "env.episode_timeout_s", "must be > 0", self.episode_timeout_s)
        require(self.threads >= 1, "env.threads", "must be >= 1", self.threads)
        require(self.latency_s >= 0, "env.latency_s", "must be >= 0", self.latency_s)
        require(self.latency_sigma >= 0, "env.latency_sigma", "must be >= 0", self.latency_sigma)
        require(self.check_every >= 0, "env.check_every", "must be >= 0", self.check_every)
        require(all(reason in FINISH_REASONS for reason in self.mask), "env.mask",
                f"must list finish reasons among {', '.join(FINISH_REASONS)}", list(self.mask))


@dataclass
class EvalConfig:
    every: int = 10  # evaluate on the test split every N steps, and always at the end (0: only at the end)
    k: int = 4  # samples per prompt for pass@k (greedy pass@1 is always reported)
    temperature: float = 1.0  # sampling temperature of the pass@k samples
    max_examples: int = 0  # evaluate on the first N test examples (0: all)
    only: bool = False  # evaluate model.path on the test split and stop, no training

    def check(self):
        require(self.every >= 0, "eval.every", "must be >= 0", self.every)
        require(self.k >= 1, "eval.k", "must be >= 1", self.k)
        require(self.temperature > 0, "eval.temperature", "must be > 0", self.temperature)
        require(self.max_examples >= 0, "eval.max_examples", "must be >= 0", self.max_examples)


@dataclass
class RewardConfig:
    workers: int = 1  # verifier processes per rollout worker (0: score in the rollout process, no timeout)
    timeout_s: float = 5.0  # a verifier slower than this is killed; the completion scores 0 (reward/timeouts)

    def check(self):
        require(self.workers >= 0, "reward.workers", "must be >= 0", self.workers)
        require(self.timeout_s > 0, "reward.timeout_s", "must be > 0", self.timeout_s)


@dataclass
class BufferConfig:
    sampler: str = "auto"  # auto (the loss's own choice: tba for tb, fifo otherwise) | fifo | tba
    # tba: chance that a group is the newest data rather than a replay (TBA's GSM8K value)
    recent_prob: float = 0.95
    inv_temp: float = 1.0  # tba: replay draws completions with probability ~ exp(inv_temp * reward)
    per_prompt_capacity: int = 64  # tba: newest completions kept per prompt
    # DAPO's dynamic sampling: a fresh group whose K rewards are all equal (zero advantage, nothing to learn)
    # is dropped and its budget handed back to the staleness gate, so a worker generates another in its place.
    dynamic_sampling: bool = False
    # ... but at most this many such drops per step, in multiples of train.batch_groups; past it the step
    # trains on tied groups too (counted in dynamic/gave_up) rather than wait forever on a solved task
    dynamic_max_drops: float = 8.0

    def check(self):
        require(self.sampler in ("auto", "fifo", "tba"), "buffer.sampler", "must be auto, fifo or tba",
                self.sampler)
        require(0 <= self.recent_prob <= 1, "buffer.recent_prob", "must be in [0, 1]", self.recent_prob)
        require(self.inv_temp >= 0, "buffer.inv_temp", "must be >= 0", self.inv_temp)
        require(self.per_prompt_capacity >= 1, "buffer.per_prompt_capacity", "must be >= 1",
                self.per_prompt_capacity)
        require(self.dynamic_max_drops >= 0, "buffer.dynamic_max_drops", "must be >= 0",
                self.dynamic_max_drops)


@dataclass
class CheckpointConfig:
    every: int = 0  # also save every N steps (0: only at the end)
    keep: int = 0  # newest checkpoints kept on disk (0: all)
    # save the last step's (false: a sweep that needs only metrics; a 135M model's is 1.6 GB)
    at_end: bool = True

    def check(self):
        require(self.every >= 0, "checkpoint.every", "must be >= 0", self.every)
        require(self.keep >= 0, "checkpoint.keep", "must be >= 0", self.keep)


@dataclass
class Config:
    steps: int = 30  # batches to train, each one policy version and one metrics row
    seed: int = 0  # fixes data order, sampling and initialisation
    # eta: how many versions older than the learner the data may be (0 = synchronous). 0: on shared CPU cores
    # the fastest to reward (bench/time_to_reward.py); asynchrony pays where generation and training do not
    # share them
    max_staleness: int = 0
    progress: bool = True  # progress bar on stderr (plain lines when stderr is not a terminal)
    # curves.png when the run ends, about 2 s on a CPU (false: many short runs, as the tests make)
    curves: bool = True
    # none | tensorboard | wandb (W&B: $WANDB_MODE, else online if logged in, else offline)
    logger: str = "none"
    # fresh completions a step written to samples.jsonl, decoded (trainer/samples.py; 0: none)
    log_samples: int = 4
    resume: str = ""  # a run directory: continue it in place from its latest checkpoint
    # The sections, in the order a run's config.yaml lists them:
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    env: EnvConfig = field(default_factory=EnvConfig)  # multi-turn tasks only
    train: TrainConfig = field(default_factory=TrainConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    buffer: BufferConfig = field(default_factory=BufferConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    algo: Any = MISSING  # the learning rule's Config (algos/<name>.py), chosen by algo=<name>
    task: Any = MISSING  # the task's Config (tasks/<name>.py), chosen by task=<name>
    model: ModelConfig = field(default_factory=ModelConfig)
    cluster: ClusterConfig = field(default_factory=ClusterConfig)

    def check(self):
        require(self.steps >= 1, "steps", "must be >= 1", self.steps)
        require(self.max_staleness >= 0, "max_staleness", "must be >= 0", self.max_staleness)
        require(self.log_samples >= 0, "log_samples", "must be >= 0", self.log_samples)
        require(self.logger in ("none", "tensorboard", "wandb"), "logger",
                "must be none, tensorboard or wandb", self.logger)
        for f in fields(self):
            section = getattr(self, f.name)
            if hasattr(section, "check"):
                section.check()
        require(self.buffer.sampler != "tba" or self.buffer.per_prompt_capacity >= self.rollout.group_size,
                "buffer.per_prompt_capacity", f"must be >= rollout.group_size={self.rollout.group_size}",
                self.buffer.per_prompt_capacity)
        c = self.cluster
        threads = (c.rollout_workers + c.trainer_ranks) * c.threads_per_process
        cores = len(os.sched_getaffinity(0))
        # Thread pools bigger than the cores left to them spin against each other (docs/benchmarks.md, "Which
        # allocation of cores wins"); one thread per process only takes turns, and auto (0) never gives a
        # process more than its share when the sides overlap: the default runs on one core too.
        require(c.plan == "gpu" or c.oversubscribe or c.threads_per_process <= 1 or threads <= cores,
                "cluster.rollout_workers",
                f"+ cluster.trainer_ranks, times cluster.threads_per_process, must fit the {cores} cores "
                "here (or set cluster.oversubscribe=true)",
                f"{c.rollout_workers} + {c.trainer_ranks} x {c.threads_per_process}")
        # task=code: the sandbox must end a program first
        need = getattr(self.task, "min_reward_timeout_s", 0.0)
        if self.reward.timeout_s < need:
            require(False, "reward.timeout_s", f"must be >= {need:g} for task={self.task.name} (task."
                    "program_timeout_s + 2 s: the sandbox ends a slow program itself and counts why)",
                     self.reward.timeout_s)
        t, ranks = self.train, self.cluster.trainer_ranks
        require(t.batch_groups % (t.minibatches * ranks) == 0, "train.batch_groups",
                f"must be divisible by cluster.trainer_ranks={ranks}"
                + (f" times train.minibatches={t.minibatches}" if t.minibatches > 1 else ""), t.batch_groups)
