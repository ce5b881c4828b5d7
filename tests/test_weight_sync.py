"""Weights from FSDP2 trainer ranks to SGLang engines: FSDP names -> engine names, buckets and their bf16
round trip, and the bucket protocol between trainer rank 0 and the engines (threads and real queues here)."""
import multiprocessing
import threading
import time

import pytest
import torch
import torch.distributed as dist

from engines.buckets import (
    WeightChannel,
    engine_name,
    engine_weights,
    pack,
    plan_buckets,
    send_buckets,
    unpack,
    weight_specs,
)
from engines.sglang import SGLangEngine
from engines.weight_sync import GPUWeights, Publisher, receive_version
from launch.plan import free_port
from tests.gpu_fakes import FakeBackend, bytes_payloads, tiny_lm
from trainer.gpu_policy import shard_gpu
from trainer.policy import TokenLogprobs, shard

# ---- names ----

def test_engine_name_strips_wrappers():
    assert engine_name("lm.model.layers.0.mlp.up_proj.weight") == "model.layers.0.mlp.up_proj.weight"
    assert engine_name("_orig_mod.lm.model.norm.weight") == "model.norm.weight"
    assert engine_name("module.lm.lm_head.weight") == "lm_head.weight"
    assert (engine_name("lm.model.layers.3._fsdp_wrapped_module._checkpoint_wrapped_module."
                        "self_attn.q_proj.weight")
            == "model.layers.3.self_attn.q_proj.weight")
    assert engine_name("model.layers.0.mlp.down_proj.weight") == "model.layers.0.mlp.down_proj.weight"


@pytest.fixture
def gloo():
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{free_port()}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


@pytest.mark.parametrize("sharding", ["cpu", "gpu_checkpointed"])
@pytest.mark.parametrize("tied", [True, False])
def test_sharded_policy_maps_to_hf_names(gloo, sharding, tied):
    lm = tiny_lm(tied)
    reference = {k: v.clone() for k, v in lm.state_dict().items()}
    policy = shard(TokenLogprobs(lm)) if sharding == "cpu" \
        else shard_gpu(TokenLogprobs(lm), checkpointing=True)
    expected = sorted(k for k in reference if not (tied and k == "lm_head.weight"))
    assert sorted(n for n, _, _ in weight_specs(policy.state_dict().items(), tied, torch.bfloat16)) \
        == expected
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


@pytest.mark.parametrize("source", [torch.float32, torch.bfloat16])
def test_pack_writes_the_bytes_a_cast_and_copy_wrote(source):
    """pack casts as it copies into the bucket: the bytes of `tensor.to(bf16).contiguous()`, from a
    non-contiguous source too, at a slot that does not start the bucket."""
    torch.manual_seed(0)
    tensors = [torch.randn(3, 5).to(source), torch.randn(6, 4).to(source).t(),
               torch.randn(7).to(source) * 1e5]
    (slots,) = plan_buckets([(f"w{i}", t.shape, torch.bfloat16) for i, t in enumerate(tensors)], 1 << 20)
    flat = torch.zeros(slots[-1].end, dtype=torch.uint8)
    for slot, tensor in zip(slots, tensors):
        pack(slot, tensor, flat)
    before = torch.cat([t.to(torch.bfloat16).contiguous().view(-1).view(torch.uint8) for t in tensors])
    assert torch.equal(flat, before)


def test_send_buckets_round_trip_in_bf16():
    lm = tiny_lm(tied=False)
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
        assert received[name].dtype == torch.bfloat16 \
            and torch.equal(received[name], tensor.to(torch.bfloat16))
    with pytest.raises(RuntimeError, match="bucket plan"):
        send_buckets(reversed(named), buckets, "cpu", ship)
    calls = []
    send_buckets(named, buckets, None, lambda *a: calls.append(a))  # ranks > 0 gather but ship nothing
    assert calls == []


def test_publisher_ships_every_bucket_to_every_engine():
    """Trainer rank 0 and two engines (threads here, processes in a run) over the real queues."""
    lm = tiny_lm(tied=True)
    expected = {n: t.to(torch.bfloat16) for n, t in engine_weights(lm.state_dict().items(), tied=True)}
    channel = WeightChannel(2, multiprocessing.get_context("spawn"))
    path = GPUWeights(channel, [1, 2], bytes_payloads, "ipc", bucket_bytes=16384, dtype=torch.bfloat16)
    publisher = Publisher(path, lm.state_dict().items(), True, lead=True, device="cpu")
    engines = [SGLangEngine(FakeBackend(), max_batch=256) for _ in range(2)]

    def follow(e):
        deadline = time.time() + 60
        while engines[e].version < 1 and time.time() < deadline:
            receive_version(engines[e], channel, e)
            time.sleep(0.001)

    threads = [threading.Thread(target=follow, args=(e,)) for e in range(2)]
    phases = {}
    try:
        for t in threads:
            t.start()
        publisher.publish(lm.state_dict().items(), version=1, phases=phases)
    finally:
        for t in threads:
            t.join()
        channel.close()
    assert list(phases) == ["alloc", "gather", "pack", "hand-off", "acks"] and min(phases.values()) > 0
    for engine, tp in zip(engines, (1, 2)):
        loads = engine.backend.loaded
        assert len(loads) == len(publisher.buckets) > 1 and engine.version == 1
        assert [flush for _, _, flush in loads] == [False] * (len(loads) - 1) + [True]
        assert all(n == tp for _, n, _ in loads)  # one payload per TP rank
        got = {k: v for names, _, _ in loads for k, v in names.items()}
        assert list(got) == list(expected)
        assert all(torch.equal(got[k], expected[k]) for k in expected)
        engine.shutdown()


def test_publisher_stops_shipping_once_stop_is_set():
    """A run shutting down mid-publish: rank 0 still walks every weight (the other ranks' gathers must end)
    but sends nothing and waits for no engine."""
    from runtime.shared import StopFlag

    lm = tiny_lm(tied=False)
    channel, stop, walked = WeightChannel(1, multiprocessing.get_context("spawn")), StopFlag(), []
    stop.set()
    path = GPUWeights(channel, [1], bytes_payloads, "ipc", bucket_bytes=8192, dtype=torch.bfloat16)
    publisher = Publisher(path, lm.state_dict().items(), False, lead=True, device="cpu", stop=stop)
    publisher.publish(((n, walked.append(n) or t) for n, t in lm.state_dict().items()), version=1)
    assert walked == list(lm.state_dict()) and channel.receive(0) is None
    channel.close()


def test_sglang_refusals_stop_with_their_message():
    """SGLang answers its control calls with (success, message); begin/end_weight_update are checked too."""
    from engines.sglang import SGLangBackend, check_sglang

    check_sglang((True, "Success"), "begin_weight_update")
    check_sglang(None)  # calls that answer nothing
    with pytest.raises(RuntimeError,
                       match="SGLang refused end_weight_update: no weight-update session is open"):
        check_sglang((False, "no weight-update session is open"), "end_weight_update")
    with pytest.raises(RuntimeError, match="refused the weight update: bad"):
        check_sglang({"success": False, "message": "bad"})

    class Refusing:
        def begin_weight_update(self):
            return False, "a weight-update session is already open"

    backend = object.__new__(SGLangBackend)  # without starting SGLang
    backend.engine = Refusing()
    with pytest.raises(RuntimeError,
                       match="SGLang refused begin_weight_update: a weight-update session is already"):
        backend.begin_update()
