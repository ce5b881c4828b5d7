"""scripts/sglang_calls.py against a small fake sglang written in tmp_path (the real paths, a few lines each):
ringrl's own calls, collected from engines/, all match it; a lost keyword, a moved parameter or a dropped
ServerArgs field fails naming it; a call the script cannot follow, or a table entry nothing uses, fails too.
No network."""
import os
import shutil
import textwrap

import pytest

from scripts import sglang_calls
from scripts.sglang_calls import check_all, find_source, main
from tests.helpers import ROOT

FAKE = {
    "__init__.py": """
        from sglang.utils import LazyImport
        Engine = LazyImport("sglang.srt.entrypoints.engine", "Engine")
        """,
    "_version.py": "__version__ = version = '0.5.21'\n",
    "srt/entrypoints/engine.py": """
        from sglang.srt.server_args import ServerArgs

        class EngineBase:
            def shutdown(self):
                pass

        class Engine(EngineBase):
            server_args_class = ServerArgs

            def __init__(self, **kwargs):
                self.tokenizer_manager = self.loop = None

            async def async_generate(self, prompt=None, sampling_params=None, input_ids=None, return_logprob=False):
                pass

            def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
                pass

            def init_weights_update_group(self, master_address, master_port, rank_offset, world_size, group_name,
                                          backend="nccl"):
                pass

            def update_weights_from_distributed(self, names, dtypes, shapes, group_name="g", flush_cache=True,
                                                load_format=None):
                pass

            def begin_weight_update(self, selector="all"):
                pass

            def end_weight_update(self):
                pass
        """,  # noqa: E501
    "srt/server_args.py": """
        from sglang.srt.arg_groups.parallel import Parallel

        class Model(msgspec.Struct):
            model_path: str
            dtype: str = "auto"
            skip_tokenizer_init: bool = False
            random_seed: int = None
            log_level: str = "info"

        class ServerArgs:
            pass

        _INPUT_NAMESPACES = [Model, Parallel]
        ServerArgs.__annotations__ = collect(_INPUT_NAMESPACES)
        """,
    "srt/arg_groups/parallel.py": """
        class Parallel(msgspec.Struct):
            tp_size: int = 1
            base_gpu_id: int = 0
            mem_fraction_static: float = None
        """,
    "srt/managers/tokenizer_manager.py": """
        class TokenizerManager:
            def __init__(self):
                self.server_args = None

            async def pause_generation(self, obj):
                pass

            async def continue_generation(self, obj):
                pass
        """,
    "srt/managers/io_struct.py": """
        class BaseReq(msgspec.Struct, kw_only=True):
            rid: str = None

        class PauseGenerationReqInput(BaseReq, kw_only=True):
            mode: str = "abort"

        class ContinueGenerationReqInput(BaseReq, kw_only=True):
            torch_empty_cache: bool = True
        """,
    "srt/weight_sync/tensor_bucket.py": """
        @dataclass
        class FlattenedTensorMetadata:
            name: str
            shape: torch.Size
            dtype: torch.dtype
            start_idx: int
            end_idx: int
            numel: int
        """,
    "srt/utils/__init__.py": "from sglang.srt.utils.common import *\n",
    "srt/utils/common.py": """
        def init_custom_process_group(backend=None, init_method=None, world_size=-1, rank=-1, group_name=None):
            pass

        class MultiprocessingSerializer:
            @staticmethod
            def serialize(obj, output_str=False):
                pass

        class SafeUnpickler(pickle.Unpickler):
            ALLOWED_GLOBALS = {
                ("builtins", "dict"),
                ("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"),
            }
        """,  # noqa: E501
    "srt/utils/patch_torch.py": "def monkey_patch_torch_reductions():\n    pass\n",
    "srt/sampling/sampling_params.py": """
        class SamplingParams(msgspec.Struct, kw_only=True):
            max_new_tokens: int = 128
            stop_token_ids: list = None
            stop: list = None
            temperature: float = 1.0
            top_p: float = 1.0
            skip_special_tokens: bool = True
            no_stop_trim: bool = False
        """,
}


@pytest.fixture
def fake(tmp_path):
    for rel, text in FAKE.items():
        path = tmp_path / "site" / "sglang" / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(textwrap.dedent(text).lstrip())
    return tmp_path / "site" / "sglang"


def _edit(fake, rel, old, new):
    path = fake / rel
    assert old in path.read_text()
    path.write_text(path.read_text().replace(old, new))


