"""Sampling a batch of next tokens from logits, the built-in engine's last step of a decode: temperature,
top-p, one counter-based uniform per row (so a seed fixes every completion whatever shares its batch) and the
sampled token's logprob."""
from dataclasses import dataclass

import torch
import torch.nn.functional as F


def nucleus(weights: torch.Tensor, top_p: torch.Tensor) -> torch.Tensor:
    """Zero out, per row, the tail outside the smallest set of tokens holding `top_p` of the mass."""
    sorted_weights, order = weights.sort(dim=-1, descending=True)
    cumulative = sorted_weights.cumsum(dim=-1)
    # Rows with top_p = 1 are left alone: float error in the cumsum could otherwise clip their tail.
    drop = (cumulative - sorted_weights > top_p[:, None] * cumulative[:, -1:]) & (top_p < 1)[:, None]
    return weights.scatter(1, order, sorted_weights.masked_fill(drop, 0.0))


def inverse_cdf(weights: torch.Tensor, u: torch.Tensor, block: int = 256) -> torch.Tensor:
    """Index i per row with cdf[i-1] <= u * total < cdf[i], for weights [n, V] >= 0 and u [n] in [0, 1).

    One uniform per row instead of torch.multinomial's one random number per vocabulary entry, and
    a two-level search (pick a block of `block` tokens, then a token inside it) because a row-wise
    cumsum over the full vocabulary is serial and slow on CPU.
    """
    n, vocab = weights.shape
    blocks = (F.pad(weights, (0, -vocab % block)) if vocab % block else weights).view(n, -1, block)
    block_cdf = blocks.sum(dim=-1).cumsum(dim=-1)
    # strictly below the total, even after rounding
    target = (u.clamp(max=1 - 2**-20) * block_cdf[:, -1])[:, None]
    b = torch.searchsorted(block_cdf, target, right=True)
    inner_cdf = blocks[torch.arange(n, device=weights.device), b.squeeze(1)].cumsum(dim=-1)
    # Re-summing the block can round differently: stay strictly below its total so a zero-weight tail is never
    # hit.
    rest = torch.minimum(target - (block_cdf.gather(1, b) - inner_cdf[:, -1:]),
                         inner_cdf[:, -1:] * (1 - 2**-20))
    inner = torch.searchsorted(inner_cdf, rest.clamp_(min=0), right=True).clamp_(max=block - 1)
    return (b * block + inner).squeeze(1)


def counter_uniform(seed: int, keys: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """A uniform in [0, 1) that is a pure function of (seed, key, position): splitmix64 on int64 tensors.

    Sampling token `position` of request `key` then draws the same number whatever else shares the batch and
    whenever it runs, so a seed fixes every completion (and a resumed run draws what the uninterrupted one
    did).
    """
    def shift(z, bits):  # logical right shift on int64
        return (z >> bits) & ((1 << (64 - bits)) - 1)

    salt = (seed * 0x3C6E_F372_FE94_F82B) % 2**64
    salt -= 2**64 if salt >= 2**63 else 0  # as a signed int64; tensor products below wrap around the same way
    z = (keys * 0x1_0000_0001 + positions + salt) * -7046029254386353131  # 0x9E3779B97F4A7C15
    z = (z ^ shift(z, 30)) * -4658895280553007687  # 0xBF58476D1CE4E5B9
    z = (z ^ shift(z, 27)) * -7723592293110705685  # 0x94D049BB133111EB
    z = z ^ shift(z, 31)
    return shift(z, 11).double().mul_(2.0 ** -53).float()


@dataclass(frozen=True)
class Passes:
    """Which of the sampler's optional passes over [n, V] a batch needs: some row's temperature is neither 0
    nor 1 (`scale`), some row's top_p < 1 (`nucleus`), some row is greedy (`greedy`). The engine knows them
    from its requests; a test of the device tensors would make the host wait for the device."""
    scale: bool
    nucleus: bool
    greedy: bool

    @classmethod
    def of(cls, params) -> "Passes":
        """For the SamplingParams of a batch's rows."""
        params = list(params)
        return cls(any(p.temperature not in (0, 1) for p in params), any(p.top_p < 1 for p in params),
                   any(p.temperature == 0 for p in params))

    @classmethod
    def reading(cls, temperature: torch.Tensor, top_p: torch.Tensor) -> "Passes":
        """From the tensors themselves: three host syncs (tests and one-off callers)."""
        return cls(bool(((temperature != 0) & (temperature != 1)).any()), bool((top_p < 1).any()),
                   bool((temperature == 0).any()))


def sample(logits: torch.Tensor, temperature: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor,
           passes: Passes | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """logits [n, V] (float32, or the engine's bf16; left as they are), uniforms u [n] -> tokens [n], and
    their logprobs under softmax(logits / T) (T = 1 for greedy). `passes`: which optional passes the rows need
    (None: read from the tensors); a row that needs a pass its batch skips gets a wrong draw (the engine's
    idle rows only).

    One float32 copy of the logits becomes the softmax numerators in place: at 64 rows of a 49k vocabulary
    each pass over [n, V] costs about a millisecond on a 2-core CPU, and a fresh buffer per pass more. The
    sampled tokens' own logits are read back from `logits` (divided by T as the whole row was), the same bits.
    No branch reads the device, so a step can be captured as a CUDA graph (engines/static_decode.py)."""
    passes = passes or Passes.reading(temperature, top_p)
    greedy = temperature == 0
    divisor = torch.where(greedy, 1.0, temperature)
    scaled = logits.float() if logits.dtype != torch.float32 else logits.clone()
    if passes.scale:
        scaled.div_(divisor[:, None])
    peak = scaled.amax(dim=-1, keepdim=True)  # max() would also find the argmax: 20x slower at 49k entries
    weights = scaled.sub_(peak).exp_()  # softmax numerators; normalising them is never needed
    log_norm = peak.squeeze(1) + weights.sum(dim=-1).log()
    if passes.nucleus:
        weights = nucleus(weights, top_p)
    tokens = inverse_cdf(weights, u)
    if passes.greedy:
        tokens = torch.where(greedy, logits.argmax(dim=-1), tokens)
    picked = logits.gather(1, tokens[:, None]).squeeze(1).float()
    return tokens, (picked / divisor if passes.scale else picked) - log_norm
