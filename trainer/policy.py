"""The trained model: per-token log-probabilities of packed completions, sharded with FSDP2."""
from datetime import timedelta
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from engines.buckets import engine_name
from trainer.attention import layout, use_segment_attention
from trainer.batch import PAD, SharedPrefix, hoist_prefix
from trainer.gather import full_tensors
from trainer.head import head_logprobs
from trainer.lora import Adapters, merged


class TokenLogprobs(nn.Module):
    """Wraps a Hugging Face causal LM; returns log pi(token) (temperature applied) for every completion token.

    Any causal LM: the decoder is `lm.base_model`, the head `lm.get_output_embeddings()` (weight and bias).
    The head, a fifth of SmolLM2-135M's FLOPs, runs only where a completion token is predicted. Heads that do
    more than a linear map (soft-capping, logit scaling) are refused at start (engines/arch.py).
    """

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm
        # Long rows skip the dense mask's masked-out pairs, and a bf16 step's short rows skip SDPA's CPU
        # kernel (trainer/attention.py), where the model allows it.
        self.segment_attention = use_segment_attention(lm)
        # train.share_prefix: the prompts' common prefix computed once a pass, in one row (trainer/batch.py
        # hoist_prefix), where the model takes segment_attention; the learner sets it from the config
        self.share_prefix = True
        self.shared_tokens = 0  # tokens the last forward left to the keeper row's prefix (the learner's MFU)

    def published_shapes(self) -> list[tuple[str, torch.Tensor]]:
        """(name, meta tensor) of every weight the trainer publishes, in the order it streams them
        (full_state): a LoRA model's merged weights differ in names and order from its state dict."""
        return list(full_state(self, meta=True))

    def forward(self, input_ids, position_ids, segments, gather, targets, temperature: float,
                entropy: bool = False, entropy_grad: bool = False):
        # input_ids, position_ids, segments [G, L]; gather [G, K*T]; targets [G*K, T] -> logprobs [G*K, T]
        shared, self.shared_tokens = None, 0
        if self.segment_attention and self.share_prefix:
            hoisted = hoist_prefix(input_ids, position_ids, segments, gather)
            if hoisted is not None:
                input_ids, position_ids, segments, gather, shared = hoisted
                self.shared_tokens = shared.length * (segments.shape[0] - 1)
        mask = _shared_prompt_mask(segments, shared)
        attend = layout(segments) if self.segment_attention else {}
        if shared is not None:
            attend["shared_prefix"] = shared
        # use_cache=False: no KV cache to fill (and, under activation checkpointing, none that the recomputed
        # forward would append to a second time)
        hidden = self.lm.base_model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
                                    use_cache=False, **attend).last_hidden_state
        picked = hidden.gather(1, gather[..., None].expand(-1, -1, hidden.shape[-1]))  # [G, K*T, d]
        return self.head(picked.flatten(0, 1), targets, temperature, entropy, entropy_grad)

    def head(self, rows, targets, temperature: float, entropy: bool, entropy_grad: bool = False):
        """Hidden rows [G*K*T, d] -> logprobs [G*K, T]; with `entropy`, (logprobs, the policy's entropy at
        each of those positions [G*K, T], with a gradient only under `entropy_grad`)."""
        out, ent = head_logprobs(rows, self.lm.get_output_embeddings(), targets.reshape(-1), temperature,
                                 entropy, entropy_grad)
        logprobs = out.reshape(targets.shape).clone()  # not a view: FSDP2 hooks the output for its backward
        return (logprobs, ent.reshape(targets.shape)) if entropy else logprobs


def _shared_prompt_mask(segments: torch.Tensor, shared: SharedPrefix | None = None) -> torch.Tensor:
    """[G, L] segment ids -> [G, 1, L, L] bool: causal, within a completion or into the prompt. With a shared
    prefix of P tokens, [G, 1, L, P + L]: first the keeper row's P prefix keys, which every other row's tokens
    see."""
    q, k = segments[:, :, None], segments[:, None, :]
    length = segments.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=segments.device).tril()
    allowed = causal & (k != PAD) & ((k == 0) | (k == q))
    # padding rows attend to themselves
    allowed |= torch.eye(length, dtype=torch.bool, device=segments.device)
    if shared is not None:
        reads = (segments != PAD)[:, :, None].expand(-1, -1, shared.length).clone()
        reads[shared.row] = False  # the keeper attends to its own copy of the prefix
        allowed = torch.cat([reads, allowed], 2)
    return allowed[:, None]


def decoder_layers(lm: nn.Module) -> nn.ModuleList:
    """The causal LM's stack of decoder layers, whatever its attribute names (`model.layers`,
    `gpt_neox.layers`, `transformer.h`, ...): the module list in the base model with one entry per layer."""
    count = lm.config.num_hidden_layers
    for module in lm.base_model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == count:
            return module
    raise ValueError(f"found no list of {count} decoder layers in {type(lm).__name__}; "
                     "FSDP2 shards per layer")


def compile_stack(policy: nn.Module) -> None:
    """torch.compile the decoder stack in place, before any sharding: the parameter names stay (checkpoints
    and weight sync are unchanged). Dynamic shapes, since every batch has its own length. Inductor fuses the
    element-wise work and casts around the matmuls, most of a bf16 step on the CPU; one graph for the whole
    stack fuses more than one per layer does (bench/train_step.py: 2.4 vs 3.0 s a bf16 step, eager 3.3)."""
    policy.segment_attention = False  # its per-batch layout would make dynamo recompile for every batch
    policy.lm.base_model.compile(dynamic=True)


