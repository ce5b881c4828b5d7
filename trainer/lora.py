"""LoRA training (`train.lora.rank > 0`): peft adapters on a frozen base, one copy of it.

    lm = add_adapters(hf_model, cfg.train.lora, torch.bfloat16)   # in place: target Linears get A and B
    with adapters_off(lm): ...                                     # the base alone: the reference policy
    merged(named_tensors, lm)                                      # (HF name, W + alpha/r B A) for engines,
                                                                     checkpoints

Only the adapters (fp32) have gradients and AdamW state; the base, held in `base_dtype`, is frozen. The rules
that need a reference policy get it free: the same model with its adapters switched off. The engines receive
merged weights, W + (alpha / r) B A computed in fp32, under the Hugging Face names, through the same weight
path as full fine-tuning; a checkpoint is the merged model (`from_pretrained` loads it) with the adapter in
peft's format beside it, in `adapter/`, which is what a resumed run reloads onto the base.
"""
import os
import re
import warnings
from contextlib import contextmanager
from typing import Iterable, Iterator

import torch
from torch import nn

ADAPTER_DIR = "adapter"
_ADAPTER = re.compile(r"(.+)\.lora_([AB])\.[^.]+\.weight")  # <module>.lora_A.<adapter name>.weight


def add_adapters(lm: nn.Module, cfg, base_dtype: torch.dtype, adapter_path: str = "") -> nn.Module:
    """`lm` with LoRA adapters in its target layers (in place), its base frozen in `base_dtype`; the adapters
    start from `adapter_path` (a checkpoint's adapter/ folder) when given, else as peft initialises them
    (B = 0)."""
    from peft import LoraConfig, get_peft_model

    targets = "all-linear" if list(cfg.target_modules) == ["all-linear"] else list(cfg.target_modules)
    config = LoraConfig(r=cfg.rank, lora_alpha=cfg.alpha, target_modules=targets, lora_dropout=0.0)
    try:
        # peft asks transformers 5 a deprecated question; nothing for the user
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing", category=FutureWarning)
            # adapters in fp32 (autocast_adapter_dtype)
            peft_model = get_peft_model(lm.to(base_dtype), config)
    except ValueError as e:
        raise ValueError(f"train.lora.target_modules={list(cfg.target_modules)}: "
                         f"{str(e).splitlines()[0]}") from None
    lm.ringrl_lora = config  # a plain attribute: merged() and checkpoints read the scale and save the config
    if adapter_path:
        _load_adapter(peft_model, adapter_path)
    return lm


def is_lora(lm: nn.Module) -> bool:
    return getattr(lm, "ringrl_lora", None) is not None


@contextmanager
def adapters_off(lm: nn.Module):
    """Inside: `lm` computes with its base weights alone (the reference policy of a LoRA run)."""
    from peft.tuners.tuners_utils import BaseTunerLayer

    layers = [m for m in lm.modules() if isinstance(m, BaseTunerLayer)]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield
    finally:
        for layer in layers:
            layer.enable_adapters(True)


def merged(named: Iterable[tuple[str, torch.Tensor]], lm: nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs of a LoRA model's state dict, in its order -> the merged model's, under Hugging
    Face names: each adapted weight W becomes W + (alpha / r) B A in fp32, its bias keeps its own name, the
    adapters themselves are not yielded. Streams: holds one layer's W until its A and B arrive. Pass-through
    without LoRA."""
    if not is_lora(lm):
        yield from named
        return
    config = lm.ringrl_lora
    scale = config.lora_alpha / config.r
    pending: dict[str, dict[str, torch.Tensor]] = {}
    for name, tensor in named:
        if ".base_layer." in name:
            module, _, leaf = name.partition(".base_layer.")
            if leaf == "weight":
                pending.setdefault(module, {})["W"] = tensor
            else:
                yield f"{module}.{leaf}", tensor
            continue
        match = _ADAPTER.fullmatch(name)
        if match is None:
            yield name, tensor
            continue
        module, which = match.groups()
        parts = pending.setdefault(module, {})
        parts[which] = tensor
        if len(parts) == 3:
            del pending[module]
            yield f"{module}.weight", parts["W"].float() + scale * (parts["B"].float() @ parts["A"].float())
    if pending:
        raise RuntimeError(f"LoRA weights without their adapters: {sorted(pending)[:3]}")


def save_adapter(folder: str, named: dict[str, torch.Tensor], lm: nn.Module) -> None:
    """Write the adapters among `named` (engine names, full tensors) in peft's format: `folder/adapter/` loads
    with `PeftModel.from_pretrained(base, folder/adapter)`."""
    from safetensors.torch import save_file

    out = os.path.join(folder, ADAPTER_DIR)
    os.makedirs(out, exist_ok=True)
    tensors = {}
    for name, tensor in named.items():
        match = _ADAPTER.fullmatch(name)
        if match:
            module, which = match.groups()
            tensors[f"base_model.model.{module}.lora_{which}.weight"] = tensor.contiguous()
    save_file(tensors, os.path.join(out, "adapter_model.safetensors"))
    lm.ringrl_lora.save_pretrained(out)


def _load_adapter(peft_model, folder: str) -> None:
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    path = os.path.join(folder, "adapter_model.safetensors")
    if not os.path.exists(path):
        raise ValueError(f"resume: {path} is missing; a LoRA run resumes from a checkpoint of a LoRA run")
    result = set_peft_model_state_dict(peft_model, load_file(path))
    missing = [k for k in result.missing_keys if "lora_" in k]
    if missing:
        raise ValueError(f"resume: the adapter in {folder} lacks {missing[0]}; was it saved with other "
                         "train.lora settings?")


class Adapters:
    """What a trainer rank's Placement.load applies to the model it loads: train.lora, the base's dtype, and
    the adapter folder a resumed run starts from ("" for new adapters)."""

    def __init__(self, config, base_dtype: torch.dtype, path: str = ""):
        self.config, self.base_dtype, self.path = config, base_dtype, path

    def apply(self, lm: nn.Module) -> nn.Module:
        return add_adapters(lm, self.config, self.base_dtype, self.path)


class BasePolicy:
    """The reference policy of a LoRA run: the policy itself, with its adapters off (no second copy)."""

    def __init__(self, policy: nn.Module):
        self.policy = policy

    def __call__(self, *inputs):
        with adapters_off(self.policy.lm):
            return self.policy(*inputs)
