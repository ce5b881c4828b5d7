"""Tiny random causal LMs of several families, for the engine's and the trainer's parity tests.

    model = tiny_model("qwen3", vocab=512)   # fast path;  "gpt_neox", "phi", "gemma", "gpt2": the fallback

Norm weights and biases are perturbed: Hugging Face initialises them to ones and zeros, which would leave a
missing norm or bias unnoticed.
"""
import torch
from transformers import AutoConfig, AutoModelForCausalLM

FAST = ("qwen3", "llama3")
FALLBACK = ("gpt_neox", "phi", "gemma", "gpt2")

_SHAPE = dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4, intermediate_size=128,
              max_position_embeddings=256)


def tiny_config(kind: str, vocab: int = 512, **extra):
    tokens = dict(bos_token_id=1, eos_token_id=2, pad_token_id=2)
    if kind == "qwen3":  # head_dim 32 x 4 heads on a hidden size of 64, as Qwen3's head_dim != hidden / heads
        values = dict(_SHAPE, num_key_value_heads=2, head_dim=32, tie_word_embeddings=False)
    elif kind == "llama3":  # rope scaling of Llama 3.x, and biased attention projections
        values = dict(_SHAPE, num_key_value_heads=2, attention_bias=True, rope_scaling={
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
            "original_max_position_embeddings": 16})
    elif kind == "gpt_neox":
        values = dict(_SHAPE, rotary_pct=0.5, use_parallel_residual=True, tie_word_embeddings=False)
    elif kind == "phi":  # partial rotary, a dense MLP, an output head with a bias
        values = dict(_SHAPE, partial_rotary_factor=0.5, tie_word_embeddings=False)
    elif kind == "gemma":  # one kv head, head_dim 32, scaled embeddings, tied head
        values = dict(_SHAPE, num_key_value_heads=1, head_dim=32)
    elif kind == "gpt2":
        values = dict(n_embd=64, n_layer=2, n_head=4, n_positions=256)
    else:
        raise ValueError(kind)
    model_type = "llama" if kind == "llama3" else kind
    # extra may override
    return AutoConfig.for_model(model_type, vocab_size=vocab, **tokens, **{**values, **extra})


def tiny_model(kind: str, vocab: int = 512, seed: int = 0, **extra):
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(tiny_config(kind, vocab, **extra)).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or "ln" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.3)
    return model


def save_tiny(kind: str, folder: str, tokenizer_dir: str, **extra) -> str:
    """A tiny random model of `kind` with SmolLM2's tokenizer, saved as a Hugging Face folder."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    tiny_model(kind, vocab=len(tokenizer), **extra).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder
