"""The output head's per-token log-probabilities, without the [rows, vocabulary] tensors plain autograd would
hold: `head_logprobs` for `TokenLogprobs.head` (trainer/policy.py)."""
import weakref

import torch
from torch import nn


def head_logprobs(hidden, head: nn.Linear, targets, temperature: float, entropy: bool = False,
                  entropy_grad: bool = False):
    """log_softmax(head(hidden) / temperature)[targets]: rows [N, d] -> [N] float32, in the autocast dtype if
    autocast is on for hidden's device, else in the weight's (bf16 under FSDP2's mixed precision); and the
    entropy of each row's distribution [N] when asked, else an empty tensor: without a gradient, unless
    `entropy_grad` (train.entropy_coef), which costs the frozen head's forward one more lm_head matmul."""
    device = hidden.device.type
    dtype = torch.get_autocast_dtype(device) if torch.is_autocast_enabled(device) else head.weight.dtype
    return _HeadLogprob.apply(hidden, _frozen_cast(head.weight, dtype), head.bias, targets, temperature,
                              dtype, entropy, torch.is_grad_enabled(), entropy and entropy_grad)


_casts: dict[int, tuple] = {}  # id(weight) -> (its weak reference, what it was cast from, the cast)


def _frozen_cast(weight: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A frozen weight (train.freeze_embeddings: the tied head) in `dtype`, cast once while its values last
    (its version counter and storage unchanged), not twice a step: 20 ms each for SmolLM2's 28M in bf16 on
    2 cores. A trained weight is returned as it is (the head casts it)."""
    if weight.requires_grad or weight.dtype == dtype:
        return weight
    key, held = (weight._version, weight.data_ptr(), dtype), _casts.get(id(weight))
    if held is None or held[0]() is not weight or held[1] != key:
        # the cast goes with the weight
        forget = weakref.ref(weight, lambda _, i=id(weight): _casts.pop(i, None))
        held = _casts[id(weight)] = (forget, key, weight.detach().to(dtype))
    return held[2]


class _HeadLogprob(torch.autograd.Function):
    """log_softmax((h @ W.T + b) / temperature)[target] for rows h [N, d], W [V, d], b [V] or None -> [N]
    float32.

    Rows go through in chunks (64 MB on the CPU, 1 GB on a GPU). A frozen head (no gradient for W or b: the
    tied embeddings under train.freeze_embeddings, the default) has the forward make the rows' gradient
    direction (softmax - onehot) @ W [N, d] from each chunk's softmax, and the backward scale it: two lm_head
    matmuls in all and nothing [N, V] held. A trained head's forward keeps the chunks' float32 softmax for the
    backward while all of them fit in KEEP_LOGITS_BYTES (the default run's ~300 completion tokens: 57 MB; one
    lm_head matmul fewer, `python -m bench.train_step --head-logits both`); past that the backward recomputes
    each chunk's logits (one more lm_head matmul) instead of holding them. Plain autograd would write the
    logits, a float32 copy, a dense gradient and log_softmax's backward over it: on a 1-thread CPU those
    passes cost more than the matmuls, and on a GPU with a 150k vocabulary they would take tens of GB for one
    micro-batch of long completions. The backward holds the logits' gradient [N, V] in the compute dtype only
    while it is at most WHOLE_GRAD_BYTES (two matmuls over all rows); past that, as for GSM8K's 8 x 512-token
    groups (400 MB), it goes chunk by chunk, the weight's gradient summed in float32.
    """
    CPU_CHUNK_BYTES, GPU_CHUNK_BYTES = 64 << 20, 1 << 30
    WHOLE_GRAD_BYTES = KEEP_LOGITS_BYTES = 256 << 20
    # False: a frozen head's backward as a trained one's (bench.train_step --head-logits)
    FROZEN_DIRECTION = True

    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, dtype, entropy, grad_enabled, entropy_grad):
        device = hidden.device
        chunk = _HeadLogprob.CPU_CHUNK_BYTES if device.type == "cpu" else _HeadLogprob.GPU_CHUNK_BYTES
        needs_h, needs_w, needs_b = ctx.needs_input_grad[:3] if grad_enabled else (False, False, False)
        entropy_grad = entropy_grad and (needs_h or needs_w or needs_b)
        with torch.autocast(device.type, enabled=False):
            h, w = hidden.to(dtype), weight.to(dtype)
            b = None if bias is None else bias.to(dtype)
            out = torch.empty(len(h), device=device)
            ent = torch.empty(len(h) if entropy else 0, device=device)
            # a frozen head (the tied embeddings under train.freeze_embeddings, LoRA): the rows' gradient is
            # made here, from the softmax at hand, and the backward only scales it: one lm_head matmul and one
            # [rows, V] pass fewer than recomputing the logits there, and nothing [rows, V] held between the
            # two
            direction = torch.empty(len(h), w.shape[1], dtype=dtype, device=device) \
                if needs_h and not needs_w and not needs_b and _HeadLogprob.FROZEN_DIRECTION else None
            # the entropy's, likewise: (softmax * (log_softmax + H)) @ W, -temperature x d H / d h
            entropy_direction = torch.empty_like(direction) \
                if entropy_grad and direction is not None else None
            # a trained head's backward, when the softmax is small: it then needs no second lm_head matmul
            # (the entropy's gradient takes the log-softmax, which it recomputes)
            keep = direction is None and (needs_h or needs_w or needs_b) and not entropy_grad and \
                len(h) * w.shape[0] * 4 <= _HeadLogprob.KEEP_LOGITS_BYTES
            kept = torch.empty(len(h), w.shape[0], device=device) if keep else None
            chunks = _chunks(len(h), w.shape[0], chunk)
            scratch = _Scratch(chunks[0].stop, w.shape[0], dtype, device)
            minus_one = torch.full((chunks[0].stop, 1), -1.0, device=device) \
                if direction is not None else None
            for rows in chunks:
                log_probs = _log_probs(h[rows], w, b, temperature, scratch)
                n = len(log_probs)
                out[rows] = log_probs.gather(-1, targets[rows, None]).squeeze(-1)
                if kept is not None or entropy or direction is not None:  # the softmax, made once here
                    probs = torch.exp(log_probs, out=scratch.logits[:n] if kept is None else kept[rows])
                    if entropy:  # H = -sum_v p_v log p_v, one dot product a row
                        ent[rows] = -torch.bmm(probs[:, None, :], log_probs[:, :, None]).view(-1)
                    if entropy_direction is not None:  # log_probs' last use: overwritten in place
                        _times_weight(log_probs.add_(ent[rows, None]).mul_(probs), w, scratch,
                                      entropy_direction[rows])
                    # (softmax - onehot(target)) @ W: -temperature x d logprob / d h
                    if direction is not None:
                        _times_weight(probs.scatter_add_(-1, targets[rows, None], minus_one[:n]), w, scratch,
                                      direction[rows])
        if direction is not None:
            ctx.save_for_backward(direction, entropy_direction)
        else:
            ctx.save_for_backward(h, weight, bias, targets, ent if entropy_grad else None)
        ctx.temperature, ctx.hidden_dtype, ctx.chunk, ctx.kept = temperature, hidden.dtype, chunk, kept
        ctx.frozen = direction is not None
        if not entropy_grad:
            ctx.mark_non_differentiable(ent)
        return out, ent

    @staticmethod
    def backward(ctx, grad, entropy_grad):
        temp = ctx.temperature
        scale = grad / temp
        nones = (None,) * 6
        if ctx.frozen:  # the forward's (softmax - onehot) @ W, scaled: float32 where scale is
            direction, entropy_direction = ctx.saved_tensors
            grad_h = direction * -scale[:, None]
            if entropy_direction is not None:  # d H / d h = -(softmax * (log_softmax + H)) @ W / temperature
                grad_h -= entropy_direction * (entropy_grad / temp)[:, None]
            return grad_h.to(ctx.hidden_dtype), None, None, *nones
        h, weight, bias, targets, ent = ctx.saved_tensors
        entropy_scale = None if ent is None else entropy_grad / temp

        # the forward's softmax, overwritten below: a second backward recomputes
        kept, ctx.kept = ctx.kept, None

        def grad_logits(rows, w, b):  # d logprob / d logits = (onehot(target) - softmax) / temperature
            term = None
            if entropy_scale is not None:  # + d H / d logits = -softmax * (log_softmax + H) / temperature
                log_probs = _log_probs(h[rows], w, b, temp, scratch)
                probs = torch.exp(log_probs, out=scratch.logits[:len(log_probs)])
                term = log_probs.add_(ent[rows, None]).mul_(probs).mul_(entropy_scale[rows, None])
            else:  # the forward's softmax, or its bits again
                probs = kept[rows] if kept is not None else _log_probs(h[rows], w, b, temp, scratch).exp_()
            g = probs.mul_(-scale[rows, None]).scatter_add_(-1, targets[rows, None], scale[rows, None])
            return g if term is None else g.sub_(term)

        with torch.autocast(h.device.type, enabled=False):
            w = weight.to(h.dtype)
            b = None if bias is None else bias.to(h.dtype)
            chunks = _chunks(len(h), w.shape[0], ctx.chunk)
            scratch = _Scratch(chunks[0].stop, w.shape[0], h.dtype, h.device)  # pages touched only if used
            if len(h) * w.shape[0] * h.element_size() <= _HeadLogprob.WHOLE_GRAD_BYTES:
                # in float32 the gradient takes the kept logits' place: no more memory than before they were
                # kept
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
                    g = grad_logits(rows, w, b)
                    if g.dtype != h.dtype:  # the compute dtype's copy, where the matmul went: free by now
                        g = scratch.matmul[:len(g)].copy_(g)
                    if need_h:
                        torch.mm(g, w, out=grad_h[rows])
                    if need_w:
                        grad_w += g.T @ h[rows]
                    if grad_b is not None:
                        grad_b += g.float().sum(0)
        return (None if grad_h is None else grad_h.to(ctx.hidden_dtype),
                None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype), *nones)


class _Scratch:
    """Where a chunk's logits go, made once a forward or a backward and reused by every chunk: on the CPU a
    fresh 64 MB tensor is a new mapping whose pages fault in, zeroed, at every chunk, which cost more than the
    passes over them (ac48462, docs/benchmarks.md, "Faster to a reward"). `matmul` in the compute dtype,
    `logits` in float32 (the same buffer in float32), `log_probs` float32; `logits` serves again for the
    entropy's softmax."""

    def __init__(self, rows: int, vocab: int, dtype: torch.dtype, device: torch.device):
        self.matmul = torch.empty(rows, vocab, dtype=dtype, device=device)
        self.logits = self.matmul if dtype == torch.float32 else torch.empty(rows, vocab, device=device)
        self.log_probs = torch.empty(rows, vocab, device=device)


def _times_weight(values, w, scratch: _Scratch, out):
    """values [n, V] (float32) @ W [V, d] into out, in W's dtype (through scratch.matmul, free once a chunk's
    logits were copied out of it)."""
    if values.dtype != w.dtype:
        values = scratch.matmul[:len(values)].copy_(values)
    torch.mm(values, w, out=out)


def _logits(h, w, b, temperature, scratch: _Scratch):
    """F.linear(h, w, b).float() / temperature, in scratch.logits: the same bits."""
    n = len(h)
    product = scratch.matmul[:n]
    torch.mm(h, w.T, out=product) if b is None else torch.addmm(b, h, w.T, out=product)
    logits = product if scratch.logits is scratch.matmul else scratch.logits[:n].copy_(product)
    return logits.div_(temperature) if temperature != 1.0 else logits


def _log_probs(h, w, b, temperature, scratch: _Scratch):
    # log_softmax's fused kernel: one pass where logsumexp and a subtraction over the [rows, V] logits took
    # three
    return torch.log_softmax(_logits(h, w, b, temperature, scratch), -1, out=scratch.log_probs[:len(h)])


def _chunks(n: int, vocab: int, chunk_bytes: int):
    step = max(1, chunk_bytes // (4 * vocab))
    return [slice(s, min(s + step, n)) for s in range(0, n, step)]
