"""FSDP2 over gloo: one optimizer step on two ranks gives the weights one rank gives; a compiled model gives
the weights the eager one gives; the full weights come in a few all-gathers, bit for bit what full_tensor()
gives."""
import contextlib
import socket
from unittest import mock

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed.tensor import DTensor

import algos
from engines.buckets import engine_name
from launch.supervisor import fast_exit
from runtime.schema import RolloutConfig, TrainConfig
from tests.test_tied_groups import MIXED
from tests.test_tied_groups import _groups as tied_groups
from tests.test_trainer import _groups
from trainer.batch import pack
from trainer.learner import Learner, Rank
from trainer.lora import merged
from trainer.policy import TokenLogprobs, full_state, shard


def _learner(model_dir, rank, world, port, algo="grpo", compile=False, skip_tied=True):
    train = TrainConfig(batch_groups=2, micro_groups=1, lr=1e-3, grad_clip=100.0, autocast="none",
                        compile=compile, skip_tied_groups=skip_tied)
    return Learner(rank=Rank(rank, world, port), model_path=model_dir, train=train,
                   algo=algos.get(algo).Config(),
                   rollout=RolloutConfig(group_size=3, max_new_tokens=6, temperature=1.0))


def _one_step(rank, world, port, model_dir, out, algo="grpo", compile=False, rewards=None, skip_tied=True):
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        learner = _learner(model_dir, rank, world, port, algo, compile, skip_tied)
        batch = pack(_groups() if rewards is None else tied_groups(rewards))
        batch.behav_logprobs -= 0.1  # off-policy data, so the clip and ratio matter
        metrics = learner.step(batch, 1)
        state = {name: t.detach().clone() for name, t in full_state(learner.policy)}
        if rank == 0:
            # compiled by dynamo in this process
            graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
            torch.save({"state": state, "loss": metrics["loss"], "graphs": graphs,
                        "tied": metrics["train/tied_groups_skipped"]}, out)
    finally:
        dist.destroy_process_group()


def _spawn(fn, args, nprocs):
    mp.spawn(_then_fast_exit, args=(fn, *args), nprocs=nprocs)


def _then_fast_exit(rank, fn, *args):
    """Each rank ends as the trainer's processes end (`fast_exit`, launch/supervisor.py): without the
    interpreter's teardown, in which a gloo group DTensor's caches still hold aborted the process now and then
    ("terminate called without an active exception", about 1 run in 10 of `_gathers`)."""
    fn(rank, *args)
    fast_exit(0)


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_match_one_rank(tiny_model_dir, tmp_path):
    """Two of MIXED's four groups tie: one rank trains on all four (train.skip_tied_groups=false), two ranks
    leave the ties out and take one group each, and the step is the same."""
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    _spawn(_one_step, (1, _port(), tiny_model_dir, str(one), "ppo", False, MIXED, False), nprocs=1)
    _spawn(_one_step, (2, _port(), tiny_model_dir, str(two), "ppo", False, MIXED, True), nprocs=2)
    a, b = torch.load(one), torch.load(two)
    assert (a["tied"], b["tied"]) == (0, 2)
    assert b["loss"] == pytest.approx(a["loss"], rel=1e-4, abs=1e-7)
    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    moved = 0
    for name, tensor in a["state"].items():
        assert torch.allclose(tensor, b["state"][name], atol=1e-6), name
        moved += not torch.equal(tensor, initial[name])
    assert moved > 0, "the step changed no weight"


@pytest.mark.slow  # a long end-to-end run: CI's suite must stay under 15 minutes on 2 cores
def test_compiled_model_matches_eager_model(tiny_model_dir, tmp_path):
    """train.compile: the same step to float tolerance, the same parameter names (checkpoints and weight sync
    do not change), for the policy and the reference (tb uses one)."""
    eager, compiled = tmp_path / "eager.pt", tmp_path / "compiled.pt"
    _spawn(_one_step, (1, _port(), tiny_model_dir, str(eager), "tb", False), nprocs=1)
    _spawn(_one_step, (1, _port(), tiny_model_dir, str(compiled), "tb", True), nprocs=1)
    a, b = torch.load(eager), torch.load(compiled)
    assert abs(a["loss"] - b["loss"]) < 1e-4 * max(1.0, abs(a["loss"]))
    assert a["graphs"] == 0 and b["graphs"] > 0
    assert a["state"].keys() == b["state"].keys()
    for name, tensor in a["state"].items():
        assert torch.allclose(tensor, b["state"][name], atol=1e-5), name


def test_ranks_wait_for_rank_0_beating_not_in_a_collective():
    """While rank 0 waits for data or evaluates, the other ranks wait for its posted step in shared memory,
    beating, and enter the broadcast only then; the collective timeout is a backstop the group really has."""
    import threading
    import time
    import types

    from runtime.heartbeat import Allowance, Heartbeats
    from runtime.shared import StopFlag
    from trainer.loop import Stopped, _Loop
    from trainer.policy import COLLECTIVE_TIMEOUT, CPUPlacement

    hearts, stop = Heartbeats(["trainer-0", "trainer-1"]), StopFlag()
    rank1 = types.SimpleNamespace(shared=types.SimpleNamespace(hearts=hearts, stop=stop),
                                  heart=hearts.of("trainer-1"))
    seen = []

    def rank0_posts():  # after a second of "evaluation": was rank 1 still beating while it waited?
        seen.extend(name for name, _, _ in hearts.stuck(Allowance(0.2, 0.2, 0.2)))
        hearts.of("trainer-0").post_step(3)

    threading.Timer(1.0, rank0_posts).start()
    start = time.monotonic()
    _Loop._wait_for_rank0(rank1, 3)
    assert time.monotonic() - start >= 0.9 and hearts.phase("trainer-1") == "wait_rank0"
    assert seen == ["trainer-0"]  # rank 0 never beat here; rank 1 beat within the last 0.2 s
    stop.set()
    with pytest.raises(Stopped):
        _Loop._wait_for_rank0(rank1, 4)  # the launcher stopped the run while rank 0 never posted step 4

    CPUPlacement().init_process_group(0, 1, _port())
    try:
        timeout = dist.group.WORLD._get_backend(torch.device("cpu")).options._timeout
    finally:
        dist.destroy_process_group()
    assert timeout == COLLECTIVE_TIMEOUT


