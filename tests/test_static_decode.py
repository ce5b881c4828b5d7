"""The GPU plan's static decode step (engines/static_decode.py), run on the CPU: the same tokens as the
step-by-step engine at a fixed seed, one host sync a step, and every address a CUDA graph reads kept across a
weight load. tests/test_gpu_builtin.py runs its graphs on a GPU."""
import pytest
import torch
from transformers import LlamaForCausalLM

from engines.base import Request, SamplingParams
from engines.builtin import BuiltinEngine
from engines.sampler import Passes
from engines.static_decode import StaticDecode, row_buckets, width_buckets
from tests.test_engine import assert_matches_teacher_forced, random_prompts


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def mixed_requests(stop_token: int | None = None) -> list[Request]:
    """More requests than slots, of several lengths and sampling settings, two sharing a prompt."""
    prompts = random_prompts([5, 12, 3, 9, 7, 12, 4], seed=2)
    prompts[5] = prompts[1]
    settings = [dict(), dict(temperature=0.7), dict(top_p=0.9), dict(temperature=0),
                dict(temperature=1.3, top_p=0.8), dict(), dict(temperature=0.5)]
    budgets = [9, 4, 12, 6, 10, 7, 3]
    stops = (stop_token,) if stop_token is not None else ()
    return [Request(i, p, SamplingParams(max_new_tokens=n, stop_token_ids=stops, **kw))
            for i, (p, kw, n) in enumerate(zip(prompts, settings, budgets))]


def run(model, requests, static: bool, max_batch: int = 4, max_len: int = 48):
    return BuiltinEngine(model, max_batch=max_batch, max_len=max_len, seed=5,
                         static=static).generate(requests)


@pytest.mark.parametrize("stop", [False, True])
def test_the_static_step_samples_what_the_step_by_step_engine_samples(model, stop):
    requests = mixed_requests()
    if stop:  # a token the plain run samples early ends sequences at different steps
        requests = mixed_requests(stop_token=run(model, requests, static=False)[0].token_ids[2])
    plain, static = run(model, requests, static=False), run(model, requests, static=True)
    assert any(c.finish_reason == "stop" for c in plain) == stop
    for p, s in zip(plain, static):
        assert (s.token_ids, s.finish_reason, s.versions) == (p.token_ids, p.finish_reason, p.versions)
        torch.testing.assert_close(torch.tensor(s.logprobs), torch.tensor(p.logprobs), atol=1e-5, rtol=0)
    for completion, request in zip(static, requests):
        assert_matches_teacher_forced(model, completion, request.params.temperature)


def test_a_static_step_is_read_one_step_late_and_a_finished_row_is_dropped(model):
    """Step t+1 is queued before step t's tokens are read; a sequence that ends at step t was decoded once
    more in vain, and its slot, taken by a waiting request, starts clean."""
    prompts = random_prompts([6, 6, 6], seed=7)
    engine = BuiltinEngine(model, max_batch=2, max_len=32, seed=1, static=True)
    requests = [Request(0, prompts[0], SamplingParams(max_new_tokens=2)),
                Request(1, prompts[1], SamplingParams(max_new_tokens=8)),
                Request(2, prompts[2], SamplingParams(max_new_tokens=5))]
    for r in requests:
        engine.add(r)
    assert engine.step() == []  # launched, nothing read yet
    assert engine.step() == []  # the first tokens read
    assert [c.request_id for c in engine.step()] == [0]  # its second token, read while the third step ran
    done = {}
    while engine.num_running() or engine.num_waiting():
        done.update((c.request_id, c) for c in engine.step())
    assert sorted(done) == [1, 2]
    alone = BuiltinEngine(model, max_batch=1, max_len=32, seed=1).generate([requests[2]])[0]
    assert done[2].token_ids == alone.token_ids  # admitted into request 0's slot after its extra row


