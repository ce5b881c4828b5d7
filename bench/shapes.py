"""Models of real architectures with random weights, built from their config values: no weights to download.

    path = random_model("qwen2.5-0.5b", tokenizer_dir, out_dir)   # a Hugging Face folder, loadable anywhere

Used by the GPU benchmarks and scripts/gpu_check.py. The values are those of the models' own config.json; the
vocabulary keeps its full size (151,936 for Qwen2.5), which dominates the lm_head's cost. `tiny` is a few-MB
Llama for the CPU dry run. The tokenizer is another model's (SmolLM2's, a few MB that can travel); its ids all
fall inside these vocabularies, and its end-of-sequence id becomes the model's.
"""
import os

SHAPES = {
    "qwen2.5-0.5b": dict(architecture="Qwen2ForCausalLM", hidden_size=896, intermediate_size=4864,
                         num_hidden_layers=24, num_attention_heads=14, num_key_value_heads=2,
                         vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0,
                         rms_norm_eps=1e-6, tie_word_embeddings=True),
    "qwen2.5-1.5b": dict(architecture="Qwen2ForCausalLM", hidden_size=1536, intermediate_size=8960,
                         num_hidden_layers=28, num_attention_heads=12, num_key_value_heads=2,
                         vocab_size=151936, max_position_embeddings=32768, rope_theta=1000000.0,
                         rms_norm_eps=1e-6, tie_word_embeddings=True),
    "tiny": dict(architecture="LlamaForCausalLM", hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                 num_attention_heads=4, num_key_value_heads=2, vocab_size=49152, max_position_embeddings=1024,
                 rope_theta=100000.0, rms_norm_eps=1e-5, tie_word_embeddings=True),
}


def add_model_arguments(parser) -> None:
    """The options every GPU benchmark takes: which shape, where, the tokenizer, the model cache, a JSON
    copy."""
    import torch

    parser.add_argument("--model", choices=sorted(SHAPES), default="qwen2.5-0.5b")
    parser.add_argument("--device", choices=("cuda", "cpu"),
                        default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument("--tokenizer", required=True, help="a Hugging Face tokenizer folder")
    parser.add_argument("--out", default="bench_out/models", help="where the random model folders are cached")
    parser.add_argument("--json", help="also write the figures to this file as one JSON object")


def config(name: str, eos_token_id: int = 2):
    """The transformers config of shape `name`."""
    import transformers

    values = dict(SHAPES[name])
    architecture = values.pop("architecture")
    kind = getattr(transformers, architecture.replace("ForCausalLM", "Config"))
    return kind(**values, bos_token_id=eos_token_id, eos_token_id=eos_token_id, pad_token_id=eos_token_id,
                architectures=[architecture])


def random_model(name: str, tokenizer_dir: str, out_dir: str, seed: int = 0) -> str:
    """A folder with shape `name`'s model, randomly initialised (bf16 on disk), and the tokenizer of
    `tokenizer_dir`. Reused if it is already there."""
    import torch
    import transformers
    from transformers import AutoTokenizer

    path = os.path.join(out_dir, name)
    if os.path.exists(os.path.join(path, "config.json")):
        return path
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    cfg = config(name, tokenizer.eos_token_id)
    torch.manual_seed(seed)
    model = getattr(transformers, cfg.architectures[0])(cfg).to(torch.bfloat16)
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


def parameters(name: str) -> int:
    """Parameter count of shape `name` (tied embeddings counted once), without building it."""
    import torch
    import transformers

    cfg = config(name)
    with torch.device("meta"):
        model = getattr(transformers, cfg.architectures[0])(cfg)
    return sum(p.numel() for p in model.parameters())
