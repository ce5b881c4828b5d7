"""The trained model on GPU: FSDP2 over NCCL in bf16, flash-attn with packed variable-length sequences.

    placement = GPUPlacement(gpu=4, checkpointing=True)   # what train.py hands trainer rank 0 of gpu8
    placement.init_process_group(rank, world_size, port)  # init_nccl: this rank on its GPU
    policy = placement.load(model_path, world_size)       # shard_gpu(GPUTokenLogprobs(load_lm(...)).cuda())

The CPU policy (trainer/policy.py) packs a group as one row, its prompt once and its K completions attending
into it, with a [L, L] mask. `GPUTokenLogprobs` keeps that layout through the forward wherever the attention
takes a mask (sdpa, eager: what the GPU plan runs without flash-attn installed), so each prompt is computed
once per group and the attention is one [L, L] square per group. Only flash-attn's variable-length kernel
takes no such mask: under `flash_attention_2` every completion becomes its own sequence (prompt + completion),
all of them back to back in one row with positions restarting at 0 (cu_seqlens from the positions), and the
prompt is computed K times: the price of the kernel.
"""
import importlib.metadata
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

from trainer.policy import (
    COLLECTIVE_TIMEOUT,
    TokenLogprobs,
    checkpoint_layers,
    compile_stack,
    decoder_layers,
    init_gloo,
)


def attn_implementation() -> str:
    """flash_attention_2 where the flash-attn 2 distribution is installed and CUDA is present, sdpa otherwise.

    Asks for the distribution, not the module: SGLang pulls in flash-attn-4, which installs `flash_attn.cute`
    and so makes a `flash_attn` module importable without flash-attn 2's kernels."""
    try:
        importlib.metadata.version("flash-attn")
    except importlib.metadata.PackageNotFoundError:
        return "sdpa"
    return "flash_attention_2" if torch.cuda.is_available() else "sdpa"


def load_lm(model_path: str, attn: str | None = None) -> nn.Module:
    """Weights stay fp32 (FSDP2 keeps the fp32 master copy and casts to bf16 per forward)."""
    from transformers import AutoModelForCausalLM

    return AutoModelForCausalLM.from_pretrained(model_path, dtype=torch.float32,
                                                attn_implementation=attn or attn_implementation())


def init_nccl(rank: int, world_size: int, port: int, gpu: int) -> None:
    """One trainer rank per GPU; `gpu` is the rank's GPU id from launch.layout.Layout.train_gpus."""
    torch.cuda.set_device(gpu)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world_size,
                            device_id=torch.device("cuda", gpu), timeout=COLLECTIVE_TIMEOUT)


@dataclass(frozen=True)
class GPUPlacement:
    """A trainer rank on the GPU plan: its own GPU, NCCL, FSDP2 with bf16 compute (MixedPrecisionPolicy; the
    CPU plan's train.autocast does not apply), packed variable-length sequences."""
    gpu: int  # this rank's GPU id, from launch.layout.Layout.train_gpus
    checkpointing: bool = False  # recompute each decoder layer's activations in the backward pass
    device_type: str = "cuda"  # "cpu": gloo on the CPU, how the CPU tests run the GPU plan's launch path
    # A GPU shared with an engine (the one-GPU layout): the most of it this rank's allocator may take, so that
    # its cache never grows into the engine's headroom (0: no cap)
    memory_fraction: float = 0.0

    @property
    def device(self) -> torch.device:
        return torch.device("cuda", self.gpu) if self.device_type == "cuda" else torch.device("cpu")

    def init_process_group(self, rank: int, world_size: int, port: int) -> None:
        if self.device_type == "cuda":
            init_nccl(rank, world_size, port, self.gpu)
            if self.memory_fraction:
                torch.cuda.set_per_process_memory_fraction(self.memory_fraction, self.gpu)
        else:
            init_gloo(rank, world_size, port)

    def load(self, path: str, world_size: int, frozen: bool = False, compile: bool = False,
             adapters=None) -> "GPUTokenLogprobs":
        """The policy (or, frozen, the reference policy), sharded even on one rank: FSDP2 keeps the fp32
        master weights and computes in bf16. `adapters`: LoRA on a frozen base (trainer/lora.py; not yet run
        on a GPU)."""
        lm = load_lm(path)
        policy = GPUTokenLogprobs(adapters.apply(lm) if adapters else lm).to(self.device)
        if compile:
            compile_stack(policy)
        if frozen:
            policy.eval().requires_grad_(False)
        return shard_gpu(policy, checkpointing=self.checkpointing and not frozen)


