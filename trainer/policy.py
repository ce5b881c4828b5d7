"""The trained model: per-token log-probabilities of packed completions, sharded with FSDP2."""
import weakref
from datetime import timedelta
from typing import Protocol, runtime_checkable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.fsdp import fully_shard

from engines.buckets import engine_name
from trainer.attention import layout, use_segment_attention
from trainer.batch import PAD
from trainer.lora import Adapters, merged


class TokenLogprobs(nn.Module):
    """Wraps a Hugging Face causal LM; returns log pi(token) (temperature applied) for every completion token.

    Any causal LM: the decoder is `lm.base_model`, the head `lm.get_output_embeddings()` (weight and bias). The
    head, a fifth of SmolLM2-135M's FLOPs, runs only where a completion token is predicted. Heads that do more
    than a linear map (soft-capping, logit scaling) are refused at start (engines/arch.py).
    """

    def __init__(self, lm: nn.Module):
        super().__init__()
        self.lm = lm
        # Long rows skip the dense mask's masked-out pairs, and a bf16 step's short rows skip SDPA's CPU kernel
        # (trainer/attention.py), where the model allows it.
        self.segment_attention = use_segment_attention(lm)

    def published_shapes(self) -> list[tuple[str, torch.Tensor]]:
        """(name, meta tensor) of every weight the trainer publishes, in the order it streams them (full_state):
        a LoRA model's merged weights differ in names and order from its state dict."""
        return list(full_state(self, meta=True))

    def forward(self, input_ids, position_ids, segments, gather, targets, temperature: float, entropy: bool = False):
        # input_ids, position_ids, segments [G, L]; gather [G, K*T]; targets [G*K, T] -> logprobs [G*K, T]
        mask = _shared_prompt_mask(segments)
        attend = layout(segments) if self.segment_attention else {}
        # use_cache=False: no KV cache to fill (and, under activation checkpointing, none that the recomputed
        # forward would append to a second time)
        hidden = self.lm.base_model(input_ids=input_ids, attention_mask=mask, position_ids=position_ids,
                                    use_cache=False, **attend).last_hidden_state
        picked = hidden.gather(1, gather[..., None].expand(-1, -1, hidden.shape[-1]))  # [G, K*T, d]
        return self.head(picked.flatten(0, 1), targets, temperature, entropy)

    def head(self, rows, targets, temperature: float, entropy: bool):
        """Hidden rows [G*K*T, d] -> logprobs [G*K, T]; with `entropy`, (logprobs, the policy's entropy at each
        of those positions [G*K, T], no gradient)."""
        out, ent = head_logprobs(rows, self.lm.get_output_embeddings(), targets.reshape(-1), temperature, entropy)
        logprobs = out.reshape(targets.shape).clone()  # not a view: FSDP2 hooks the output for its backward
        return (logprobs, ent.reshape(targets.shape)) if entropy else logprobs


def head_logprobs(hidden, head: nn.Linear, targets, temperature: float, entropy: bool = False):
    """log_softmax(head(hidden) / temperature)[targets]: rows [N, d] -> [N] float32, in the autocast dtype if
    autocast is on for hidden's device, else in the weight's (bf16 under FSDP2's mixed precision); and the
    entropy of each row's distribution [N] (no gradient) when asked, else an empty tensor."""
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else head.weight.dtype
    return _HeadLogprob.apply(hidden, _frozen_cast(head.weight, dtype), head.bias, targets, temperature, dtype,
                              entropy, torch.is_grad_enabled())


_casts: dict[int, tuple] = {}  # id(weight) -> (its weak reference, what it was cast from, the cast)


