"""One trainer rank's model, optimizer and loss: `Learner.step(batch)` trains one batch
(one policy version)."""
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_optimizer_state_dict,
    set_optimizer_state_dict,
)

import algos
from engines.buckets import engine_name
from heap import keep_freed_chunks, release_free_heap
from trainer.batch import PAD, Batch, micro_batches, pass_tokens
from trainer.diagnostics import OffPolicyStats
from trainer.freeze import freeze
from trainer.lora import ADAPTER_DIR, Adapters, BasePolicy
from trainer.policy import CPUPlacement, Placement, full_state, hold_frozen_in

if TYPE_CHECKING:
    from runtime.schema import RolloutConfig, TrainConfig

_FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
_FULL_FROM_RANK0 = StateDictOptions(full_state_dict=True, broadcast_from_rank0=True)


# Passes of at least this many padded tokens hand the heap's free pages back first. A default-task pass
# (about 750 tokens) frees little, and faulting its pages in again would slow its short step
# (docs/benchmarks.md, "Memory"): a step below it keeps even its large chunks in the heap, for the next step
# (heap.py keep_freed_chunks).
HEAP_RELEASE_TOKENS = 1024


@dataclass(frozen=True)
class Rank:
    """Where one trainer rank sits: its place among `world_size`, the rendezvous port, its device and
    sharding."""
    rank: int = 0
    world_size: int = 1
    port: int = 0
    placement: Placement = field(default_factory=CPUPlacement)