def shard_gpu(policy: TokenLogprobs, checkpointing: bool = False, reshard_after_forward: bool = True):
    """FSDP2 as torchtitan applies it: per decoder layer, then the root, bf16 compute, fp32 gradient
    reduction.

    checkpointing: recompute each layer's activations in the backward pass (less memory, ~30% more
    compute)."""
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    if checkpointing:
        checkpoint_layers(policy)
    layers = decoder_layers(policy.lm)
    for i, layer in enumerate(layers):
        # The last layer's parameters are needed again at once by the backward pass: keep them gathered.
        fully_shard(layer, mp_policy=mp, reshard_after_forward=reshard_after_forward and i < len(layers) - 1)
    fully_shard(policy, mp_policy=mp, reshard_after_forward=reshard_after_forward)
    return policy


VARLEN_KERNELS = ("flash_attention_2", "flash_attention_3")  # attention that takes sequences, not a mask


class GPUTokenLogprobs(TokenLogprobs):
    """TokenLogprobs with the same inputs and outputs: the shared-prompt layout as on the CPU, or, under a
    variable-length kernel (`varlen`, from the model's attention implementation), one row of separate
    sequences."""

    def __init__(self, lm: nn.Module, varlen: bool | None = None):
        super().__init__(lm)
        self.varlen = (getattr(lm.config, "_attn_implementation", None) in VARLEN_KERNELS if varlen is None
                       else varlen)

    def forward(self, input_ids, position_ids, segments, gather, targets, temperature: float,
                entropy: bool = False, entropy_grad: bool = False):
        # input_ids, position_ids, segments [G, L]; gather [G, K*T]; targets [G*K, T] -> logprobs [G*K, T]
        if not self.varlen:
            return super().forward(input_ids, position_ids, segments, gather, targets, temperature, entropy,
                                   entropy_grad)
        order, picks = varlen_layout(segments, gather, targets.shape[0] // segments.shape[0])
        order, picks = order.to(input_ids.device), picks.to(input_ids.device)
        ids = input_ids.reshape(-1)[order][None]  # [1, N]
        # restart at 0 with each sequence: the packing signal
        positions = position_ids.reshape(-1)[order][None]
        hidden = self.lm.base_model(input_ids=ids, position_ids=positions,
                                    use_cache=False).last_hidden_state[0]
        return self.head(hidden[picks].flatten(0, 1), targets, temperature, entropy, entropy_grad)


def varlen_layout(segments: torch.Tensor, gather: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """From the shared-prompt layout to separate sequences.

    Returns order [N]: flat indices into the [G, L] row-major inputs, sequence (g, i) = prompt of g then its
    completion i; and picks [G*K, T]: the index in `order` whose output predicts completion token t (the
    shared-prompt `gather`, re-pointed into each completion's own copy of the prompt)."""
    segments, gather = segments.cpu(), gather.cpu()  # a few hundred small ops: cheaper on the host
    groups, length = segments.shape
    steps = gather.shape[1] // k
    order, picks, base = [], torch.zeros(groups * k, steps, dtype=torch.long), 0
    for g in range(groups):
        prompt = (segments[g] == 0).nonzero().squeeze(1)
        for i in range(k):
            cols = torch.cat([prompt, (segments[g] == i + 1).nonzero().squeeze(1)])
            where = torch.zeros(length, dtype=torch.long)  # column of row g -> its place in the packed row
            where[cols] = torch.arange(base, base + len(cols))
            picks[g * k + i] = where[gather[g, i * steps:(i + 1) * steps]]
            order.append(cols + g * length)
            base += len(cols)
    return torch.cat(order), picks
