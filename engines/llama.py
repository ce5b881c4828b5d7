"""The Llama forward pass (also Mistral, Qwen2 and Qwen3) over a per-slot KV cache, for batched decoding on
any device: the built-in engine's fast path. Every other causal LM runs on engines/hf.py's fallback.

Weights are copied out of the Hugging Face model into the engine's own tensors, with q/k/v and
gate/up fused so a layer is four matmuls. `weight_tensors()` hands back HF-named row views of them,
so a trainer can `.copy_()` new weights in without knowing about the fusion; `drop_blocked()` must follow (the
built-in engine's `adopt_weights` calls it), and the blocked copies are made again before the next decode
step.
"""
import math
from dataclasses import dataclass
from functools import partial

import torch
import torch.nn.functional as F

SUPPORTED = ("LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM", "Qwen3ForCausalLM")


def unsupported(name: str, config, max_len: int) -> str | None:
    """Why `Llama` cannot compute architecture `name` with this config exactly (None: it can)."""
    if name not in SUPPORTED:
        return f"the fast path runs {', '.join(SUPPORTED)}, not {name}"
    if config.hidden_act != "silu" or getattr(config, "mlp_bias", False):
        return f"the fast path needs a bias-free SiLU MLP, {name} has hidden_act={config.hidden_act}"
    if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or []):
        return f"the fast path has no sliding-window attention; {name} uses it (layer_types)"
    window = getattr(config, "sliding_window", None)
    if name == "MistralForCausalLM" and window is not None and window < max_len:
        return f"sliding_window={window} < max_len={max_len}: lower max_len to at most {window}"
    return None


def check_supported(model, max_len: int) -> None:
    """Refuse, in one line, any model whose math differs from what `Llama` computes."""
    reason = unsupported(type(model).__name__, model.config, max_len)
    if reason:
        raise ValueError(reason)