def test_a_static_decode_step_waits_on_the_host_once(model, monkeypatch):
    """Every way a tensor can hand a value to Python is counted in decode steps of the GPU plan's engine code:
    one read a step, the copy of its tokens and logprobs."""
    engine = BuiltinEngine(model, max_batch=8, max_len=48, seed=0, static=True)
    for r in mixed_requests():
        engine.add(r)
    engine.step()  # admission and the first launch
    reads = []
    for name in ("item", "tolist", "__bool__", "__int__", "__float__", "__index__", "numpy", "cpu"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name,
                            lambda self, *a, _o=original, _n=name, **k: reads.append(_n) or _o(self, *a, **k))
    per_step = []
    while engine.num_running() and not engine.num_waiting():
        reads.clear()
        engine.step()
        per_step.append(list(reads))
    monkeypatch.undo()
    assert len(per_step) >= 3 and all(r == ["tolist"] for r in per_step), per_step


def test_the_step_by_step_engine_still_reads_its_decode_without_the_sampler_s_tests(model, monkeypatch):
    """The CPU plan's step: the sampler's passes come from the requests, so its decode reads only its
    results."""
    engine = BuiltinEngine(model, max_batch=8, max_len=48, seed=0)
    for r in mixed_requests():
        engine.add(r)
    engine.step()
    reads = []
    for name in ("item", "__bool__", "__int__"):
        original = getattr(torch.Tensor, name)
        monkeypatch.setattr(torch.Tensor, name,
                            lambda self, *a, _o=original, _n=name: reads.append(_n) or _o(self, *a))
    while engine.num_running() and not engine.num_waiting():
        engine.step()
    monkeypatch.undo()
    assert reads == []


def test_weights_cache_and_slot_inputs_keep_their_addresses_across_a_weight_load(model, tiny_model_dir):
    new_model = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in new_model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    engine = BuiltinEngine(model, max_batch=4, max_len=48, seed=0, static=True)
    step = engine.decoder

    def addresses():
        tensors = {f"weight {n}": t for n, t in engine.weight_tensors().items()}
        tensors.update({"k_cache": engine.k_cache, "v_cache": engine.v_cache, "step.k": step.k_cache,
                        "step.v": step.v_cache, "sampled": step.sampled, "out": step.out,
                        "index": step.index})
        tensors.update({f"slot {f}": getattr(engine.slots, f)
                        for f in ("token", "pos", "temperature", "top_p", "request")})
        return {name: t.data_ptr() for name, t in tensors.items()}

    before = addresses()
    engine.generate(mixed_requests()[:3])
    for r in mixed_requests()[3:]:
        engine.add(r)
    for _ in range(3):
        engine.step()
    new_state = new_model.state_dict()
    for name, tensor in engine.weight_tensors().items():  # what load_bucket does
        tensor.copy_(new_state[name])
    engine.adopt_weights(1)
    while engine.num_running() or engine.num_waiting():
        engine.step()
    assert addresses() == before
    assert step.k_cache is engine.k_cache and engine.decoder is step
    # the step reads the new weights through those same addresses
    late = engine.generate([Request(9, random_prompts([6], seed=11)[0], SamplingParams(max_new_tokens=5))])[0]
    assert late.versions == [1] * 5
    assert_matches_teacher_forced(new_model, late, 1.0)


def test_a_weight_load_between_steps_gives_what_the_step_by_step_engine_gives(model, tiny_model_dir):
    """Four steps, a weight load, the rest: four steps of the static engine have launched four decodes (three
    read), as four of the step-by-step engine have run four, so both sample the same tokens under the same
    versions."""
    new_model = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in new_model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    prompts = random_prompts([5, 11, 3])

    def run_with_a_load(static):
        engine = BuiltinEngine(model, max_batch=4, max_len=64, seed=0, static=static)
        for i, prompt in enumerate(prompts):
            engine.add(Request(i, prompt, SamplingParams(max_new_tokens=10)))
        assert [c for _ in range(4) for c in engine.step()] == []
        new_state = new_model.state_dict()
        for name, tensor in engine.weight_tensors().items():
            tensor.copy_(new_state[name])
        engine.adopt_weights(1)
        done = {}
        while engine.num_running() or engine.num_waiting():
            done.update((c.request_id, c) for c in engine.step())
        return [done[i] for i in range(3)]

    for p, s in zip(run_with_a_load(False), run_with_a_load(True)):
        assert s.versions == p.versions == [0] * 4 + [1] * 6
        assert s.token_ids == p.token_ids
        torch.testing.assert_close(torch.tensor(s.logprobs), torch.tensor(p.logprobs), atol=1e-5, rtol=0)