def _frozen_cast(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A frozen weight (train.freeze_embeddings: the tied head) in `dtype`, cast once while its values last (its
    version counter and storage unchanged), not twice a step: 20 ms each for SmolLM2's 28M in bf16 on 2 cores.
    A trained weight is returned as it is (the head casts it)."""
    if weight.requires_grad or weight.dtype == dtype:
        return weight
    key, held = (weight._version, weight.data_ptr(), dtype), _casts.get(id(weight))
    if held is None or held[0]() is not weight or held[1] != key:
        forget = weakref.ref(weight, lambda _, i=id(weight): _casts.pop(i, None))  # the cast goes with the weight
        held = _casts[id(weight)] = (forget, key, weight.detach().to(dtype))
    return held[2]


class _HeadLogprob(torch.autograd.Function):
    """log_softmax((h @ W.T + b) / temperature)[target] for rows h [N, d], W [V, d], b [V] or None -> [N] float32.

    Rows go through in chunks (64 MB on the CPU, 1 GB on a GPU). The forward keeps the chunks' float32 softmax for
    the backward while all of them fit in KEEP_LOGITS_BYTES (the default run's ~300 completion tokens: 57 MB; one
    lm_head matmul fewer, `python -m bench.train_step --head-logits both`); past that the backward recomputes each
    chunk's logits (one more lm_head matmul) instead of holding them. Plain autograd would write the logits, a
    float32 copy, a dense gradient and log_softmax's backward over it: on a 1-thread CPU those passes cost more
    than the matmuls, and on a GPU with a 150k vocabulary they would take tens of GB for one micro-batch of long
    completions. The backward holds the logits' gradient [N, V] in the compute dtype only while it is at most
    WHOLE_GRAD_BYTES (two matmuls over all rows); past that, as for GSM8K's 8 x 512-token groups (400 MB), it goes
    chunk by chunk, the weight's gradient summed in float32.
    """
    CPU_CHUNK_BYTES, GPU_CHUNK_BYTES = 64 << 20, 1 << 30
    WHOLE_GRAD_BYTES = KEEP_LOGITS_BYTES = 256 << 20

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, dtype, entropy, grad_enabled):
        device = hidden.device
        chunk = _HeadLogprob.CPU_CHUNK_BYTES if device.type == "cpu" else _HeadLogprob.GPU_CHUNK_BYTES
        with torch.autocast(device.type, enabled=False):
            h, w = hidden.to(dtype), weight.to(dtype)
            b = None if bias is None else bias.to(dtype)
            out = torch.empty(len(h), device=device)
            ent = torch.empty(len(h) if entropy else 0, device=device)
            # the backward's, when there is one and they are small: it then needs no second lm_head matmul
            keep = grad_enabled and any(ctx.needs_input_grad[:3]) and \
                len(h) * w.shape[0] * 4 <= _HeadLogprob.KEEP_LOGITS_BYTES
            kept = torch.empty(len(h), w.shape[0], device=device) if keep else None
            for rows in _chunks(len(h), w.shape[0], chunk):
                log_probs = _log_probs(h[rows], w, b, temperature)
                out[rows] = log_probs.gather(-1, targets[rows, None]).squeeze(-1)
                if kept is not None or entropy:  # the backward's softmax, made once here
                    probs = log_probs.exp() if kept is None else torch.exp(log_probs, out=kept[rows])
                    if entropy:  # H = -sum_v p_v log p_v, one dot product a row
                        ent[rows] = -torch.bmm(probs[:, None, :], log_probs[:, :, None]).view(-1)
        ctx.save_for_backward(h, weight, bias, targets)
        ctx.temperature, ctx.hidden_dtype, ctx.chunk, ctx.kept = temperature, hidden.dtype, chunk, kept
        ctx.mark_non_differentiable(ent)
        return out, ent

    @staticmethod
    def backward(ctx, grad, _entropy_grad):
        h, weight, bias, targets = ctx.saved_tensors
        temp = ctx.temperature
        scale = grad / temp

        kept, ctx.kept = ctx.kept, None  # the forward's softmax, overwritten below: a second backward recomputes

        def grad_logits(rows, w, b):  # d logprob / d logits = (onehot(target) - softmax) / temperature
            probs = kept[rows] if kept is not None else _log_probs(h[rows], w, b, temp).exp_()  # the forward's bits
            return probs.mul_(-scale[rows, None]).scatter_add_(-1, targets[rows, None], scale[rows, None])

        with torch.autocast(h.device.type, enabled=False):
            w = weight.to(h.dtype)
            b = None if bias is None else bias.to(h.dtype)
            chunks = _chunks(len(h), w.shape[0], ctx.chunk)
            if len(h) * w.shape[0] * h.element_size() <= _HeadLogprob.WHOLE_GRAD_BYTES:
                # in float32 the gradient takes the kept logits' place: no more memory than before they were kept
                same = kept is not None and kept.dtype == h.dtype
                whole = kept if same else torch.empty(len(h), w.shape[0], dtype=h.dtype, device=h.device)
                for rows in chunks:
                    g = grad_logits(rows, w, b)
                    if not same:
                        whole[rows] = g
                grad_h = whole @ w if ctx.needs_input_grad[0] else None
                grad_w = whole.T @ h if ctx.needs_input_grad[1] else None  # none for a frozen head
                grad_b = None if bias is None or not ctx.needs_input_grad[2] else whole.float().sum(0)
            else:
                need_h, need_w, need_b = ctx.needs_input_grad[:3]
                grad_h = torch.empty_like(h) if need_h else None
                grad_w = torch.zeros(w.shape, device=h.device) if need_w else None
                grad_b = torch.zeros(w.shape[0], device=h.device) if bias is not None and need_b else None
                for rows in chunks:
                    g = grad_logits(rows, w, b).to(h.dtype)
                    if need_h:
                        grad_h[rows] = g @ w
                    if need_w:
                        grad_w += g.T @ h[rows]
                    if grad_b is not None:
                        grad_b += g.float().sum(0)
        return (None if grad_h is None else grad_h.to(ctx.hidden_dtype),
                None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype), None, None, None, None, None)


def _logits(h, w, b, temperature):
    logits = torch.nn.functional.linear(h, w, b).float()
    return logits / temperature if temperature != 1.0 else logits


def _log_probs(h, w, b, temperature):
    # log_softmax's fused kernel: one pass where logsumexp and a subtraction over the [rows, V] logits took three
    return torch.log_softmax(_logits(h, w, b, temperature), -1)


def _chunks(n: int, vocab: int, chunk_bytes: int):
    step = max(1, chunk_bytes // (4 * vocab))
    return [slice(s, min(s + step, n)) for s in range(0, n, step)]


def _shared_prompt_mask(segments: torch.Tensor) -> torch.Tensor:
    """[G, L] segment ids -> [G, 1, L, L] bool: causal, within a completion or into the prompt."""
    q, k = segments[:, :, None], segments[:, None, :]
    length = segments.shape[1]
    causal = torch.ones(length, length, dtype=torch.bool, device=segments.device).tril()
    allowed = causal & (k != PAD) & ((k == 0) | (k == q))
    allowed |= torch.eye(length, dtype=torch.bool, device=segments.device)  # padding rows attend to themselves
    return allowed[:, None]


def decoder_layers(lm: nn.Module) -> nn.ModuleList:
    """The causal LM's stack of decoder layers, whatever its attribute names (`model.layers`, `gpt_neox.layers`,
    `transformer.h`, ...): the module list in the base model with one entry per layer."""
    count = lm.config.num_hidden_layers
    for module in lm.base_model.modules():
        if isinstance(module, nn.ModuleList) and len(module) == count:
            return module
    raise ValueError(f"found no list of {count} decoder layers in {type(lm).__name__}; FSDP2 shards per layer")


def compile_stack(policy: nn.Module) -> None:
    """torch.compile the decoder stack in place, before any sharding: the parameter names stay (checkpoints and
    weight sync are unchanged). Dynamic shapes, since every batch has its own length. Inductor fuses the
    element-wise work and casts around the matmuls, most of a bf16 step on the CPU; one graph for the whole
    stack fuses more than one per layer does (bench/train_step.py: 2.4 vs 3.0 s a bf16 step, eager 3.3)."""
    policy.segment_attention = False  # its per-batch layout would make dynamo recompile for every batch
    policy.lm.base_model.compile(dynamic=True)


def hold_frozen_in(reference: TokenLogprobs, dtype: torch.dtype) -> None:
    """A frozen reference that runs under autocast to `dtype`, held as that autocast computes with it: its linear
    weights in `dtype` (each matmul casts them to it anyway, so its logprobs are the same), its other tensors copied
    out of the checkpoint file, whose mapping then goes. Loaded, the weights are pages of the mapped file, resident
    once a forward has read them: SmolLM2-135M's 513 MB of file pages become 310 MB of memory. An output head tied
    to the input embeddings stays float32: the embeddings start the float32 residual stream."""
    tied = reference.lm.get_input_embeddings().weight
    for module in reference.modules():
        if isinstance(module, nn.Linear) and module.weight is not tied:
            module.to(dtype)
    for tensor in [*reference.parameters(), *reference.buffers()]:
        if tensor.dtype != dtype:
            tensor.data = tensor.data.clone()


def checkpoint_layers(policy: TokenLogprobs) -> None:
    """Activation checkpointing, in place: each decoder layer keeps only its input for the backward pass, which
    recomputes the rest. A long-completion batch (GSM8K's 512 tokens, 8 to a group) otherwise holds every layer's
    activations for thousands of tokens at once (docs/benchmarks.md, "Memory")."""
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
    """Yield (Hugging Face name, full tensor) for every weight; a collective under FSDP2 (all ranks call it).
    Wrapper segments in the names (activation checkpointing on the GPU plan) are dropped; a LoRA model's
    weights come merged (trainer/lora.py). meta=True: the same names in the same order, as meta tensors of the
    full shapes, gathering nothing: what a weight path plans its buckets from."""
    def full():
        for name, value in policy.state_dict().items():
            if meta:
                value = torch.empty(value.shape, dtype=value.dtype, device="meta")  # a DTensor's shape is global
            elif hasattr(value, "full_tensor"):
                value = value.full_tensor()
            yield engine_name(name), value

    yield from merged(full(), policy.lm)


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
        """The policy (or, frozen, the reference policy) from a Hugging Face folder, on `device`, sharded as this
        placement shards: its forward takes a packed batch and gives per-token logprobs [G*K, T]. `adapters`:
        LoRA on a frozen base (trainer/lora.py), applied before compiling and sharding."""
        ...


class CPUPlacement:
    """A trainer rank on the CPU plan: gloo, fp32 weights (bf16 autocast per train.autocast), FSDP2 past one
    rank. trainer/gpu_policy.py's GPUPlacement is the GPU plan's. checkpointing: cluster.activation_checkpointing."""
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