def hold_frozen_in(reference: TokenLogprobs, dtype: torch.dtype) -> None:
    """A frozen reference that runs under autocast to `dtype`, held as that autocast computes with it: its
    linear weights in `dtype` (each matmul casts them to it anyway, so its logprobs are the same), its other
    tensors copied out of the checkpoint file, whose mapping then goes. Loaded, the weights are pages of the
    mapped file, resident once a forward has read them: SmolLM2-135M's 513 MB of file pages become 310 MB of
    memory. An output head tied to the input embeddings stays float32: the embeddings start the float32
    residual stream."""
    tied = reference.lm.get_input_embeddings().weight
    for module in reference.modules():
        if isinstance(module, nn.Linear) and module.weight is not tied:
            module.to(dtype)
    for tensor in [*reference.parameters(), *reference.buffers()]:
        if tensor.dtype != dtype:
            tensor.data = tensor.data.clone()


def checkpoint_layers(policy: TokenLogprobs) -> None:
    """Activation checkpointing, in place: each decoder layer keeps only its input for the backward pass,
    which recomputes the rest. A long-completion batch (GSM8K's 512 tokens, 8 to a group) otherwise holds
    every layer's activations for thousands of tokens at once (docs/benchmarks.md, "Memory")."""
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper

    layers = decoder_layers(policy.lm)
    for i, layer in enumerate(layers):
        layers[i] = checkpoint_wrapper(layer, preserve_rng_state=False)


def shard(policy: TokenLogprobs) -> TokenLogprobs:
    """FSDP2: one unit per decoder layer, then the root (embeddings, final norm, lm_head)."""
    for layer in decoder_layers(policy.lm):
        fully_shard(layer)
    fully_shard(policy)
    return policy


def full_state(policy: nn.Module, meta: bool = False):
    """Yield (Hugging Face name, full tensor) for every weight; collectives under FSDP2 (all ranks call it), a
    few per model, not one per weight (trainer/gather.py). Wrapper segments in the names (activation
    checkpointing on the GPU plan) are dropped; a LoRA model's weights come merged (trainer/lora.py).
    meta=True: the same names in the same order, as meta tensors of the full shapes, gathering nothing: what a
    weight path plans its buckets from."""
    state = policy.state_dict().items()
    if meta:  # a DTensor's shape is global
        full = ((name, torch.empty(value.shape, dtype=value.dtype, device="meta")) for name, value in state)
    else:
        full = full_tensors(state)
    yield from merged(((engine_name(name), value) for name, value in full), policy.lm)


# How long a rank may wait in a collective: a backstop only. Ranks other than 0 wait for rank 0's word in
# shared memory, beating, before they enter the broadcast of the next batch (trainer/loop.py _wait_for_rank0),
# so no collective spans rank 0's wait for rollouts or its evaluation; a rank stuck in one is caught by its
# heartbeat (cluster.hang_timeout_s), a dead one by the supervisor.
COLLECTIVE_TIMEOUT = timedelta(minutes=30)


def init_gloo(rank: int, world_size: int, port: int) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            timeout=COLLECTIVE_TIMEOUT)


@runtime_checkable
class Placement(Protocol):
    """Where a trainer rank runs and how its model is held: `CPUPlacement` (below) on the CPU plan,
    trainer/gpu_policy.py's `GPUPlacement` on the GPU plan. The plan hands one to each rank."""
    device: torch.device

    def init_process_group(self, rank: int, world_size: int, port: int) -> None:
        """Join the trainer ranks' process group (gloo or NCCL)."""
        ...

    def load(self, path: str, world_size: int, frozen: bool = False, compile: bool = False,
             adapters: Adapters | None = None) -> TokenLogprobs:
        """The policy (or, frozen, the reference policy) from a Hugging Face folder, on `device`, sharded as
        this placement shards: its forward takes a packed batch and gives per-token logprobs [G*K, T].
        `adapters`: LoRA on a frozen base (trainer/lora.py), applied before compiling and sharding."""
        ...


class CPUPlacement:
    """A trainer rank on the CPU plan: gloo, fp32 weights (bf16 autocast per train.autocast), FSDP2 past one
    rank. trainer/gpu_policy.py's GPUPlacement is the GPU plan's. checkpointing:
    cluster.activation_checkpointing."""
    device = torch.device("cpu")

    def __init__(self, checkpointing: bool = False):
        self.checkpointing = checkpointing

    def init_process_group(self, rank: int, world_size: int, port: int) -> None:
        init_gloo(rank, world_size, port)

    def load(self, path: str, world_size: int, frozen: bool = False, compile: bool = False,
             adapters: Adapters | None = None) -> TokenLogprobs:
        """The policy (or, frozen, the reference policy) from a Hugging Face folder."""
        from transformers import AutoModelForCausalLM

        lm = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
        policy = TokenLogprobs(adapters.apply(lm) if adapters else lm)
        if self.checkpointing and not frozen:
            checkpoint_layers(policy)
        if compile:
            compile_stack(policy)
        if frozen:
            return policy.eval().requires_grad_(False)
        # FSDP2 only pays off with more than one rank; with one it would gather and copy every layer per pass.
        return shard(policy) if world_size > 1 else policy
