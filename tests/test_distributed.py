"""FSDP2 over gloo: one optimizer step on two ranks gives the weights one rank gives; a compiled model gives
the weights the eager one gives."""
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

import algos
from launch.schema import RolloutConfig, TrainConfig
from tests.test_tied_groups import MIXED
from tests.test_tied_groups import _groups as tied_groups
from tests.test_trainer import _groups
from trainer.batch import pack
from trainer.learner import Learner, Rank
from trainer.policy import full_state


def _learner(model_dir, rank, world, port, algo="grpo", compile=False, skip_tied=True):
    train = TrainConfig(batch_groups=2, micro_groups=1, lr=1e-3, grad_clip=100.0, autocast="none", compile=compile,
                        skip_tied_groups=skip_tied)
    return Learner(rank=Rank(rank, world, port), model_path=model_dir, train=train, algo=algos.get(algo).Config(),
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
            graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]  # compiled by dynamo in this process
            torch.save({"state": state, "loss": metrics["loss"], "graphs": graphs,
                        "tied": metrics["train/tied_groups_skipped"]}, out)
    finally:
        dist.destroy_process_group()


def _port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_two_ranks_match_one_rank(tiny_model_dir, tmp_path):
    """Two of MIXED's four groups tie: one rank trains on all four (train.skip_tied_groups=false), two ranks leave
    the ties out and take one group each, and the step is the same."""
    one, two = tmp_path / "one.pt", tmp_path / "two.pt"
    mp.spawn(_one_step, args=(1, _port(), tiny_model_dir, str(one), "ppo", False, MIXED, False), nprocs=1)
    mp.spawn(_one_step, args=(2, _port(), tiny_model_dir, str(two), "ppo", False, MIXED, True), nprocs=2)
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
    mp.spawn(_one_step, args=(1, _port(), tiny_model_dir, str(eager), "tb", False), nprocs=1)
    mp.spawn(_one_step, args=(1, _port(), tiny_model_dir, str(compiled), "tb", True), nprocs=1)
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

    from launch.heartbeat import Allowance, Heartbeats
    from launch.shared import StopFlag
    from trainer.loop import Stopped, _Loop
    from trainer.policy import COLLECTIVE_TIMEOUT, CPUPlacement

    hearts, stop = Heartbeats(["trainer-0", "trainer-1"]), StopFlag()
    rank1 = types.SimpleNamespace(shared=types.SimpleNamespace(hearts=hearts, stop=stop), heart=hearts.of("trainer-1"))
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
