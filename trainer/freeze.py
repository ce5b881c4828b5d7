"""Partial fine-tuning (`train.freeze_embeddings`, `train.freeze_layers`): which weights train, and the model
FLOPs a trained token costs when some do not."""
from torch import nn

from trainer.policy import decoder_layers


def freeze(lm: nn.Module, layers: int, embeddings: bool) -> None:
    """Partial fine-tuning, in place: the first `layers` decoder layers, and with `embeddings` the input
    embeddings (so an output head tied to them), get no gradient. Below the lowest trained weight autograd
    records nothing, so the backward stops there."""
    stack = decoder_layers(lm)
    check_freeze_layers(layers, len(stack))
    for layer in stack[:layers]:
        layer.requires_grad_(False)
    if embeddings:
        lm.get_input_embeddings().requires_grad_(False)


def check_freeze_layers(layers: int, count: int) -> None:
    """train.freeze_layers against the model's `count` decoder layers (the launcher checks before any
    process)."""
    if layers > count:
        raise ValueError(f"train.freeze_layers={layers}: the model has {count} decoder layers; "
                         f"freeze at most {count}")


def train_flops_per_token(lm: nn.Module) -> int:
    """A trained token's model FLOPs: 2 x parameters in the forward; in the backward, 2 x the parameters it
    passes through (the inputs' gradients, down to the lowest layer with a trained weight) and 2 x the trained
    ones (their own gradients). 6 x parameters when every weight trains; less under freeze_layers or LoRA."""
    params = sum(p.numel() for p in lm.parameters())
    trained = sum(p.numel() for p in lm.parameters() if p.requires_grad)
    below = 0
    for layer in decoder_layers(lm):
        if any(p.requires_grad for p in layer.parameters()):
            break
        below += sum(p.numel() for p in layer.parameters())
    return 2 * params + 2 * (params - below) + 2 * trained
