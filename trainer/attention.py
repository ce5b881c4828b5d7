"""Attention over packed group rows without the [L, L] square: each prompt once, then each completion against
its prompt's keys and its own.

A packed row (trainer/batch.py) holds a group's prompt and its K completions back to back, and completion i
sees the prompt and itself only. Through a dense [L, L] mask every kernel computes all L x L pairs and then
masks most of them out: for 8 completions of ~300 tokens after a ~90-token prompt that is 7x the pairs that
count. `segment_attention` computes only the pairs that count, with one SDPA call for the prompt
(causal) and one per completion (queries: the completion; keys: the prompt's, then its own, causally). The
result is the dense mask's up to rounding: the same keys, summed in a different order.

It is a Hugging Face attention function (transformers' AttentionInterface), so it runs inside any causal LM
built on that interface (Llama, Qwen, Mistral, GPT-2, ...). `use_segment_attention(lm)` switches a model to it
where the model allows (otherwise it keeps its own attention with the dense mask); `Spans.of(segments)` is the
layout the forward passes down to it as `segment_spans=`. Without that argument it is plain SDPA, so
generation and any other caller of the model are unchanged. Short rows keep the dense mask (`Spans.worth_it`):
there the square is small and one kernel call beats K + 1. On a CPU the shortest rows of a bf16 step
(the default run's) go through that mask as two float32 matmuls and a softmax (`_masked_matmuls`) rather than
SDPA, whose CPU kernel is slow with a mask at these sizes, its backward most (`layout` and `MATMUL_DTYPES`
decide).
"""
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch
from torch import nn
from torch.nn.functional import scaled_dot_product_attention as sdpa

if TYPE_CHECKING:
    from trainer.batch import SharedPrefix

NAME = "ringrl_segments"
# Rows at least this long take one call per segment; shorter ones the dense mask, where one kernel call beats
# K + 1 small ones: on a 2-core CPU in bf16 the two cross between rows of 370 and 730 tokens
# (docs/benchmarks.md; `python -m bench.train_step --completion-len N --attention both` compares them).
MIN_ROW = 512
# CPU rows shorter than this take `_masked_matmuls`. A whole bf16 learner step on 8 groups against SDPA's, one
# learner alternating the two, on a 2-core AMD EPYC with AVX-512 bf16 (`python -m bench.train_step --attention
# matmuls,dense --dtypes bf16 --completion-len N`): 1.13x faster at rows of 110 tokens, 1.13x at 136
# (the default run's), 1.17x at 170, 1.03x at 190, 0.93x at 218; past that each [L, L] score matrix outgrows
# the core's cache (0.8-0.9x at 245-331). The backward keeps each layer's float32 probabilities, [R, H, L, L]
# (SDPA keeps [R, H, L]): 2.7 MB a layer for the default run's 4 rows of 136 tokens, at most
# 4096 x 191 x H x 4 bytes (28 MB at SmolLM2's 9 heads) for a pass of train.micro_tokens=4096.
MATMUL_ROW = 192
# ... in a step that computes in one of these dtypes (CPU autocast's, else float32): a float32 step at rows of
# 136 was 0.95-0.96x SDPA's
MATMUL_DTYPES = (torch.bfloat16, torch.float16)
UNSUPPORTED = ("sliding_window", "softcap", "s_aux")  # attention arguments the per-segment calls do not apply


