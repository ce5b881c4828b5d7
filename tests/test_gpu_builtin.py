"""The built-in engine on CUDA: the same code as on the CPU, with the device passed in, and its weight path over
CUDA IPC. Skipped without CUDA (`pytest -m gpu`); scripts/gpu_check.sh runs them on a GPU machine."""
import multiprocessing as mp
import queue
import time

import pytest
import torch
from transformers import AutoModelForCausalLM

from engines.base import Request, SamplingParams
from engines.builtin import BuiltinEngine

pytestmark = pytest.mark.gpu


def _requests(n=6, budget=12):
    greedy, sampled = SamplingParams(0.0, 1.0, budget), SamplingParams(1.0, 1.0, budget)
    return [Request(i, [3 + i, 17, 29 + i, 5], greedy if i % 2 else sampled) for i in range(n)]


def test_gpu_engine_on_cuda_generates_what_it_generates_on_the_cpu(tiny_model_dir):
    """float32 on both: the same tokens from the same counter-based uniforms, logprobs within float error."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    on_cpu = BuiltinEngine(model, max_batch=4, max_len=32, seed=1).generate(_requests())
    on_gpu = BuiltinEngine(model, max_batch=4, max_len=32, seed=1, device="cuda:0").generate(_requests())
    for c, g in zip(on_cpu, on_gpu):
        assert g.token_ids == c.token_ids, c.request_id
        assert max(abs(a - b) for a, b in zip(c.logprobs, g.logprobs)) < 1e-3


def test_gpu_engine_logprobs_match_the_hf_forward_in_bf16(tiny_model_dir):
    """bf16 on the GPU: each sampled token's logprob against the Hugging Face model's, teacher-forced in fp32."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    done = BuiltinEngine(model, max_batch=8, max_len=32, seed=0, dtype=torch.bfloat16,
                         device="cuda:0").generate(_requests(8))
    reference = model.cuda().eval()
    errors = []
    with torch.no_grad():
        for c in done:
            ids = torch.tensor([c.prompt_ids + c.token_ids], device="cuda")
            logits = reference(ids).logits[0, len(c.prompt_ids) - 1:-1].float()
            want = logits.log_softmax(-1).gather(1, ids[0, len(c.prompt_ids):, None]).squeeze(1)
            errors += (want.cpu() - torch.tensor(c.logprobs)).abs().tolist()
    assert sum(errors) / len(errors) < 0.05, sum(errors) / len(errors)


@pytest.mark.parametrize("kind", ["qwen3", "gpt_neox"])
def test_gpu_fast_path_and_fallback_match_the_cpu(kind):
    """Qwen3 on the fast path and GPT-NeoX on the fallback: float32 on CUDA gives the CPU's tokens."""
    from tests.tiny_models import tiny_model

    model = tiny_model(kind)
    requests = [Request(r.request_id, [t % 512 for t in r.prompt_ids], r.params) for r in _requests()]
    on_cpu = BuiltinEngine(model, max_batch=4, max_len=32, seed=1).generate(requests)
    on_gpu = BuiltinEngine(model, max_batch=4, max_len=32, seed=1, device="cuda:0").generate(requests)
    for c, g in zip(on_cpu, on_gpu):
        assert g.token_ids == c.token_ids, c.request_id
        assert max(abs(a - b) for a, b in zip(c.logprobs, g.logprobs)) < 1e-3


def _engine_process(model_dir, weights, versions, results):
    """A rollout process's side: a built-in engine on GPU 0 following the weight path; once it holds each version,
    it reports the sum of every weight it holds."""
    engine = BuiltinEngine(AutoModelForCausalLM.from_pretrained(model_dir), max_batch=2, max_len=32,
                           dtype=torch.bfloat16, device="cuda:0")
    sync = weights.follower(engine, 0)
    for version in range(1, versions + 1):
        while engine.version < version:
            sync()
        results.put((engine.version, {n: float(t.double().sum()) for n, t in engine.weight_tensors().items()}))


def test_gpu_weights_reach_a_builtin_engine_over_cuda_ipc(tiny_model_dir):
    """The one-GPU layout's weight path: trainer rank 0 (FSDP2, NCCL) ships each version in buckets as CUDA tensors;
    the engine process maps them over CUDA IPC and copies them into its weights, version after version."""
    import torch.distributed as dist

    from engines.buckets import WeightChannel
    from engines.builtin import BuiltinEngineSpec
    from engines.weight_sync import GPUWeights
    from launch.plan import free_port
    from launch.shared import stop_when_dead
    from trainer.gpu_policy import GPUPlacement
    from trainer.policy import full_state

    ctx = mp.get_context("spawn")
    placement = GPUPlacement(gpu=0)
    placement.init_process_group(0, 1, free_port())
    weights = GPUWeights(WeightChannel(1, ctx), [1], BuiltinEngineSpec.bucket_payloads, "ipc", 1 << 16, torch.bfloat16)
    results = ctx.Queue()
    child = ctx.Process(target=_engine_process, args=(tiny_model_dir, weights, 2, results))
    child.start()
    try:
        policy = placement.load(tiny_model_dir, 1)
        publish = weights.publisher(policy, True, stop_when_dead(child))  # a dead engine: no 600 s wait for acks
        for version in (1, 2):
            with torch.no_grad():
                for p in policy.parameters():
                    p.add_(0.01 * version)
            expected = {n: float(t.to(torch.bfloat16).double().sum()) for n, t in full_state(policy)}
            publish(full_state(policy), version)  # returns once the engine has acked every bucket (or died)
            got, sums = _next_report(results, child, version)
            assert got == version
            assert set(sums) <= set(expected) and len(sums) > 4
            for name, total in sums.items():
                assert abs(total - expected[name]) <= 1e-6 * max(1.0, abs(expected[name])), (version, name)
    finally:
        child.join(timeout=60)
        if child.is_alive():
            child.kill()
        weights.channel.close()
        dist.destroy_process_group()
        torch.cuda.ipc_collect()  # the sender's /dev/shm/torch_<pid>_* ref-counter file goes only with this
    assert child.exitcode == 0


def _next_report(results, child, version: int, timeout_s: float = 300.0):
    """The engine's report of `version`, unless it died first (then at once, with its exit code)."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        try:
            return results.get(timeout=1.0)
        except queue.Empty:
            if not child.is_alive():
                raise AssertionError(f"the engine process exited (code {child.exitcode}) before version {version}")
    raise AssertionError(f"the engine did not report version {version} within {timeout_s:.0f} s")