class Learner:
    """The policy being trained (and, for the rules that use it, the frozen reference), AdamW and the loss.

    train: the config's train section; algo: the rule's Config; rollout: the rollout section (the group size
    K, the sampling temperature the logprobs apply, the completion budget). init_path: the policy's starting
    weights (a checkpoint when resuming); "" = model_path."""

    def __init__(self, *, model_path: str, train: "TrainConfig", algo, rollout: "RolloutConfig",
                 rank: Rank = Rank(), init_path: str = ""):
        assert train.autocast != "auto", \
            "the launcher settles train.autocast=auto (launch.plan.resolve_precision)"
        self.rank, self.train, self.rollout = rank, train, rollout
        place = rank.placement
        self.device = place.device
        self.loss_fn = algos.get(algo.name).Loss(algo)
        adapters = self._adapters(init_path) if train.lora.rank else None
        # The reference is the frozen initial policy, for the rules that use it: a second model, or under LoRA
        # the policy itself with its adapters off.
        self.reference = place.load(model_path, rank.world_size, frozen=True, compile=train.compile) \
            if self.loss_fn.needs_reference and adapters is None else None
        # Under LoRA the base is always model_path: a resumed run reloads its adapter onto it.
        self.policy = place.load(model_path if adapters else init_path or model_path, rank.world_size,
                                 compile=train.compile, adapters=adapters)
        # LoRA's base is frozen already
        if adapters is None and (train.freeze_layers or train.freeze_embeddings):
            freeze(self.policy.lm, train.freeze_layers, train.freeze_embeddings)
        for model in (self.policy, self.reference):
            if model is not None:
                model.share_prefix = train.share_prefix
        if self.loss_fn.needs_reference and adapters is not None:
            self.reference = BasePolicy(self.policy)
        elif self.reference is not None and train.autocast == "bfloat16" and self.device.type == "cpu":
            hold_frozen_in(self.reference, torch.bfloat16)
        # fused: one kernel per parameter instead of a dozen elementwise passes (0.17 s vs 0.68 s a step here)
        self.optimizer = torch.optim.AdamW([p for p in self.policy.parameters() if p.requires_grad],
                                           lr=train.lr, betas=(train.adam_beta1, train.adam_beta2),
                                           eps=train.adam_eps, weight_decay=train.weight_decay, fused=True)
        self._allocate_optimizer_state()
        # a group whose rewards all tie adds nothing under this rule: its forward and backward are left out
        self.skips_tied = train.skip_tied_groups and getattr(self.loss_fn, "tied_groups_learn_nothing", False)
        self.skipped = 0
        self.bad_in_row = 0
        # called before every forward pass: the loop's heartbeat (runtime/heartbeat.py)
        self.beat = lambda: None

    def _allocate_optimizer_state(self) -> None:
        """AdamW's moments made now, before the run's clock starts, instead of lazily in the first step (1.5
        of its 4.5 s on a 2-core CPU: about 1 GB of zeros first touched). A step at learning rate 0 on zero
        gradients leaves the weights and the moments as they were (zeros); its step count is set back to 0, so
        the first real step is the one a fresh optimizer would take."""
        params = [p for group in self.optimizer.param_groups for p in group["params"]]
        rates = [group["lr"] for group in self.optimizer.param_groups]
        for p in params:
            p.grad = torch.zeros_like(p)
        for group in self.optimizer.param_groups:
            group["lr"] = 0.0
        self.optimizer.step()
        for group, rate in zip(self.optimizer.param_groups, rates):
            group["lr"] = rate
        for p in params:
            self.optimizer.state[p]["step"].zero_()
        self.optimizer.zero_grad(set_to_none=True)

    def _adapters(self, init_path: str) -> Adapters:
        """train.lora with its base dtype settled: auto is bfloat16 where the trainer computes in bf16."""
        lora = self.train.lora
        base = lora.base_dtype
        if base == "auto":
            base = ("bfloat16" if self.train.autocast == "bfloat16" or self.device.type == "cuda"
                    else "float32")
        return Adapters(lora, getattr(torch, base), os.path.join(init_path, ADAPTER_DIR) if init_path else "")

    def step(self, batch: Batch, step: int) -> dict:
        """Train on `batch`, the data for policy version step - 1: `train.epochs` times over
        `train.minibatches` minibatches, one optimizer step each, a forward/backward over this rank's share of
        it, a clip and an AdamW step (skipped if not finite). The proximal policy is the weights before the
        first of them."""
        if self.device.type == "cpu":
            keep_freed_chunks(batch.input_ids.numel() < HEAP_RELEASE_TOKENS)
        count = self.train.minibatches
        size = batch.num_groups // count
        minibatches = ([batch] if count == 1
                       else [batch.groups(i, i + size) for i in range(0, batch.num_groups, size)])
        totals = [(mb.targets.shape[0], int(mb.mask.sum())) for mb in minibatches]  # the loss's denominators
        tied = 0
        if self.skips_tied:
            kept = [mb.untied(self.rank.world_size) for mb in minibatches]
            tied = sum(mb.num_groups - len(index) for mb, index in zip(minibatches, kept))
            minibatches = [mb if len(index) == mb.num_groups else mb.take(index)
                           for mb, index in zip(minibatches, kept)]
        # the entropy term's denominator: the tokens it is summed over (a skipped tied group adds none, so
        # counting its tokens would shrink train.entropy_coef as more groups tie)
        totals = [(sequences, tokens, int(mb.mask.sum()))
                  for (sequences, tokens), mb in zip(totals, minibatches)]
        plans = [self._passes(mb) for mb in minibatches]
        stats = OffPolicyStats(version=step - 1)
        # One minibatch: its first forward runs on the weights before the update, so the proximal logprobs are
        # that forward's own, detached (and kept for the later epochs). More: one no-grad pass over the batch
        # first.
        prox = self._proximal(minibatches, plans, stats) if count > 1 else [None]
        epochs, rows = self.train.epochs, []
        for epoch in range(epochs):
            for i, (mb, passes, total) in enumerate(zip(minibatches, plans, totals)):
                first = stats if count == 1 and epoch == 0 else None
                row, forwards = self._update(mb, passes, step, prox[i], first, total)
                prox[i] = forwards if prox[i] is None else prox[i]
                rows.append(row)
        out = rows[0]
        # means over the updates; the tokens computed add up, a rule's counts over one epoch
        if len(rows) > 1:
            computed = {"train/tokens", "train/shared_prefix_tokens"}
            counts = set(getattr(self.loss_fn, "summed_metrics", ()))
            out = {k: sum(row[k] for row in rows)
                      / (1 if k in computed else epochs if k in counts else len(rows))
                   for k in rows[0]}
        out["train/skipped_steps"] = self.skipped
        out["train/tied_groups_skipped"] = tied
        if self.device.type == "cpu" and batch.input_ids.numel() >= HEAP_RELEASE_TOKENS:
            # now rather than at the next pass: the engines generating the next batch, and an evaluation, use
            # them
            release_free_heap()
        return {**out, **stats.metrics(self.rank.world_size, self.device)}

    def _update(self, batch: Batch, passes, step: int, prox, stats,
                totals: tuple[int, int, int]) -> tuple[dict, list[torch.Tensor]]:
        """One optimizer step on `batch` (a minibatch), given its proximal logprobs per pass (None: the
        forward's) and the sequences and tokens of the whole minibatch, tied groups included (the loss's
        denominators), and the tokens of the groups it trains on (the entropy term's). Returns the step's
        metrics and the forward's logprobs per pass, detached (the weights before the step)."""
        loss, metrics, tokens, forwards = self._forward_backward(batch, passes, step, prox, stats, totals)
        grad_norm = torch.nn.utils.clip_grad_norm_(self.policy.parameters(), self.train.grad_clip)
        grad_norm = grad_norm.full_tensor() if hasattr(grad_norm, "full_tensor") else grad_norm
        if bool(torch.isfinite(loss) and torch.isfinite(grad_norm)):
            for group in self.optimizer.param_groups:
                group["lr"] = self.learning_rate(step)
            self.optimizer.step()
            self.bad_in_row = 0
        else:
            self.skipped, self.bad_in_row = self.skipped + 1, self.bad_in_row + 1
        self.optimizer.zero_grad(set_to_none=True)
        if self.bad_in_row >= self.train.max_bad_steps:
            raise RuntimeError(f"{self.bad_in_row} steps in a row had a non-finite loss or gradient; "
                               f"lower train.lr or check the rewards")
        return {"loss": loss.item(), "train/grad_norm": grad_norm.item(), "train/skipped_steps": self.skipped,
                "train/tokens": tokens, "train/lr": self.learning_rate(step), **metrics}, forwards

    def learning_rate(self, step: int) -> float:
        """train.lr, ramped linearly over the first train.warmup_steps steps, then down linearly to
        train.min_lr over the next train.decay_steps and held there (step counts from 1)."""
        t = self.train
        if t.warmup_steps and step <= t.warmup_steps:
            return t.lr * step / (t.warmup_steps + 1)
        if not t.decay_steps:
            return t.lr
        return t.lr + (t.min_lr - t.lr) * min(1.0, (step - t.warmup_steps - 1) / t.decay_steps)

    def _passes(self, batch: Batch) -> list[tuple[int, int]]:
        """This rank's forward/backward passes over `batch`, as group ranges."""
        row_lens = (batch.segments != PAD).sum(1).tolist()
        return micro_batches(row_lens, self.rank.world_size, self.train.micro_groups,
                             pass_tokens(self.train.micro_tokens, self.device.type))[self.rank.rank]

    def _before_pass(self, mb: Batch) -> None:
        self.beat()
        # On the CPU activations live in the C heap (on a GPU, in the device's own allocator)
        if self.device.type == "cpu" and mb.input_ids.numel() >= HEAP_RELEASE_TOKENS:
            release_free_heap()

    def _inputs(self, mb: Batch, entropy: bool, entropy_grad: bool = False):
        return (mb.input_ids, mb.position_ids, mb.segments, mb.gather, mb.targets, self.rollout.temperature,
                entropy, entropy_grad)

    def _autocast(self):
        return torch.autocast("cpu", dtype=torch.bfloat16, enabled=self.train.autocast == "bfloat16")

    @torch.no_grad()
    def _proximal(self, minibatches: list[Batch], plans, stats: OffPolicyStats) -> list[list[torch.Tensor]]:
        """The current weights' logprobs for every pass of every minibatch, before any of them updates."""
        prox = []
        for batch, passes in zip(minibatches, plans):
            prox.append([])
            for start, stop in passes:
                mb = batch.groups(start, stop).to(self.device)
                self._before_pass(mb)
                with self._autocast():
                    logprobs, entropy = self.policy(*self._inputs(mb, entropy=True))
                stats.add(logprobs, mb.behav_logprobs, mb.mask, mb.versions, entropy)
                prox[-1].append(logprobs)
        return prox

    def _forward_backward(self, batch: Batch, passes, step: int, prox, stats, totals: tuple[int, int, int]):
        world_size = self.rank.world_size
        total_loss, sums, count, tokens, shared = torch.zeros((), device=self.device), {}, 0, 0, 0
        # A pass's metrics weigh by its trained tokens (a pass of 10 tokens says less about the clip fraction
        # than one of 90); a rule's counts, and each pass's share of the entropy term, add up.
        summed = set(getattr(self.loss_fn, "summed_metrics", ())) | {"loss/entropy"}
        weighted, trained = {}, 0.0
        coef = self.train.entropy_coef
        forwards = []
        for i, (start, stop) in enumerate(passes):
            mb = batch.groups(start, stop).to(self.device)
            self._before_pass(mb)
            with self._autocast():
                # train.entropy_coef: the entropy with its gradient, for the loss's term
                out = self.policy(*self._inputs(mb, stats is not None or bool(coef), entropy_grad=bool(coef)))
                logprobs, entropy = out if stats is not None or coef else (out, None)
                shared += self.policy.shared_tokens
                ref = None
                if self.reference is not None:
                    with torch.no_grad():
                        ref = self.reference(*self._inputs(mb, entropy=False))
            forwards.append(logprobs.detach())
            if stats is not None:
                stats.add(forwards[-1], mb.behav_logprobs, mb.mask, mb.versions, entropy.detach())
            mb_prox = None
            if self.loss_fn.needs_proximal:
                mb_prox = forwards[-1] if prox is None else prox[i]
            loss, metrics = self.loss_fn(algos.MicroBatch(
                logprobs=logprobs, behav_logprobs=mb.behav_logprobs, mask=mb.mask, rewards=mb.rewards,
                group_size=mb.group_size, batch_sequences=totals[0], batch_tokens=totals[1],
                max_new_tokens=self.rollout.max_new_tokens, step=step - 1,
                ref_logprobs=ref, prox_logprobs=mb_prox, turn_ids=mb.turn_ids, turn_rewards=mb.turn_rewards,
                turns=mb.turns))
            if coef:  # - coef x the token-mean entropy of the groups trained on (not the skipped tied ones)
                term = -coef * (entropy * mb.mask).sum() / max(totals[2], 1)
                loss = loss + term
                metrics = {**metrics, "loss/entropy": term.item()}
            # FSDP2 averages gradients over ranks; each rank holds a share of the batch loss, so scale back
            # up.
            (loss * world_size).backward()
            total_loss += loss.detach()
            weight = float(mb.mask.sum())
            for k, v in metrics.items():
                sums[k] = sums.get(k, 0.0) + v
                weighted[k] = weighted.get(k, 0.0) + v * weight
            count += 1
            trained += weight
            tokens += mb.num_tokens
        keys = sorted(sums)
        packed = torch.tensor([total_loss.item(), tokens, shared, count, trained]
                              + [sums[k] for k in keys] + [weighted[k] for k in keys], dtype=torch.float64)
        if world_size > 1:
            packed = packed.to(self.device)  # NCCL reduces GPU tensors only
            dist.all_reduce(packed)
            packed = packed.cpu()
        count, trained = packed[3].item(), packed[4].item()
        plain, by_tokens = packed[5:5 + len(keys)].tolist(), packed[5 + len(keys):].tolist()
        # every rank's passes together; passes with no trained token at all: their plain mean
        means = [p if k in summed else w / trained if trained else p / max(count, 1)
                 for k, p, w in zip(keys, plain, by_tokens)]
        # train/shared_prefix_tokens: of train/tokens, those the passes left to one row's copy of the prompts'
        # common prefix (train.share_prefix), which the learner's MFU does not count as computed
        metrics = {**dict(zip(keys, means)), "train/shared_prefix_tokens": int(packed[2])}
        return packed[0].float(), metrics, int(packed[1]), forwards

    def optimizer_state(self) -> dict:
        """The full AdamW state keyed by parameter name (a collective under FSDP2; complete on rank 0)."""
        return get_optimizer_state_dict(self.policy, self.optimizer, options=_FULL)

    def load_optimizer_state(self, state: dict) -> None:
        """AdamW's state from a checkpoint (rank 0's `state`; the others pass {}). Refused in one line when
        the checkpoint trained other weights than this run does (train.freeze_embeddings or
        train.freeze_layers changed): torch would drop the moments of a weight now frozen without a word."""
        if state:
            trained = {engine_name(n) for n, p in self.policy.named_parameters() if p.requires_grad}
            saved = {engine_name(n) for n in state["state"]}  # both without the wrappers' segments
            if saved != trained:
                odd = sorted(saved - trained) or sorted(trained - saved)
                raise ValueError(
                    f"resume: the checkpoint {'trained' if saved - trained else 'did not train'} {odd[0]} "
                    f"({len(odd)} weights), which this run {'freezes' if saved - trained else 'trains'}; "
                    "resume with the run's own train.freeze_embeddings and train.freeze_layers (a run from "
                    "before they existed trained every weight: train.freeze_embeddings=false)")
        set_optimizer_state_dict(self.policy, self.optimizer, state, options=_FULL_FROM_RANK0)

    def publish(self, publish, version: int) -> None:
        """All ranks gather the full weights (a collective) and hand them to `publish`, the weight path's
        trainer end (rank 0 ships them)."""
        publish(full_state(self.policy), version)
