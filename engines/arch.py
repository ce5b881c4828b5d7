"""Which models ringrl runs, and how: decided from the model's config before any process starts.

    path, name = engine_path(AutoConfig.from_pretrained(folder))  # ("fast", "Qwen3ForCausalLM")

- the fast path, engines/llama.py's `Llama`: Llama (3.x rope scaling included), Mistral, Qwen2, Qwen3;
- the fallback, engines/hf.py's `HFForward`: any other Hugging Face causal LM whose layers keep only keys and
  values, decoded through its own forward;
- refused in one line: a model that is not a causal LM, layers the fallback cannot cache (sliding windows
  shorter than a sequence, linear attention, recurrent state), and output heads the trainer's fused log-prob
  head does not compute (final-logit soft-capping, logit scaling).
"""
import copy

import torch

from engines.llama import SUPPORTED, Llama, unsupported


def architecture(config) -> str:
    """The class `AutoModelForCausalLM` builds for this config; ValueError when it builds none."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    name = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
    if name is None or getattr(config, "is_encoder_decoder", False):
        found = ", ".join(getattr(config, "architectures", None) or [config.model_type])
        raise ValueError(f"model.path is a {config.model_type} model ({found}), not a causal LM: ringrl "
                         "trains decoder-only models that AutoModelForCausalLM loads (Llama, Qwen, Mistral, "
                         "Gemma, Phi, ...)")
    return name


def engine_path(config, max_len: int | None = None) -> tuple[str, str]:
    """("fast" | "fallback", architecture) for the built-in engine; ValueError, one line, for a model ringrl
    cannot run. `max_len` (prompt + completion tokens), when known, is checked against sliding windows."""
    name = architecture(config)
    _check_head(name, config)
    if unsupported(name, config, max_len or 0) is None:
        return "fast", name
    kinds = set(getattr(config, "layer_types", None) or []) - {"full_attention"}
    if kinds:
        raise ValueError(f"{name} has {', '.join(sorted(kinds))} layers; the built-in engine runs "
                         f"full-attention layers only (fast path: {', '.join(SUPPORTED)}): "
                         "pick another model")
    window = getattr(config, "sliding_window", None)
    if window is not None and getattr(config, "use_sliding_window", True) and max_len and window < max_len:
        raise ValueError(f"{name} attends within a sliding window of {window} tokens < max_len={max_len}; "
                         f"lower rollout.max_new_tokens (or rollout.max_prompt_len) to fit {window}")
    return "fallback", name


def _check_head(name: str, config) -> None:
    """The trainer computes log-probs from the last hidden state and the output embeddings (weight and bias):
    refuse heads that do more."""
    cap = getattr(config, "final_logit_softcapping", None)
    if cap:
        raise ValueError(f"{name} soft-caps its logits (final_logit_softcapping={cap}), which the trainer's "
                         "log-prob head does not; pick a model without it")
    for key in ("logit_scale", "logits_scaling"):
        scale = getattr(config, key, None)
        if scale not in (None, 1, 1.0):
            raise ValueError(f"{name} scales its logits ({key}={scale}), which the trainer's log-prob head "
                             "does not; pick a model without it")


def forward_for(model, dtype: torch.dtype, max_len: int, device: torch.device, fallback: bool = False):
    """The engine's forward for `model`: the fast path where it applies (unless `fallback`: benchmarks and
    tests compare the two), else the fallback on a copy (the engine owns its weights; `model` may belong to a
    trainer)."""
    path, _ = engine_path(model.config, max_len)
    if path == "fast" and not fallback:
        return Llama(model, dtype, max_len, device)
    from engines.hf import HFForward

    return HFForward(copy.deepcopy(model), dtype, max_len, device)
