"""Where the GPU plan puts things: layouts for 1, 2, 4 and 8 GPUs, the device plan, the GPU plan's
placements and its one-line refusals."""

import pytest
import torch

from launch.layout import auto_plan, plan_layout
from runtime.schema import RolloutConfig
from tests.gpu_fakes import tiny_lm

# ---- layout ----

@pytest.mark.parametrize("gpus, gen, train", [(1, (0,), (0,)), (2, (0,), (1,)), (4, (0, 1), (2, 3)),
                                              (8, (0, 1, 2, 3), (4, 5, 6, 7))])
def test_default_layouts(gpus, gen, train):
    layout = plan_layout(gpus)
    assert [g for group in layout.gen_groups for g in group] == list(gen)
    assert layout.train_gpus == train and layout.tp_size == 1
    assert layout.time_shared == (gpus == 1) and layout.colocated() == (gpus == 1)
    assert layout.mem_fraction_static == (0.35 if gpus == 1 else 0.85)
    assert "engine" in layout.describe()


def test_requested_splits_and_tensor_parallel():
    six = plan_layout(8, gen_gpus=6)
    assert six.num_engines == 6 and six.train_gpus == (6, 7)
    tp2 = plan_layout(8, gen_gpus=4, tp_size=2)
    assert tp2.gen_groups == ((0, 1), (2, 3)) and tp2.train_gpus == (4, 5, 6, 7)
    assert [tp2.base_gpu_id(e) for e in range(2)] == [0, 2]
    assert plan_layout(8, train_gpus=2).num_engines == 6
    assert plan_layout(4, gen_gpus=2, train_gpus=1).train_gpus == (2,)  # a GPU may be left idle
    assert plan_layout(8, tp_size=4).gen_groups == ((0, 1, 2, 3),)
    assert plan_layout(2, mem_fraction=0.5).mem_fraction_static == 0.5


def test_auto_tensor_parallel_from_model_size():
    gib = 2**30
    assert plan_layout(8, model_bytes=3 * gib, gpu_bytes=80 * gib).tp_size == 1
    big = plan_layout(8, model_bytes=40 * gib, gpu_bytes=80 * gib, train_gpus=6)  # a 20B model in bf16
    assert big.tp_size == 2 and big.gen_groups == ((0, 1),)
    with pytest.raises(ValueError, match="does not fit a generation engine"):
        plan_layout(2, model_bytes=140 * gib, gpu_bytes=80 * gib)


@pytest.mark.parametrize("kwargs, message", [
    (dict(num_gpus=0), "no CUDA GPU"),
    (dict(num_gpus=8, gen_gpus=6, train_gpus=4), "do not fit in the 8"),
    (dict(num_gpus=8, gen_gpus=8), "do not fit in the 8"),
    (dict(num_gpus=8, gen_gpus=3, tp_size=2), "does not divide the 3 generation GPUs"),
    (dict(num_gpus=8, tp_size=3, num_kv_heads=8), "does not divide the model's 8 KV heads"),
    (dict(num_gpus=1, tp_size=2), "one GPU visible"),
    (dict(num_gpus=1, gen_gpus=2), "one GPU visible"),
    (dict(num_gpus=2, mem_fraction=1.5), "mem_fraction_static"),
    # 7B on one trainer GPU
    (dict(num_gpus=2, model_bytes=14 * 2**30, gpu_bytes=80 * 2**30), "training state"),
])
def test_impossible_layouts_say_why_in_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        plan_layout(**kwargs)
    assert "\n" not in str(info.value)


def test_auto_plan():
    assert auto_plan(0) == "cpu" and auto_plan(1) == auto_plan(8) == "gpu"


def test_device_plan():
    from launch.plan import device_plan

    assert device_plan("auto", 0) == "cpu" and device_plan("cpu", 8) == "cpu"
    assert device_plan("auto", 8) == device_plan("gpu", 1) == "gpu"  # with or without SGLang
    with pytest.raises(ValueError, match="torch sees none; use cluster=cpu"):
        device_plan("gpu", 0)


def test_engine_kind_takes_sglang_only_on_the_gpu_plan_where_installed(monkeypatch):
    from launch import plan

    assert plan.engine_kind("auto", "cpu") == ("builtin", None)
    assert plan.engine_kind("builtin", "gpu") == ("builtin", None)
    with pytest.raises(ValueError, match="rollout.engine=sglang needs the GPU plan"):
        plan.engine_kind("sglang", "cpu")
    monkeypatch.setattr(plan.importlib.util, "find_spec", lambda name: None)  # no sglang here
    kind, notice = plan.engine_kind("auto", "gpu")
    assert kind == "builtin" and notice.startswith("notice: sglang is not installed") and "\n" not in notice
    with pytest.raises(ValueError, match=r"sglang is not installed; pip install -r requirements-gpu.txt"):
        plan.engine_kind("sglang", "gpu")
    monkeypatch.setattr(plan.importlib.util, "find_spec", lambda name: object())  # sglang installed
    assert plan.engine_kind("auto", "gpu") == ("sglang", None)


def _meta_lm():
    with torch.device("meta"):
        return tiny_lm()


