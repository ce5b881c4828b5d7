"""The names ringrl's GPU path calls in SGLang, checked against the installed sglang's source (not imported:
sglang's imports want CUDA). Skipped where sglang is not installed, as in CI; where it is, a version that
moved one of these names fails here, with the name, before any GPU job does.

    pytest tests/test_sglang_contract.py          # after pip install -r requirements-gpu.txt
"""
import ast
import importlib.util
import os

import pytest

spec = importlib.util.find_spec("sglang")
pytestmark = pytest.mark.skipif(spec is None, reason="sglang is not installed (requirements-gpu.txt)")
ROOT = os.path.dirname(spec.origin) if spec is not None else ""


def _tree(path):
    with open(os.path.join(ROOT, *path.split("/"))) as f:
        return ast.parse(f.read())


def _class(path, name):
    found = [n for n in ast.walk(_tree(path)) if isinstance(n, ast.ClassDef) and n.name == name]
    assert found, f"sglang/{path} has no class {name}"
    return found[0]


def _params(path, cls, method):
    node = _class(path, cls)
    found = [n for n in node.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef)) and n.name == method]
    assert found, f"sglang/{path}: {cls} has no method {method}"
    args = found[0].args
    return [a.arg for a in args.posonlyargs + args.args + args.kwonlyargs]


def _fields(node):
    return [n.target.id for n in node.body if isinstance(n, ast.AnnAssign) and isinstance(n.target, ast.Name)]


def _in_order(wanted, have):
    """`wanted` appear in `have` in this order (positional calls depend on it)."""
    positions = [have.index(w) for w in wanted if w in have]
    return len(positions) == len(wanted) and positions == sorted(positions)


def test_engine_methods_take_the_arguments_ringrl_passes():
    engine = "srt/entrypoints/engine.py"
    assert {"input_ids", "sampling_params", "return_logprob"} <= set(_params(engine, "Engine", "async_generate"))
    assert {"load_format", "flush_cache"} <= set(_params(engine, "Engine", "update_weights_from_tensor"))
    # engines/sglang.py SGLangBackend.join_nccl passes these positionally
    assert _in_order(["master_address", "master_port", "rank_offset", "world_size", "group_name", "backend"],
                     _params(engine, "Engine", "init_weights_update_group"))
    assert _in_order(["names", "dtypes", "shapes"], _params(engine, "Engine", "update_weights_from_distributed"))
    assert {"group_name", "flush_cache", "load_format"} <= set(
        _params(engine, "Engine", "update_weights_from_distributed"))
    for method in ("begin_weight_update", "end_weight_update", "shutdown"):
        _params(engine, "Engine", method)


def test_pause_and_continue_are_on_the_tokenizer_manager():
    manager = "srt/managers/tokenizer_manager.py"
    assert "obj" in _params(manager, "TokenizerManager", "pause_generation")
    assert "obj" in _params(manager, "TokenizerManager", "continue_generation")
    assert "mode" in _fields(_class("srt/managers/io_struct.py", "PauseGenerationReqInput"))
    _class("srt/managers/io_struct.py", "ContinueGenerationReqInput")


def test_bucket_metadata_fields_and_the_unpickler_admits_them():
    # ipc_payloads builds FlattenedTensorMetadata positionally
    assert _fields(_class("srt/weight_sync/tensor_bucket.py", "FlattenedTensorMetadata")) == [
        "name", "shape", "dtype", "start_idx", "end_idx", "numel"]
    source = open(os.path.join(ROOT, "srt", "utils", "common.py")).read()
    assert '"sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"' in source
    _class("srt/utils/common.py", "MultiprocessingSerializer")
    group = [n for n in ast.walk(_tree("srt/utils/common.py"))
             if isinstance(n, ast.FunctionDef) and n.name == "init_custom_process_group"]
    assert group and {"backend", "init_method", "world_size", "rank", "group_name"} <= {
        a.arg for a in group[0].args.args + group[0].args.kwonlyargs}
    patch = _tree("srt/utils/patch_torch.py")
    assert any(isinstance(n, ast.FunctionDef) and n.name == "monkey_patch_torch_reductions" for n in patch.body)


def test_server_args_and_sampling_params_have_the_names_ringrl_sets():
    fields = set()
    for folder, _, files in os.walk(ROOT):  # ServerArgs' fields moved into arg_groups/ in 0.5.2x
        for name in files:
            if name.endswith(".py") and ("server_args" in name or "arg_groups" in folder):
                for node in ast.walk(_tree(os.path.relpath(os.path.join(folder, name), ROOT))):
                    if isinstance(node, ast.ClassDef):
                        fields.update(_fields(node))
    wanted = {"model_path", "tp_size", "base_gpu_id", "mem_fraction_static", "random_seed", "dtype",
              "skip_tokenizer_init", "log_level"}  # engines/sglang.py SGLangBackend
    assert wanted <= fields, wanted - fields
    node = _class("srt/sampling/sampling_params.py", "SamplingParams")  # a dataclass, or a class with __init__
    sampling = _fields(node) + [a.arg for n in node.body if isinstance(n, ast.FunctionDef) and n.name == "__init__"
                                for a in n.args.args + n.args.kwonlyargs]
    wanted = {"temperature", "top_p", "max_new_tokens", "stop_token_ids", "skip_special_tokens", "no_stop_trim"}
    assert wanted <= set(sampling), wanted - set(sampling)  # engines/sglang.py sampling_params
