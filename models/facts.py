"""What the launcher needs to know about a model before any process starts, read from its folder without
loading its weights: its checked config, its end-of-sequence tokens, its parameter names and shapes.

    config = checked_config(path)   # a causal LM the engine and the trainer run, or a one-line ValueError
    stop_ids(path)                  # every token id that ends a completion
    meta_model(path)                # the model on the meta device: names and shapes, no memory
"""


def checked_config(model_path: str):
    """The model's config, checked: a causal LM that ringrl's engine and trainer run (engines/arch.py)."""
    from transformers import AutoConfig

    from engines.arch import engine_path

    config = AutoConfig.from_pretrained(model_path)
    engine_path(config)
    return config


def stop_ids(model_path: str) -> tuple:
    """Every end-of-sequence token the model may emit: its config's, its generation_config.json's (Qwen3 ends
    a turn with <|im_end|> there) and its tokenizer's."""
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    eos = [AutoConfig.from_pretrained(model_path).eos_token_id,
           AutoTokenizer.from_pretrained(model_path).eos_token_id]
    try:
        eos.append(GenerationConfig.from_pretrained(model_path).eos_token_id)
    except OSError:  # no generation_config.json
        pass
    ids = [i for e in eos for i in (e if isinstance(e, list) else [e])]
    return tuple(sorted({i for i in ids if i is not None}))


def meta_model(model_path: str):
    """The model's parameter names and shapes without loading its weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))
