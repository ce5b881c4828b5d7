"""One trainer rank's model, optimizer and loss: `Learner.step(batch)` is one optimizer step."""
from dataclasses import dataclass, field

import torch
import torch.distributed as dist

import algos
from torch.distributed.checkpoint.state_dict import (StateDictOptions, get_optimizer_state_dict,
                                                     set_optimizer_state_dict)

from trainer.batch import PAD, Batch, micro_batches
from trainer.policy import CPUPlacement, full_state

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
_FULL_FROM_RANK0 = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


@dataclass
class LearnerSpec:
    """The values one trainer rank needs (built by train.py from the config)."""
    rank: int
    world_size: int
    port: int
    model_path: str
    run_dir: str
    steps: int
    seed: int
    max_staleness: int
    batch_groups: int
    micro_groups: int
    group_size: int
    max_new_tokens: int
    temperature: float
    lr: float
    weight_decay: float
    grad_clip: float
    autocast: bool
    algo: str
    algo_cfg: object
    checkpoint_every: int
    progress: bool
    sampler: str = "fifo"  # replay buffer: fifo | tba
    recent_prob: float = 0.5
    inv_temp: float = 1.0
    per_prompt_capacity: int = 64
    micro_tokens: int = 0  # padded tokens per forward/backward pass, at most (0: only micro_groups limits a pass)
    max_bad_steps: int = 3  # non-finite steps in a row before the run stops
    task: str = ""  # for evaluation on the test split
    task_cfg: object = None
    eval_every: int = 0  # evaluate every N steps (0: only at the end)
    eval: object = None  # evaluate.EvalSpec; None: never evaluate
    evals: object = None  # evaluate.EvalChannel: evaluate on the rollout workers' engines (GPU plan); None: on rank 0
    num_workers: int = 1  # rollout workers (group ids interleave them)
    init_path: str = ""  # the policy's starting weights (a checkpoint when resuming); "" = model_path
    start_step: int = 0  # optimizer steps already done (resuming)
    checkpoint_keep: int = 0  # newest checkpoints kept (0: all)
    logger: str = "none"  # none | tensorboard | wandb
    config: dict | None = None  # the resolved run config, for the logger
    compile: bool = False  # torch.compile the decoder stack of the policy and of the reference
    # Process group, device, model class and sharding: CPUPlacement, or trainer.gpu_policy.GPUPlacement
    placement: object = field(default_factory=CPUPlacement)


class Learner:
    def __init__(self, spec: LearnerSpec):
        self.spec = spec
        place = spec.placement
        self.device = place.device
        self.loss_fn = algos.get(spec.algo).Loss(spec.algo_cfg)
        # The reference is the frozen initial policy, loaded only for the rules that use it.
        self.reference = place.load(spec.model_path, spec.world_size, frozen=True, compile=spec.compile) \
            if self.loss_fn.needs_reference else None
        self.policy = place.load(spec.init_path or spec.model_path, spec.world_size, compile=spec.compile)
        # fused: one kernel per parameter instead of a dozen elementwise passes (0.17 s vs 0.68 s a step here)
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=spec.lr, weight_decay=spec.weight_decay,
                                           fused=True)
        self.skipped = 0
        self.bad_in_row = 0

    def step(self, batch: Batch, step: int) -> dict:
        """Forward/backward over this rank's share of `batch`, clip, and step (skipped if not finite)."""
        loss, metrics, tokens = self._forward_backward(batch, step)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.spec.grad_clip)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        if bool(torch.isfinite(loss) and torch.isfinite(grad_norm)):
            self.optimizer.step()
            self.bad_in_row = 0
        else:
            self.skipped, self.bad_in_row = self.skipped + 1, self.bad_in_row + 1
        self.optimizer.zero_grad(set_to_none=True)
        if self.bad_in_row >= self.spec.max_bad_steps:
            raise RuntimeError(f"{self.bad_in_row} steps in a row had a non-finite loss or gradient; "
                               f"lower train.lr or check the rewards")
        return {"loss": loss.item(), "train/grad_norm": grad_norm.item(), "train/skipped_steps": self.skipped,
                "train/tokens": tokens, **metrics}

    def _forward_backward(self, batch: Batch, step: int):
        spec = self.spec
        row_lens = (batch.segments != PAD).sum(1).tolist()
        passes = micro_batches(row_lens, spec.world_size, spec.micro_groups, spec.micro_tokens)[spec.rank]
        total_loss, sums, count, tokens = torch.zeros((), device=self.device), {}, 0, 0
        for start, stop in passes:
            mb = batch.groups(start, stop).to(self.device)
            inputs = (mb.input_ids, mb.position_ids, mb.segments, mb.gather, mb.targets, spec.temperature)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=spec.autocast):
                logprobs = self.policy(*inputs)
                ref = None
                if self.reference is not None:
                    with torch.no_grad():
                        ref = self.reference(*inputs)
            # One optimizer step per batch: the weights before this update are the weights of this forward,
            # so the proximal policy's logprobs are these very values, without gradient.
            prox = logprobs.detach() if self.loss_fn.needs_proximal else None
            loss, metrics = self.loss_fn(algos.MicroBatch(
                logprobs=logprobs, behav_logprobs=mb.behav_logprobs, mask=mb.mask, rewards=mb.rewards,
                group_size=spec.group_size, batch_sequences=batch.targets.shape[0],
                batch_tokens=int(batch.mask.sum()), max_new_tokens=spec.max_new_tokens, step=step - 1,
                ref_logprobs=ref, prox_logprobs=prox))
            # FSDP2 averages gradients over ranks; each rank holds a share of the batch loss, so scale back up.
            (loss * spec.world_size).backward()
            total_loss += loss.detach()
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + v
            count += 1
            tokens += mb.num_tokens
        keys = sorted(sums)
        summed = set(getattr(self.loss_fn, "summed_metrics", ()))
        means = [sums[k] if k in summed else sums[k] / max(count, 1) / spec.world_size for k in keys]
        packed = torch.tensor([total_loss.item(), tokens] + means, dtype=torch.float64)
        if spec.world_size > 1:
            packed = packed.to(self.device)  # NCCL reduces GPU tensors only
            dist.all_reduce(packed)
            packed = packed.cpu()
        return packed[0].float(), dict(zip(keys, packed[2:].tolist())), int(packed[1])

    def optimizer_state(self) -> dict:
        """The full AdamW state keyed by parameter name (a collective under FSDP2; complete on rank 0)."""
        return get_optimizer_state_dict(self.policy, self.optimizer, options=_FULL)

    def load_optimizer_state(self, state: dict) -> None:
        set_optimizer_state_dict(self.policy, self.optimizer, state, options=_FULL_FROM_RANK0)

    def publish(self, publish, version: int, into: dict | None = None) -> None:
        """All ranks gather the full weights (a collective) and hand them to `publish` (the weight path's trainer
        end: rank 0 ships them); with `into`, rank 0 also copies them into those tensors (the evaluator's)."""
        tensors = full_state(self.policy)
        publish(_copying(tensors, into) if into is not None else tensors, version)


def _copying(tensors, targets: dict):
    for name, tensor in tensors:
        if name in targets:
            targets[name].copy_(tensor.detach())
        yield name, tensor