# ---- the full weights in a few all-gathers (trainer/gather.py) ----

@contextlib.contextmanager
def _counted_gathers():
    """Inside: a function that says how many all-gathers were entered, whichever way (full_tensor is one
    each)."""
    with (mock.patch.object(dist, "all_gather_single", wraps=dist.all_gather_single) as single,
          mock.patch.object(dist, "all_gather", wraps=dist.all_gather) as gather,
          mock.patch.object(DTensor, "full_tensor", autospec=True, side_effect=DTensor.full_tensor) as full):
        yield lambda: single.call_count + gather.call_count + full.call_count


def _one_by_one(policy):
    """What full_state gave before trainer/gather.py: one full_tensor() per weight, the reference here."""
    named = ((engine_name(n), v.full_tensor() if isinstance(v, DTensor) else v)
             for n, v in policy.state_dict().items())
    return list(merged(named, policy.lm))


def _compare(got, expected) -> dict:
    return {"names": [n for n, _ in got] == [n for n, _ in expected],
            "bits": all(a.dtype == b.dtype and torch.equal(a, b) for (_, a), (_, b) in zip(got, expected))}


def _gathers(rank, world, port, out):
    """On each of `world` ranks: full_state and full_tensors against full_tensor(), and their all-gathers."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import Replicate, Shard, distribute_tensor

    from tests.test_lora import LORA, _perturb_adapters
    from tests.tiny_models import tiny_model
    from trainer.gather import full_tensors
    from trainer.lora import add_adapters

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    try:
        results = {}
        for layers in (2, 8):  # vocabulary 511: embeddings and head of an odd dim 0, split 256 + 255
            policy = shard(TokenLogprobs(tiny_model("qwen3", vocab=511, num_hidden_layers=layers)))
            with _counted_gathers() as count:
                got = [(n, t.clone()) for n, t in full_state(policy)]
            results[layers] = {**_compare(got, _one_by_one(policy)), "gathers": count(), "weights": len(got)}
        lm = add_adapters(tiny_model("qwen3", vocab=511), LORA, torch.bfloat16)  # bf16 base, fp32 adapters
        _perturb_adapters(lm)
        policy = shard(TokenLogprobs(lm))
        with _counted_gathers() as count:
            got = list(full_state(policy))
        results["lora"] = {**_compare(got, _one_by_one(policy)), "gathers": count(), "weights": len(got)}

        torch.manual_seed(0)
        mesh = init_device_mesh("cpu", (world,))
        named = [("odd", distribute_tensor(torch.randn(5, 3), mesh, [Shard(0)])),
                 # none on rank 1
                 ("one_row", distribute_tensor(torch.randn(1, 4), mesh, [Shard(0)])),
                 # past 80 bytes: a second batch
                 ("vector", distribute_tensor(torch.randn(7), mesh, [Shard(0)])),
                 # 4 bytes a rank
                 ("bf16", distribute_tensor(torch.randn(3, 1).bfloat16(), mesh, [Shard(0)])),
                 # aligned after
                 ("wide", distribute_tensor(torch.randn(3, dtype=torch.float64), mesh, [Shard(0)])),
                 # full_tensor()
                 ("replicated", distribute_tensor(torch.randn(2, 2), mesh, [Replicate()])),
                 ("plain", torch.randn(3)),
                 # a third batch
                 ("last", distribute_tensor(torch.randn(2, 2), mesh, [Shard(0)]))]
        expected = [(n, v.full_tensor() if isinstance(v, DTensor) else v) for n, v in named]
        with _counted_gathers() as count:
            got = list(full_tensors(named, budget=80))  # odd and one_row: 76 bytes together
        results["handmade"] = {**_compare(got, expected), "gathers": count()}
        if rank == 0:
            torch.save(results, out)
    finally:
        dist.destroy_process_group()


@pytest.fixture(scope="module")
def gathered(tmp_path_factory):
    out = tmp_path_factory.mktemp("gathers") / "results.pt"
    _spawn(_gathers, (2, _port(), str(out)), nprocs=2)
    return torch.load(out)


def test_full_state_is_full_tensor_bit_for_bit(gathered):
    """Two FSDP2 ranks: the same names, order and bits as one full_tensor() per weight, a weight of an odd
    dim 0 and a LoRA model's merged weights (a bf16 base under fp32 adapters) included."""
    for case in (2, 8, "lora"):
        assert gathered[case]["names"] and gathered[case]["bits"], case
    # 3 batches and the replicated one
    assert gathered["handmade"] == {"names": True, "bits": True, "gathers": 4}


def test_full_state_gathers_in_as_many_collectives_for_any_number_of_weights(gathered):
    """One all-gather for a model of 2 layers or of 8 (one full_tensor() per weight made 25 and 91), and for a
    LoRA model, whose bf16 base weights and fp32 adapters alternate in the state dict."""
    assert (gathered[2]["weights"], gathered[8]["weights"]) == (25, 91)
    assert gathered[2]["gathers"] == gathered[8]["gathers"] == gathered["lora"]["gathers"] == 1
