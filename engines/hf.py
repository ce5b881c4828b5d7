"""The built-in engine's fallback: any Hugging Face causal LM, decoded through its own forward over our slot
cache.

`HFForward` offers what engines/llama.py's `Llama` offers (`weight_tensors`, `new_cache`, `prefill`,
`decode`), so `BuiltinEngine` keeps its continuous batching, shared-prompt prefill, per-token logprobs and
versions, and in-flight weight loads. The model's attention layers write their keys and values through
`SlotCache.update`, the hook every Hugging Face attention calls, into per-slot tensors laid out as the fast
path's cache; each call gets an explicit 4D mask and position ids, so nothing in the model depends on how long
the cache is. Slower than the fast path (the model's own modules, no fused projections), but the math is the
model's own.

Models whose layers keep state other than keys and values (sliding windows that roll, linear-attention or
recurrent layers) are refused at start by `engines/arch.py`.
"""
import torch
from transformers.cache_utils import Cache


class SlotCache(Cache):
    """Keys and values per layer, [max_batch, kv_heads, max_len, head_dim], allocated when a layer first
    writes.

    Before each forward the engine says where this batch's rows go (`prefill_into` or `decode_into`); `update`
    then stores a layer's new keys and values there and returns what that layer's queries attend over."""

    def __init__(self, max_batch: int, max_len: int):
        super().__init__(layers=[])
        self.max_batch, self.max_len = max_batch, max_len
        self.keys: dict[int, torch.Tensor] = {}
        self.values: dict[int, torch.Tensor] = {}
        self._write = None

    def prefill_into(self, rows: torch.Tensor, slots: torch.Tensor) -> None:
        """The next forward runs U distinct prompts [U, P]; slot `slots[j]` caches prompt `rows[j]`."""
        self._write = ("prefill", rows, slots)

    def decode_into(self, pos: torch.Tensor, slots: torch.Tensor, length: int) -> None:
        """The next forward runs one token per slot, at positions `pos`; attention reads
        cache[..., :length, :]."""
        self._write = ("decode", pos, slots, length)

    def update(self, key_states, value_states, layer_idx: int, *args, **kwargs):
        if layer_idx not in self.keys:
            shape = lambda t: (self.max_batch, t.shape[1], self.max_len, t.shape[3])  # noqa: E731
            self.keys[layer_idx] = key_states.new_zeros(shape(key_states))
            self.values[layer_idx] = value_states.new_zeros(shape(value_states))
        keys, values = self.keys[layer_idx], self.values[layer_idx]
        if self._write[0] == "prefill":
            _, rows, slots = self._write
            length = key_states.shape[2]
            keys[slots, :, :length] = key_states[rows]
            values[slots, :, :length] = value_states[rows]
            return key_states, value_states
        _, pos, slots, length = self._write
        keys[slots, :, pos] = key_states[:, :, 0]
        values[slots, :, pos] = value_states[:, :, 0]
        return keys[slots, :, :length], values[slots, :, :length]

    # What a model may ask of its cache; positions and masks are always given, so these only need to be sane.
    def get_seq_length(self, layer_idx: int = 0) -> int:
        return 0

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        return query_length, 0

    @property
    def is_compileable(self) -> bool:
        return False


def _additive(visible: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """A bool mask (True: attend) as the additive float mask every attention implementation accepts."""
    return torch.zeros(visible.shape, dtype=dtype, device=visible.device).masked_fill_(~visible,
                                                                                      torch.finfo(dtype).min)


class HFForward:
    """A Hugging Face causal LM as the engine's forward: the model is the engine's own copy, in `dtype`."""

    def __init__(self, model, dtype: torch.dtype, max_len: int, device: torch.device = torch.device("cpu")):
        self.lm = model.to(device, dtype).eval().requires_grad_(False)
        self.device, self.dtype = device, dtype

    def weight_tensors(self) -> dict[str, torch.Tensor]:
        """HF names -> the model's own parameter tensors (a `.copy_()` into them changes what the model
        computes)."""
        return dict(self.lm.state_dict(keep_vars=False))

    def block_weights(self) -> None:
        """Nothing to make: the model reads its parameters as they are (engines/llama.py keeps blocked
        copies)."""

    def drop_blocked(self) -> None:
        """Nothing to drop (block_weights)."""

    def new_cache(self, max_batch: int, max_len: int) -> tuple[SlotCache, None]:
        return SlotCache(max_batch, max_len), None

    def cache_bytes(self, max_batch: int, max_len: int) -> int:
        """0: a SlotCache allocates each layer's part at its first write, and the fallback keeps it."""
        return 0

    def copy_prefix(self, cache: SlotCache, _, source: int, target: int, length: int) -> None:
        """As `Llama.copy_prefix`: positions :length of slot `source`'s cache into slot `target`'s."""
        for store in (cache.keys, cache.values):
            for layer in store.values():
                layer[target, :, :length] = layer[source, :, :length]

    def prefill(self, cache: SlotCache, _, ids: torch.Tensor, rows: torch.Tensor,
                slots: torch.Tensor) -> None:
        """As `Llama.prefill`: U distinct right-padded prompts ids [U, P] into slots; no logits."""
        U, P = ids.shape
        causal = torch.ones(P, P, dtype=torch.bool, device=ids.device).tril()
        cache.prefill_into(rows, slots)
        self.lm.base_model(input_ids=ids, attention_mask=_additive(causal.expand(U, 1, P, P), self.dtype),
                           position_ids=torch.arange(P, device=ids.device).expand(U, P),
                           past_key_values=cache, use_cache=True)

    def decode(self, cache: SlotCache, _, ids: torch.Tensor, pos: torch.Tensor, slots: torch.Tensor,
               length: int) -> torch.Tensor:
        """As `Llama.decode`: one token for each running slot -> logits [n, V]."""
        visible = (torch.arange(length, device=pos.device)[None, :] <= pos[:, None])[:, None, None, :]
        cache.decode_into(pos, slots, length)
        out = self.lm(input_ids=ids[:, None], attention_mask=_additive(visible, self.dtype),
                      position_ids=pos[:, None], past_key_values=cache, use_cache=True)
        return out.logits[:, -1]