def rope_tables(config, head_dim: int, max_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin, [max_len, head_dim] in float32, computed exactly as HF's rotary embedding does."""
    params = (getattr(config, "rope_parameters", None)
              or {"rope_type": "default", "rope_theta": config.rope_theta})
    kind = params.get("rope_type", "default")
    if kind == "default":
        inv_freq = 1.0 / (params["rope_theta"]
                          ** (torch.arange(0, head_dim, 2, dtype=torch.float) / head_dim))
        scale = 1.0
    elif kind in ("linear", "llama3", "yarn", "longrope"):  # static rescalings of the frequencies: reuse HF's
        from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
        inv_freq, scale = ROPE_INIT_FUNCTIONS[kind](config)
    else:
        raise ValueError(f"the built-in engine does not support rope_type={kind!r}")
    freqs = torch.arange(max_len, dtype=torch.float)[:, None] * inv_freq[None, :]
    angles = torch.cat((freqs, freqs), dim=-1)
    return angles.cos() * scale, angles.sin() * scale


def blocks_weights(device: torch.device, dtype: torch.dtype) -> bool:
    """Whether the matmuls read oneDNN-blocked copies of the weights, at decode's few rows faster than
    F.linear:
    - bf16 on a CPU with AVX-512 (native bf16): about 1.4x at 32-64 rows, the same bits as F.linear;
    - fp32 on a CPU with AVX2 and no AVX-512: 1.3-2.5x per matmul at 32-64 rows against MKL's F.linear
      (the output head most), 1.28x in bench.generate, on a 2-core AMD EPYC. The last bits differ from
      F.linear's, as far apart as two fp32 matmuls can be; the engine-trainer mismatch stays at fp32's
      (docs/benchmarks.md).
    fp32 with AVX-512 keeps F.linear (not measured there), as does bf16 without it."""
    if device.type != "cpu" or not torch.backends.mkldnn.is_available():
        return False
    capability = torch.backends.cpu.get_cpu_capability()
    return (dtype == torch.bfloat16 and capability.startswith("AVX512")) or \
        (dtype == torch.float32 and capability == "AVX2")


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    # Statistics in float32 even for bf16 activations, as HF does.
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(x.dtype)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    rotated = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + rotated * sin


def widen(cache: torch.Tensor, width: int) -> torch.Tensor:
    """cache [..., W, d], contiguous from the start of its memory, made [..., width, d] (width > W) in that
    same memory: every row of W positions moves to where a row of `width` starts, the last rows first, in runs
    whose new place does not overlap their old one (a run [a, end) can move at once when
    a x width >= end x W); the few first rows, whose places overlap, go through a copy. The new positions are
    zeroed."""
    *lead, held, d = cache.shape
    rows, old, new = math.prod(lead), held * d, width * d
    flat = torch.empty(0, dtype=cache.dtype, device=cache.device).set_(cache.untyped_storage())
    end = rows
    while end > 1:
        start = -(-end * old // new)
        if start < end:
            flat.as_strided((end - start, old), (new, 1), start * new).copy_(
                flat[start * old:end * old].view(-1, old))
        else:
            start = end - 1
            flat[start * new:start * new + old] = flat[start * old:start * old + old].clone()
        end = start
    grown = flat[:rows * new].view(*lead, width, d)
    grown[..., held:, :].zero_()
    return grown


def two_matmul_attention(visible: torch.Tensor, head_dim: int):
    """Decode attention as two batched matmuls and a float32 softmax, the mask made additive once for all
    layers. On the CPU the fused kernel pays per-call overhead for a decode's few query rows: at 64 sequences
    the split is 1.1-2.4x its speed in fp32 (45-300 cached tokens), and in bf16 it makes the engine 1.06-1.11x
    faster where its operands are contiguous (oneDNN's bf16 batched matmul copies a strided one first;
    `decode` picks the width). In bf16 the scores leave the matmul rounded to bf16 before the float32 softmax;
    the engine-trainer mismatch did not move (e6863a0, docs/benchmarks.md)."""
    bias = torch.zeros(visible.shape, device=visible.device).masked_fill_(~visible, -math.inf)
    scale = head_dim ** -0.5

    def attend(q, keys, values):
        # bias + scale x scores in one float32 pass: the bias is 0 or -inf, so the same bits as scaling, then
        # adding
        scores = torch.add(bias, torch.matmul(q, keys.transpose(-1, -2)), alpha=scale)
        return torch.matmul(scores.softmax(-1).to(values.dtype), values)
    return attend


@dataclass
class Layer:
    attn_norm: torch.Tensor
    qkv: torch.Tensor              # [(H + 2 KV) * head_dim, D]: q, k, v projections stacked by rows
    qkv_bias: torch.Tensor | None  # Qwen2, or attention_bias=true
    q_norm: torch.Tensor | None  # Qwen3 only: RMSNorm over each head of q and of k, before the rotation
    k_norm: torch.Tensor | None
    o: torch.Tensor
    o_bias: torch.Tensor | None  # attention_bias=true (not Qwen2)
    mlp_norm: torch.Tensor
    gate_up: torch.Tensor          # [2 I, D]: gate then up
    down: torch.Tensor


class Llama:
    # CPU decode attention as two matmuls where `decode` says they pay (False: the fused kernel)
    split_attention = True

    def __init__(self, model, dtype: torch.dtype, max_len: int, device: torch.device = torch.device("cpu")):
        check_supported(model, max_len)
        config = model.config
        self.device = device
        self.n_heads, self.n_kv_heads = config.num_attention_heads, config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.n_heads
        self.eps, self.dtype = config.rms_norm_eps, dtype
        self.views: dict[str, torch.Tensor] = {}
        state = {name: t.detach() for name, t in model.state_dict().items()}

        self.embed = self._own(state, "model.embed_tokens.weight")
        if model.get_output_embeddings().weight is model.get_input_embeddings().weight:
            self.lm_head = self.embed  # tied: one tensor, reachable under both names
            if "lm_head.weight" in state:
                self.views["lm_head.weight"] = self.embed
        else:
            self.lm_head = self._own(state, "lm_head.weight")
        self.norm = self._own(state, "model.norm.weight")
        self.layers = [self._load_layer(state, f"model.layers.{i}.") for i in range(config.num_hidden_layers)]
        cos, sin = rope_tables(config, self.head_dim, max_len)
        self.cos, self.sin = cos.to(device, dtype), sin.to(device, dtype)
        # whether the matmuls read blocked copies (False: F.linear)
        self.blocks = blocks_weights(device, dtype)
        # a matrix's data_ptr -> its blocked copy, made before decoding
        self.blocked: dict[int, torch.Tensor] = {}

    def _own(self, state: dict, name: str) -> torch.Tensor:
        # A copy, never an alias: the HF parameters may belong to a trainer that keeps updating them.
        tensor = state[name].to(self.device, self.dtype, copy=True)
        self.views[name] = tensor
        return tensor

    def _fuse(self, state: dict, names: list[str]) -> torch.Tensor:
        fused = torch.cat([state[name].to(self.device, self.dtype) for name in names])
        for name, view in zip(names, fused.split([state[name].shape[0] for name in names])):
            self.views[name] = view
        return fused

    def _load_layer(self, state: dict, prefix: str) -> Layer:
        attn = [f"{prefix}self_attn.{p}_proj." for p in "qkv"]
        has_bias, has_norms = attn[0] + "bias" in state, prefix + "self_attn.q_norm.weight" in state
        return Layer(
            attn_norm=self._own(state, prefix + "input_layernorm.weight"),
            qkv=self._fuse(state, [a + "weight" for a in attn]),
            qkv_bias=self._fuse(state, [a + "bias" for a in attn]) if has_bias else None,
            q_norm=self._own(state, prefix + "self_attn.q_norm.weight") if has_norms else None,
            k_norm=self._own(state, prefix + "self_attn.k_norm.weight") if has_norms else None,
            o=self._own(state, prefix + "self_attn.o_proj.weight"),
            o_bias=self._own(state, prefix + "self_attn.o_proj.bias")
            if prefix + "self_attn.o_proj.bias" in state else None,
            mlp_norm=self._own(state, prefix + "post_attention_layernorm.weight"),
            gate_up=self._fuse(state, [prefix + "mlp.gate_proj.weight", prefix + "mlp.up_proj.weight"]),
            down=self._own(state, prefix + "mlp.down_proj.weight"),
        )

    def weight_tensors(self) -> dict[str, torch.Tensor]:
        return dict(self.views)

    def block_weights(self) -> None:
        """Make the blocked copies the matmuls read, if this forward keeps them (`blocks`) and they are not
        made yet: about 0.1 s for 135M parameters, once a version, against about 10 ms saved on every decode
        step of 32 rows. The built-in engine calls it before decoding."""
        if self.blocks and not self.blocked:
            matrices = [self.lm_head] + [w for layer in self.layers
                                         for w in (layer.qkv, layer.o, layer.gate_up, layer.down)]
            self.blocked = {w.data_ptr(): torch.ops.mkldnn._reorder_linear_weight(w, 64) for w in matrices}

    def drop_blocked(self) -> None:
        """Forget the blocked copies: the weights changed, or an idle engine gives their memory back."""
        self.blocked = {}

    def _linear(self, x: torch.Tensor, weight: torch.Tensor,
                bias: torch.Tensor | None = None) -> torch.Tensor:
        blocked = self.blocked.get(weight.data_ptr())
        if blocked is None:
            return F.linear(x, weight, bias)
        return torch.ops.mkldnn._linear_pointwise(x, blocked, bias, "none", [], "")

    def new_cache(self, max_batch: int, max_len: int, capacity: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
        """Zeroed key and value caches [layers, max_batch, kv heads, max_len, head_dim], each the start of
        memory for `capacity` positions (at least max_len) that `grow_cache` widens them into. The memory past
        max_len is not written, so the OS maps it only as the caches grow."""
        shape = self._cache_shape(max_batch, max_len)
        held = math.prod(self._cache_shape(max_batch, max(capacity, max_len)))
        return tuple(torch.empty(held, dtype=self.dtype, device=self.device)[:math.prod(shape)]
                     .view(shape).zero_() for _ in range(2))

    def grow_cache(self, k_cache, v_cache, width: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The same caches `width` positions wide: what they hold is kept, the new positions are zeros. In
        place where their memory has room (`new_cache`'s capacity): no fresh buffer to map and copy into at
        each growth, so the width can follow the longest sequence closely."""
        room = k_cache.numel() // k_cache.shape[3] * width * k_cache.element_size()
        if all(c.storage_offset() == 0 and c.is_contiguous() and c.untyped_storage().nbytes() >= room
               for c in (k_cache, v_cache)):
            return widen(k_cache, width), widen(v_cache, width)
        k, v = self.new_cache(k_cache.shape[1], width)
        held = k_cache.shape[3]
        k[:, :, :, :held] = k_cache
        v[:, :, :, :held] = v_cache
        return k, v

    def cache_bytes(self, max_batch: int, max_len: int) -> int:
        """What new_cache would allocate (keys and values), without allocating it."""
        return 2 * math.prod(self._cache_shape(max_batch, max_len)) * self.dtype.itemsize

    def _cache_shape(self, max_batch: int, max_len: int) -> tuple[int, ...]:
        return len(self.layers), max_batch, self.n_kv_heads, max_len, self.head_dim

    def _attend_split(self, visible: torch.Tensor):
        return two_matmul_attention(visible, self.head_dim)

    def copy_prefix(self, k_cache, v_cache, source: int, target: int, length: int) -> None:
        """Slot `target` gets the keys and values of positions :length that slot `source` holds: its
        prompt's."""
        k_cache[:, target, :, :length] = k_cache[:, source, :, :length]
        v_cache[:, target, :, :length] = v_cache[:, source, :, :length]

    def _qkv(self, layer: Layer, h: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor):
        """h [..., D] -> q [..., H, hd] and k [..., KV, hd], both rotated, and v [..., KV, hd]."""
        qkv = self._linear(h, layer.qkv, layer.qkv_bias).unflatten(-1, (-1, self.head_dim))
        qk = qkv[..., :self.n_heads + self.n_kv_heads, :]
        if layer.q_norm is not None:
            qk = torch.cat((rms_norm(qk[..., :self.n_heads, :], layer.q_norm, self.eps),
                            rms_norm(qk[..., self.n_heads:, :], layer.k_norm, self.eps)), dim=-2)
        qk = apply_rope(qk, cos, sin)  # q and k rotate in one pass
        return (qk[..., :self.n_heads, :], qk[..., self.n_heads:, :],
                qkv[..., self.n_heads + self.n_kv_heads:, :])

    def _mlp(self, layer: Layer, x: torch.Tensor) -> torch.Tensor:
        gate, up = self._linear(rms_norm(x, layer.mlp_norm, self.eps), layer.gate_up).chunk(2, dim=-1)
        return self._linear(F.silu(gate) * up, layer.down)

    def prefill(self, k_cache, v_cache, ids: torch.Tensor, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """Fill the cache of slot `slots[j]` with the keys/values of prompt `ids[rows[j]]`.

        ids [U, P] are U distinct right-padded prompts; a prompt shared by several slots is computed
        once. Padding needs no mask: causality keeps real tokens from seeing it, and the cache past a
        slot's length is masked at decode time and overwritten as the slot grows.
        """
        U, P = ids.shape
        x = self.embed[ids]
        cos, sin = self.cos[:P, None], self.sin[:P, None]
        for i, layer in enumerate(self.layers):
            q, k, v = (t.transpose(1, 2)
                       for t in self._qkv(layer, rms_norm(x, layer.attn_norm, self.eps), cos, sin))
            k_cache[i, slots, :, :P] = k[rows]
            v_cache[i, slots, :, :P] = v[rows]
            if i == len(self.layers) - 1:
                break  # the last layer's output only feeds logits, which prefill does not produce
            attn = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
            x = x + self._linear(attn.transpose(1, 2).flatten(2), layer.o, layer.o_bias)
            x = x + self._mlp(layer, x)

    def extend(self, k_cache, v_cache, ids: torch.Tensor, slot: int, start: int) -> None:
        """Append tokens `ids` [m] at positions start.. to the cache of `slot`, which holds positions
        0..start-1: the next turn of a parked sequence, prefilled without recomputing what it already
        cached."""
        m = ids.shape[0]
        x = self.embed[ids][None]
        cos, sin = self.cos[start:start + m, None], self.sin[start:start + m, None]
        pos = torch.arange(start, start + m, device=ids.device)
        visible = torch.arange(start + m, device=ids.device)[None, :] <= pos[:, None]  # [m, start + m]
        for i, layer in enumerate(self.layers):
            q, k, v = (t.transpose(1, 2)
                       for t in self._qkv(layer, rms_norm(x, layer.attn_norm, self.eps), cos, sin))
            k_cache[i, slot, :, start:start + m] = k[0]
            v_cache[i, slot, :, start:start + m] = v[0]
            if i == len(self.layers) - 1:
                break  # as in prefill: no logits
            keys, values = k_cache[i, slot:slot + 1, :, :start + m], v_cache[i, slot:slot + 1, :, :start + m]
            attn = F.scaled_dot_product_attention(q, keys, values, attn_mask=visible, enable_gqa=True)
            x = x + self._linear(attn.transpose(1, 2).flatten(2), layer.o, layer.o_bias)
            x = x + self._mlp(layer, x)

    def decode(self, k_cache, v_cache, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
               length: int, dense: bool | None = None) -> torch.Tensor:
        """One token for each running slot: ids, pos, slots [n] (slots ascending) -> logits [n, V] in the
        engine's dtype (the sampler takes its one float32 copy).

        `length` bounds every slot's position, so attention reads only cache[..., :length, :]. `dense`: the
        slots are 0..n-1 (None: read from `slots`, a host sync; the static step says so instead).
        """
        n = ids.shape[0]
        # Slots 0..n-1 are the common case under continuous batching: read the cache through a strided
        # view; otherwise gather the running slots, cheaper than computing idle ones.
        dense = int(slots[-1]) == n - 1 if dense is None else dense
        # On the CPU attention is two matmuls (_attend_split) where they read contiguous keys: always in fp32
        # (its batched matmul takes strided operands as they are); in bf16 the gathered slots, or, for slots
        # 0..n-1, the cache's whole width once `length` is at least half of it (past positions are masked),
        # else the fused kernel.
        width, split = length, self.split_attention and self.device.type == "cpu"
        if split and self.dtype != torch.float32 and dense:
            split = 2 * length >= k_cache.shape[3]
            width = k_cache.shape[3] if split else length
        x = self.embed[ids]
        cos, sin = self.cos[pos][:, None], self.sin[pos][:, None]
        # [n, 1, 1, T]
        visible = (torch.arange(width, device=pos.device)[None, :] <= pos[:, None])[:, None, None, :]
        attend = (self._attend_split(visible) if split
                  else partial(F.scaled_dot_product_attention, attn_mask=visible))
        for i, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, rms_norm(x, layer.attn_norm, self.eps), cos, sin)
            k_cache[i, slots, :, pos] = k
            v_cache[i, slots, :, pos] = v
            keys = k_cache[i, :n, :, :width] if dense else k_cache[i, slots, :, :width]
            values = v_cache[i, :n, :, :width] if dense else v_cache[i, slots, :, :width]
            # The G query heads sharing a kv head go in as G query rows: faster on CPU than enable_gqa.
            attn = attend(q.unflatten(1, (self.n_kv_heads, -1)), keys, values)
            x = x + self._linear(attn.flatten(1), layer.o, layer.o_bias)
            x = x + self._mlp(layer, x)
        return self._linear(rms_norm(x, self.norm, self.eps), self.lm_head)