@dataclass
class Spans:
    """Where each packed row's segments lie: `rows[r]` = (prompt length, [(start, stop) of each completion],
    used length). The [c, prompt + c] masks of the completions are made once per forward and shared by every
    layer."""
    rows: list[tuple[int, list[tuple[int, int]], int]]
    device: torch.device
    masks: dict = field(default_factory=dict)

    @staticmethod
    def of(segments: torch.Tensor) -> "Spans":
        """From [G, L] segment ids (0 prompt, i + 1 completion i, PAD padding; prompt first, then the
        completions in order, as trainer.batch.pack lays them out)."""
        rows = []
        for ids in segments.cpu().tolist():
            counts = Counter(ids)
            prompt, start, spans = counts.get(0, 0), counts.get(0, 0), []
            for i in sorted(s for s in counts if s > 0):
                spans.append((start, start + counts[i]))
                start += counts[i]
            rows.append((prompt, spans, start))
        return Spans(rows, segments.device)

    @staticmethod
    def worth_it(segments: torch.Tensor) -> bool:
        return segments.shape[1] >= MIN_ROW

    def mask(self, prompt: int, length: int) -> torch.Tensor:
        """[length, prompt + length] bool: every prompt key, then causal within the completion."""
        key = (prompt, length)
        if key not in self.masks:
            causal = torch.ones(length, length, dtype=torch.bool, device=self.device).tril()
            self.masks[key] = torch.cat([causal.new_ones(length, prompt), causal], 1)
        return self.masks[key]


def layout(segments: torch.Tensor) -> dict:
    """The keywords a forward over these packed rows hands down to `segment_attention`: long rows their
    `Spans`, short rows of a bf16 step on a CPU `masked_matmuls=True`, the others none (SDPA with the dense
    mask)."""
    if Spans.worth_it(segments):
        return {"segment_spans": Spans.of(segments)}
    if segments.device.type == "cpu" and segments.shape[1] < MATMUL_ROW:
        computes_in = torch.get_autocast_dtype("cpu") if torch.is_autocast_enabled("cpu") else torch.float32
        if computes_in in MATMUL_DTYPES:
            return {"masked_matmuls": True}
    return {}