def test_ringrl_calls_are_collected_from_its_source_and_all_match(fake, capsys):
    assert main(["--source", str(fake.parent)]) == 0
    out = capsys.readouterr().out
    n = len(out.splitlines()) - 2
    assert f"sglang 0.5.21: {n} calls, {n} ok" in out and n > 20
    for call in ("sglang.Engine(model_path=",
                 "sglang.Engine.update_weights_from_tensor(named_tensors, load_format=",
                 "TokenizerManager.pause_generation(obj)", "PauseGenerationReqInput(mode=)",
                 "FlattenedTensorMetadata(name, shape, dtype, start_idx, end_idx, numel)", "pickled by",
                 "SamplingParams(**sampling_params():",
                 "sglang.srt.utils.init_custom_process_group(backend="):
        assert call in out


@pytest.mark.parametrize("rel, old, new, named", [
    ("srt/entrypoints/engine.py", "load_format=None, flush_cache=True):", "load_format=None):",
     "no parameter flush_cache"),
    ("srt/entrypoints/engine.py", "master_address, master_port,", "master_port, master_address,",
     "its first parameters are (master_port, master_address"),
    ("srt/arg_groups/parallel.py", "    tp_size: int = 1\n", "", "no parameter tp_size"),
    ("srt/utils/common.py", '("sglang.srt.weight_sync.tensor_bucket", "FlattenedTensorMetadata"),', "",
     "SafeUnpickler does not admit it"),
])
def test_a_changed_signature_fails_naming_what_changed(fake, capsys, rel, old, new, named):
    _edit(fake, rel, old, new)
    assert main(["--source", str(fake)]) == 1
    bad = [line for line in capsys.readouterr().out.splitlines() if line.startswith("MISSING")]
    assert len(bad) == 1 and named in bad[0]


def _ringrl(tmp_path, probe: str = "") -> str:
    """A copy of ringrl's sglang files, and a class that uses sglang in a way the script cannot follow."""
    root = tmp_path / "ringrl"
    (root / "engines").mkdir(parents=True)
    for name in ("sglang.py", "weight_sync.py"):
        shutil.copy(os.path.join(ROOT, "engines", name), root / "engines" / name)
    if probe:
        (root / "engines" / "probe.py").write_text(textwrap.dedent(f"""
            class Probe:
                def __init__(self):
                    import sglang
                    self.engine = sglang.Engine(model_path="m")

                def probe(self):
                    {probe}
            """))
    return str(root)


@pytest.mark.parametrize("probe, named", [
    ("return self.engine.tokenizer_manager.server_args.port", "whose class ATTRIBUTES does not give"),
    ("return self.engine", "ringrl returns an sglang object"),
    ("print(self.engine)", "ringrl passes an sglang object to print"),
    ("self.engine.begin_weight_update('all')", "say in POSITIONAL"),
])
def test_a_call_the_script_cannot_follow_fails(fake, tmp_path, probe, named):
    assert all(ok for ok, _ in check_all(str(fake), _ringrl(tmp_path)))
    lines = check_all(str(fake), _ringrl(tmp_path / "probed", probe))
    bad = [line for ok, line in lines if not ok]
    assert len(bad) == 1 and bad[0].startswith("UNCHECKED") and named in bad[0] \
        and "engines/probe.py:8" in bad[0]


def test_a_table_entry_nothing_uses_fails(fake, tmp_path):
    (tmp_path / "engines").mkdir()
    bad = [line for ok, line in check_all(str(fake), str(tmp_path)) if not ok]
    assert any("ATTRIBUTES['sglang.Engine.loop']: nothing in ringrl uses it" in line for line in bad)
    assert any("DICTS names engines/sglang.py:sampling_params, which is gone" in line for line in bad)


def test_no_source_is_a_one_line_error(tmp_path, monkeypatch, capsys):
    assert main(["--source", str(tmp_path)]) == 2
    assert len(capsys.readouterr().err.strip().splitlines()) == 1

    class Failed:
        returncode, stderr = 1, ("Looking in indexes\n"
                                 "ERROR: No matching distribution found for sglang==0.5.21\n")

    monkeypatch.setattr(sglang_calls.importlib.util, "find_spec", lambda name: None)
    monkeypatch.setattr(sglang_calls.subprocess, "run", lambda *a, **k: Failed)
    with pytest.raises(sglang_calls.SourceError, match="No matching distribution found for sglang==0.5.21"):
        find_source(None, None, cache=str(tmp_path / "cache"))
    assert os.listdir(tmp_path / "cache") == []  # a failed download leaves nothing in the cache