def test_gpu_plan_places_engines_and_ranks():
    from engines.sglang import SGLangSpec
    from launch.gpu import gpu_plan
    from runtime.schema import ClusterConfig

    plan = gpu_plan(ClusterConfig(plan="gpu", gen_gpus=4, tp_size=2, bucket_mb=64,
                                  activation_checkpointing=True),
                    RolloutConfig(dtype="bfloat16"), minibatch_groups=8, meta_model=_meta_lm(), num_gpus=8,
                    gpu_bytes=80 << 30, engine="sglang")
    assert (plan.rollout_workers, plan.trainer_ranks) == (2, 4)
    engines = [plan.engine(w, max_batch=32, max_len=64, dtype="bfloat16") for w in range(2)]
    assert [(e.base_gpu_id, e.tp_size, e.mem_fraction_static) for e in engines] \
        == [(0, 2, 0.85), (2, 2, 0.85)]
    assert [(p.gpu, p.checkpointing) for p in map(plan.placement, range(4))] \
        == [(g, True) for g in (4, 5, 6, 7)]
    weights = plan.weights(_meta_lm())
    assert weights.tp_sizes == [2, 2] and weights.bucket_bytes == 64 << 20 and not weights.engines_ready()
    # as SGLang takes it
    assert weights.payloads is SGLangSpec.bucket_payloads and weights.dtype == torch.bfloat16
    weights.channel.close()


def test_gpu_plan_with_the_built_in_engine():
    """Without SGLang: a built-in engine on each generation GPU, weights in its dtype; on one GPU the engine
    and the trainer rank each get a capped share of it."""
    from engines.builtin import BuiltinEngineSpec
    from launch.gpu import SHARED_GPU_HEADROOM, gpu_plan
    from runtime.schema import ClusterConfig

    plan = gpu_plan(ClusterConfig(plan="gpu"), RolloutConfig(dtype="float32"), 8, _meta_lm(), num_gpus=4,
                    gpu_bytes=80 << 30, engine="builtin")
    specs = [plan.engine(w, max_batch=32, max_len=64, dtype="float32") for w in range(plan.rollout_workers)]
    # the static decode step, as CUDA graphs unless rollout.cuda_graphs=false
    assert specs == [BuiltinEngineSpec(32, 64, "float32", f"cuda:{g}", static=True, cuda_graphs=True)
                     for g in (0, 1)]
    eager = gpu_plan(ClusterConfig(plan="gpu"), RolloutConfig(dtype="float32", cuda_graphs=False), 8,
                     _meta_lm(), num_gpus=4, gpu_bytes=80 << 30, engine="builtin")
    assert not eager.engine(0, max_batch=32, max_len=64, dtype="float32").cuda_graphs
    weights = plan.weights(_meta_lm())
    assert weights.payloads is BuiltinEngineSpec.bucket_payloads and weights.dtype == torch.float32
    weights.channel.close()
    assert [p.memory_fraction for p in map(plan.placement, range(2))] == [0.0, 0.0]  # GPUs of their own

    shared = gpu_plan(ClusterConfig(plan="gpu"), RolloutConfig(dtype="bfloat16"), 8, _meta_lm(), num_gpus=1,
                      gpu_bytes=80 << 30, engine="builtin")
    engine, rank = shared.engine(0, 32, 64, "bfloat16"), shared.placement(0)
    assert engine.device == "cuda:0" and engine.memory_fraction == shared.layout.mem_fraction_static == 0.35
    assert rank.gpu == 0 and rank.memory_fraction == pytest.approx(1 - 0.35 - SHARED_GPU_HEADROOM)


@pytest.mark.parametrize("num_gpus, cluster, batch_groups, message", [
    (8, dict(gen_gpus=6, train_gpus=4), 8, "do not fit in the 8"),
    (8, dict(tp_size=3), 8, "does not divide the model's 2 KV heads"),
    (8, dict(gen_gpus=5), 8,
     r"'train.batch_groups' \(per minibatch, if train.minibatches > 1\) must be divisible "
     "by the layout's 3 trainer ranks"),
    (1, dict(gen_gpus=1, train_gpus=1, weight_sync="nccl"), 8, "use cluster.weight_sync=ipc on one GPU"),
    (8, dict(tp_size=2, engine="builtin"), 8,
     "the builtin engine runs on one GPU; use rollout.engine=sglang"),
    (8, dict(weight_sync="nccl", engine="builtin"), 8,
     "cluster.weight_sync=nccl needs rollout.engine=sglang"),
])
def test_gpu_plan_refuses_in_one_line(num_gpus, cluster, batch_groups, message):
    from launch.gpu import gpu_plan
    from runtime.schema import ClusterConfig

    engine = cluster.pop("engine", "sglang")
    with pytest.raises(ValueError, match=message) as info:
        gpu_plan(ClusterConfig(plan="gpu", **cluster), RolloutConfig(), batch_groups, _meta_lm(), num_gpus,
                 gpu_bytes=80 << 30, engine=engine)
    assert "\n" not in str(info.value)


@pytest.mark.parametrize("capability, native", [("AVX512", True), ("AVX2", False), ("DEFAULT", False)])
def test_auto_precision_is_bf16_only_where_the_device_computes_it_natively(monkeypatch, capability, native):
    from launch import plan

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: capability)
    assert plan.native_bf16("cpu") is native and plan.native_bf16("gpu")
    dtype, autocast, notice = plan.resolve_precision("auto", "auto", "cpu")
    assert (dtype, autocast) == (("bfloat16", "bfloat16") if native else ("float32", "none"))
    assert (notice is None) is native and (native or "\n" not in notice)
    # asked for
    assert plan.resolve_precision("bfloat16", "bfloat16", "cpu") == ("bfloat16", "bfloat16", None)
    assert plan.resolve_precision("float32", "none", "gpu") == ("float32", "none", None)
    assert plan.resolve_precision("auto", "auto", "gpu")[:2] == ("bfloat16", "bfloat16")
