"""One trainer rank's model, optimizer and loss: `Learner.step(batch)` is one optimizer step."""
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict, set_optimizer_state_dict

import algos
from trainer.batch import PAD, Batch, micro_batches
from trainer.policy import CPUPlacement, Placement, full_state

if TYPE_CHECKING:
    from launch.config import RolloutConfig, TrainConfig

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
_FULL_FROM_RANK0 = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


@dataclass(frozen=True)
class Rank:
    """Where one trainer rank sits: its place among `world_size`, the rendezvous port, its device and sharding."""
    rank: int = 0
    world_size: int = 1
    port: int = 0
    placement: Placement = field(default_factory=CPUPlacement)


class Learner:
    """The policy being trained (and, for the rules that use it, the frozen reference), AdamW and the loss.

    train: the config's train section; algo: the rule's Config; rollout: the rollout section (the group size K,
    the sampling temperature the logprobs apply, the completion budget). init_path: the policy's starting
    weights (a checkpoint when resuming); "" = model_path."""

    def __init__(self, *, model_path: str, train: "TrainConfig", algo, rollout: "RolloutConfig", rank: Rank = Rank(),
                 init_path: str = ""):
        assert train.autocast != "auto", "the launcher settles train.autocast=auto (launch.plan.resolve_precision)"
        self.rank, self.train, self.rollout = rank, train, rollout
        place = rank.placement
        self.device = place.device
        self.loss_fn = algos.get(algo.name).Loss(algo)
        # The reference is the frozen initial policy, loaded only for the rules that use it.
        self.reference = place.load(model_path, rank.world_size, frozen=True, compile=train.compile) \
            if self.loss_fn.needs_reference else None
        self.policy = place.load(init_path or model_path, rank.world_size, compile=train.compile)
        # fused: one kernel per parameter instead of a dozen elementwise passes (0.17 s vs 0.68 s a step here)
        self.optimizer = torch.optim.AdamW(self.policy.parameters(), lr=train.lr, weight_decay=train.weight_decay,
                                           fused=True)
        self.skipped = 0
        self.bad_in_row = 0

    def step(self, batch: Batch, step: int) -> dict:
        """Forward/backward over this rank's share of `batch`, clip, and step (skipped if not finite)."""
        loss, metrics, tokens = self._forward_backward(batch, step)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.train.grad_clip)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        if bool(torch.isfinite(loss) and torch.isfinite(grad_norm)):
            self.optimizer.step()
            self.bad_in_row = 0
        else:
            self.skipped, self.bad_in_row = self.skipped + 1, self.bad_in_row + 1
        self.optimizer.zero_grad(set_to_none=True)
        if self.bad_in_row >= self.train.max_bad_steps:
            raise RuntimeError(f"{self.bad_in_row} steps in a row had a non-finite loss or gradient; "
                               f"lower train.lr or check the rewards")
        return {"loss": loss.item(), "train/grad_norm": grad_norm.item(), "train/skipped_steps": self.skipped,
                "train/tokens": tokens, **metrics}

    def _forward_backward(self, batch: Batch, step: int):
        train, world_size = self.train, self.rank.world_size
        row_lens = (batch.segments != PAD).sum(1).tolist()
        passes = micro_batches(row_lens, world_size, train.micro_groups, train.micro_tokens)[self.rank.rank]
        total_loss, sums, count, tokens = torch.zeros((), device=self.device), {}, 0, 0
        for start, stop in passes:
            mb = batch.groups(start, stop).to(self.device)
            inputs = (mb.input_ids, mb.position_ids, mb.segments, mb.gather, mb.targets, self.rollout.temperature)
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=train.autocast == "bfloat16"):
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
                group_size=self.rollout.group_size, batch_sequences=batch.targets.shape[0],
                batch_tokens=int(batch.mask.sum()), max_new_tokens=self.rollout.max_new_tokens, step=step - 1,
                ref_logprobs=ref, prox_logprobs=prox))
            # FSDP2 averages gradients over ranks; each rank holds a share of the batch loss, so scale back up.
            (loss * world_size).backward()
            total_loss += loss.detach()
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + v
            count += 1
            tokens += mb.num_tokens
        keys = sorted(sums)
        summed = set(getattr(self.loss_fn, "summed_metrics", ()))
        means = [sums[k] if k in summed else sums[k] / max(count, 1) / world_size for k in keys]
        packed = torch.tensor([total_loss.item(), tokens] + means, dtype=torch.float64)
        if world_size > 1:
            packed = packed.to(self.device)  # NCCL reduces GPU tensors only
            dist.all_reduce(packed)
            packed = packed.cpu()
        return packed[0].float(), dict(zip(keys, packed[2:].tolist())), int(packed[1])

    def optimizer_state(self) -> dict:
        """The full AdamW state keyed by parameter name (a collective under FSDP2; complete on rank 0)."""
        return get_optimizer_state_dict(self.policy, self.optimizer, options=_FULL)

    def load_optimizer_state(self, state: dict) -> None:
        set_optimizer_state_dict(self.policy, self.optimizer, state, options=_FULL_FROM_RANK0)

    def publish(self, publish, version: int) -> None:
        """All ranks gather the full weights (a collective) and hand them to `publish`, the weight path's trainer
        end (rank 0 ships them)."""
        publish(full_state(self.policy), version)
