"""The built-in engine on CUDA: the same code as on the CPU, with the device passed in, and its weight path
over CUDA IPC. Skipped without CUDA (`pytest -m gpu`); scripts/gpu_check.sh runs them on a GPU machine."""
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
    """bf16 on the GPU: each sampled token's logprob against the Hugging Face model's, teacher-forced in
    fp32."""
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


def _mixed(n=12):
    """Requests of several lengths, budgets and sampling settings: more than the slots, so slots are
    refilled."""
    settings = [SamplingParams(1.0, 1.0, 12), SamplingParams(0.0, 1.0, 7), SamplingParams(0.7, 0.9, 10),
                SamplingParams(1.0, 1.0, 5)]
    return [Request(i, [3 + i, 17, 29 + i, 5, 40 + 3 * i][:3 + i % 3], settings[i % 4]) for i in range(n)]


def test_cuda_graphs_replay_the_static_step_exactly_and_survive_a_weight_load(tiny_model_dir):
    """The GPU plan's step as CUDA graphs: the static step's tokens and logprobs bit for bit, graphs captured
    per shape, and after new weights are copied in (as load_bucket does) every graph reads them: the same
    tokens as an eager engine given the same weights; no address a graph reads has moved."""
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    make = lambda graphs: BuiltinEngine(model, max_batch=8, max_len=40, seed=2,  # noqa: E731
                                        dtype=torch.bfloat16, device="cuda:0", static=True,
                                        cuda_graphs=graphs)
    eager, graphed = make(False), make(True)
    addresses = lambda e: sorted(t.data_ptr() for t in [*e.weight_tensors().values(), e.k_cache,  # noqa
                                                         e.v_cache, e.slots.token, e.slots.pos,
                                                         e.decoder.out])
    before = addresses(graphed)
    for engine in (eager, graphed):
        assert [c.token_ids for c in engine.generate(_mixed())]  # warm: graphs captured here
    assert graphed.decoder.use_graphs and len(graphed.decoder.graphs) >= 2
    a, b = eager.generate(_mixed()), graphed.generate(_mixed())
    assert [c.token_ids for c in a] == [c.token_ids for c in b]
    assert [c.logprobs for c in a] == [c.logprobs for c in b]
    torch.manual_seed(0)
    noise = {n: torch.randn_like(t) * 0.05 for n, t in eager.weight_tensors().items()}
    for engine in (eager, graphed):
        for name, tensor in engine.weight_tensors().items():
            tensor.copy_(tensor + noise[name])
        engine.adopt_weights(1)
    captured = len(graphed.decoder.graphs)
    a, b = eager.generate(_mixed()), graphed.generate(_mixed())
    assert [c.token_ids for c in a] == [c.token_ids for c in b] and all(c.versions[0] == 1 for c in b)
    assert len(graphed.decoder.graphs) == captured and addresses(graphed) == before


def test_the_static_step_on_cuda_samples_what_the_stepwise_step_samples_in_float32(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    stepwise = BuiltinEngine(model, max_batch=4, max_len=40, seed=1, device="cuda:0").generate(_mixed())
    graphed = BuiltinEngine(model, max_batch=4, max_len=40, seed=1, device="cuda:0", static=True,
                            cuda_graphs=True).generate(_mixed())
    for c, g in zip(stepwise, graphed):
        assert g.token_ids == c.token_ids, c.request_id
        assert max(abs(x - y) for x, y in zip(c.logprobs, g.logprobs)) < 1e-4


def _engine_process(model_dir, weights, versions, results):
    """A rollout process's side: a built-in engine on GPU 0 following the weight path; once it holds each
    version, it reports the sum of every weight it holds."""
    engine = BuiltinEngine(AutoModelForCausalLM.from_pretrained(model_dir), max_batch=2, max_len=32,
                           dtype=torch.bfloat16, device="cuda:0")
    sync = weights.follower(engine, 0)
    for version in range(1, versions + 1):
        while engine.version < version:
            sync()
        results.put((engine.version,
                     {n: float(t.double().sum()) for n, t in engine.weight_tensors().items()}))


def test_gpu_weights_reach_a_builtin_engine_over_cuda_ipc(tiny_model_dir):
    """The one-GPU layout's weight path: trainer rank 0 (FSDP2, NCCL) ships each version in buckets as CUDA
    tensors; the engine process maps them over CUDA IPC and copies them into its weights, version after
    version."""
    import torch.distributed as dist

    from engines.buckets import WeightChannel
    from engines.builtin import BuiltinEngineSpec
    from engines.weight_sync import GPUWeights
    from launch.plan import free_port
    from runtime.shared import stop_when_dead
    from trainer.gpu_policy import GPUPlacement
    from trainer.policy import full_state

    ctx = mp.get_context("spawn")
    placement = GPUPlacement(gpu=0)
    placement.init_process_group(0, 1, free_port())
    weights = GPUWeights(WeightChannel(1, ctx), [1], BuiltinEngineSpec.bucket_payloads, "ipc", 1 << 16,
                         torch.bfloat16)
    results = ctx.Queue()
    child = ctx.Process(target=_engine_process, args=(tiny_model_dir, weights, 2, results))
    child.start()
    try:
        policy = placement.load(tiny_model_dir, 1)
        # a dead engine: no 600 s wait for acks
        publish = weights.publisher(policy, True, stop_when_dead(child))
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
                raise AssertionError(f"the engine process exited (code {child.exitcode}) "
                                     f"before version {version}")
    raise AssertionError(f"the engine did not report version {version} within {timeout_s:.0f} s")