def test_buckets_cover_every_batch_and_width():
    assert row_buckets(64) == [1, 2, 4, 8, 16, 32, 48, 64]
    assert row_buckets(6) == [1, 2, 4, 6]
    assert width_buckets(192) == [64, 128, 192]
    assert width_buckets(40) == [40]
    step = StaticDecode.__new__(StaticDecode)
    step.rows, step.widths = row_buckets(20), width_buckets(300)
    assert step.shape(17, 65) == (20, 128) and step.shape(3, 300) == (4, 300)


def test_without_cuda_the_graphs_knob_runs_the_same_step_eagerly(model, capsys):
    requests = mixed_requests()
    eager = BuiltinEngine(model, max_batch=4, max_len=48, seed=5, static=True, cuda_graphs=True)
    assert not eager.decoder.use_graphs and eager.decoder.graphs == {}
    got = eager.generate(requests)
    assert [c.token_ids for c in got] == [c.token_ids for c in run(model, requests, static=True)]


def test_a_failed_capture_is_said_in_one_line_and_the_step_runs_eagerly(model, monkeypatch, capsys):
    """A capture that raises (here: a stand-in for CUDA refusing one) leaves the run going, eager, the same
    tokens."""
    requests = mixed_requests()
    engine = BuiltinEngine(model, max_batch=4, max_len=48, seed=5, static=True)
    engine.decoder.use_graphs = True  # as on CUDA

    def refuse(*args):
        raise RuntimeError("operation not permitted when stream is capturing\nsecond line")
    monkeypatch.setattr(engine.decoder, "_capture", refuse)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    got = engine.generate(requests)
    lines = [line for line in capsys.readouterr().out.splitlines() if "cuda graphs" in line]
    assert len(lines) == 1 and "decodes eagerly" in lines[0] and "second line" not in lines[0]
    assert not engine.decoder.use_graphs
    assert [c.token_ids for c in got] == [c.token_ids for c in run(model, requests, static=True)]


def test_the_fallback_forward_keeps_the_step_by_step_decode(tiny_model_dir, capsys):
    model = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    engine = BuiltinEngine(model, max_batch=2, max_len=32, static=True, fallback=True)
    assert engine.decoder is None and "static decode step runs the fast path only" in capsys.readouterr().out
    assert len(engine.generate(mixed_requests()[:2])[0].token_ids) == 9


@pytest.mark.parametrize("passes", [Passes(False, False, False), Passes(True, True, True)])
def test_the_static_step_makes_no_tensor_off_the_engine_s_device(passes):
    """A CUDA graph cannot capture a host tensor made in its body (an index built on the CPU is copied over,
    which capture refuses): the step run on the meta device makes every tensor there."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from transformers import LlamaConfig

    from engines.llama import Llama
    from engines.static_decode import SlotState

    config = LlamaConfig(vocab_size=600, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=8, max_position_embeddings=64)
    meta = torch.device("meta")
    forward = Llama(LlamaForCausalLM(config), torch.float32, 32, meta)
    k_cache, v_cache = forward.new_cache(4, 32)
    state = {name: torch.zeros(4, dtype=torch.long, device=meta) for name in ("token", "pos", "request")}
    slots = SlotState(temperature=torch.ones(4, device=meta), top_p=torch.ones(4, device=meta), **state)
    step = StaticDecode(forward, k_cache, v_cache, slots, seed=0, max_len=32, graphs=False)

    class Devices(TorchDispatchMode):
        made: set = set()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            for tensor in out if isinstance(out, (tuple, list)) else [out]:
                if isinstance(tensor, torch.Tensor) and tensor.device != meta:
                    self.made.add(f"{func} on {tensor.device}")
            return out

    with Devices() as seen:
        step._body(4, 32, passes)
    assert seen.made == set()