def _masked_matmuls(query, key, value, attention_mask, scaling: float | None) -> torch.Tensor:
    """Attention in float32 whatever the inputs' dtype (under autocast the rotated queries and keys come in
    float32, the values in bf16): query [R, H, L, d], key and value [R, H_kv, L, d], a bool (True: attend) or
    additive float mask [R, 1 or H, L, L] -> [R, H, L, d] in the query's dtype. The query heads that share a
    key head read it in place."""
    rows, heads, length, dim = query.shape
    groups = key.shape[1]
    q = query.float().view(rows, groups, heads // groups, length, dim)  # [R, H_kv, H / H_kv, L, d]
    scores = (torch.matmul(q, key.float().unsqueeze(2).transpose(-1, -2))
              * (dim ** -0.5 if scaling is None else scaling))
    mask = attention_mask.unsqueeze(1) if attention_mask.shape[1] == 1 else \
        attention_mask.view(attention_mask.shape[0], groups, heads // groups,
                            *attention_mask.shape[2:])  # per head
    if mask.dtype == torch.bool:
        scores = scores.masked_fill(~mask, torch.finfo(scores.dtype).min)
    else:
        scores = scores + mask
    out = torch.matmul(scores.softmax(-1), value.float().unsqueeze(2))
    return out.view(rows, heads, length, dim).to(query.dtype)


def _with_prefix(states: torch.Tensor, shared: "SharedPrefix") -> torch.Tensor:
    """Keys or values [R, H_kv, L, d] -> [R, H_kv, P + L, d]: the keeper row's P prefix positions, then each
    row's own. The backward sums every row's gradient into the keeper's."""
    prefix = states[shared.row:shared.row + 1, :, :shared.length]
    return torch.cat([prefix.expand(states.shape[0], -1, -1, -1), states], 2)


def segment_attention(module: nn.Module, query, key, value, attention_mask, scaling: float | None = None,
                      dropout: float = 0.0, segment_spans: Spans | None = None, masked_matmuls: bool = False,
                      **kwargs):
    """query [R, H, L, d], key and value [R, H_kv, L, d] -> ([R, L, H, d], None), as transformers' attention
    functions. With `masked_matmuls`, `_masked_matmuls` over `attention_mask`.
    Without either, or for a layer whose attention is more than a softmax over the allowed keys (a sliding
    window, logit soft-capping, sink logits), transformers' own SDPA with `attention_mask` (`masked_matmuls`
    applies no dropout either). With `shared_prefix=` a SharedPrefix (trainer/batch.py hoist_prefix), every
    row's keys and values start with the keeper row's prefix ones, and `attention_mask` is [R, 1, L, P + L]
    (trainer/policy.py)."""
    plain = any(kwargs.get(name) is not None for name in UNSUPPORTED)
    shared_prefix: SharedPrefix | None = kwargs.pop("shared_prefix", None)
    prefix = 0
    if shared_prefix is not None:
        key, value, prefix = (_with_prefix(key, shared_prefix), _with_prefix(value, shared_prefix),
                              shared_prefix.length)
    if masked_matmuls and attention_mask is not None and not (plain or dropout):
        return _masked_matmuls(query, key, value, attention_mask, scaling).transpose(1, 2).contiguous(), None
    if segment_spans is None or plain:
        from transformers.integrations.sdpa_attention import sdpa_attention_forward

        return sdpa_attention_forward(module, query, key, value, attention_mask, scaling=scaling,
                                      dropout=dropout, **kwargs)
    heads, length = query.shape[1], query.shape[2]
    if key.shape[1] != heads:  # grouped-query attention: each key/value head serves heads // H_kv query heads
        key, value = (key.repeat_interleave(heads // key.shape[1], 1),
                      value.repeat_interleave(heads // key.shape[1], 1))
    rows = []
    for r, (prompt, spans, used) in enumerate(segment_spans.rows):
        q, k, v = query[r:r + 1], key[r:r + 1], value[r:r + 1]
        # the shared prefix's keys this row reads (the keeper has its own in its prompt), then its prompt's
        first = prefix if shared_prefix is not None and r == shared_prefix.row else 0
        seen = prefix - first
        kp, vp = k[:, :, first:prefix + prompt], v[:, :, first:prefix + prompt]
        if seen:
            pieces = [sdpa(q[:, :, :prompt], kp, vp, attn_mask=segment_spans.mask(seen, prompt),
                           dropout_p=dropout, scale=scaling)]
        else:
            pieces = [sdpa(q[:, :, :prompt], kp, vp, is_causal=True, dropout_p=dropout, scale=scaling)]
        for a, b in spans:
            keys = torch.cat([kp, k[:, :, prefix + a:prefix + b]], 2)
            values = torch.cat([vp, v[:, :, prefix + a:prefix + b]], 2)
            pieces.append(sdpa(q[:, :, a:b], keys, values, attn_mask=segment_spans.mask(seen + prompt, b - a),
                               dropout_p=dropout, scale=scaling))
        if used < length:  # padding: never read by a real position
            pieces.append(q.new_zeros(1, heads, length - used, q.shape[3]))
        rows.append(torch.cat(pieces, 2))
    return torch.cat(rows).transpose(1, 2).contiguous(), None


def use_segment_attention(lm: nn.Module) -> bool:
    """Switch a Hugging Face causal LM from SDPA to `segment_attention`, where it allows; True if it did. A
    model on another attention (eager, flash-attn) or one that does not take attention functions is left as it
    is."""
    from transformers import AttentionInterface, AttentionMaskInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS

    model = lm.get_base_model() if hasattr(lm, "get_base_model") else lm  # under a LoRA (peft) wrapper
    config = getattr(model, "config", None)
    if getattr(config, "_attn_implementation", None) not in ("sdpa", NAME):
        return False
    if not getattr(model, "_supports_attention_backend", False):
        return False
    AttentionInterface.register(NAME, segment_attention)
    # Masks as SDPA's: a caller that hands the model no 4D mask (packed sequences told apart by their
    # positions, a plain causal forward) gets the mask SDPA would, and `segment_attention` is SDPA without a
    # layout.
    AttentionMaskInterface.register(NAME, ALL_MASK_ATTENTION_FUNCTIONS["sdpa"])
    model.set_attn_implementation(NAME)
    return config._attn_implementation == NAME
