"""The built-in engine's promises: HF-exact logprobs, greedy = HF generate, continuous batching,
in-flight weight updates with per-token versions, stop/length, reproducibility."""
import math

import pytest
import torch
from transformers import AutoTokenizer, LlamaForCausalLM

from engines.base import Request, SamplingParams
from engines.builtin import BuiltinEngine
from engines.sampler import inverse_cdf, sample


@pytest.fixture(scope="module")
def model(tiny_model_dir):
    return LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()


def random_prompts(lengths, vocab=49152, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (n,), generator=g).tolist() for n in lengths]


def teacher_forced_logprobs(model, prompt, completion, temperature):
    """log softmax(logits / T) of `model` at each completion token, from one full forward pass."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion])).logits[0].float()
    logits = logits[len(prompt) - 1:len(prompt) - 1 + len(completion)] / (temperature or 1.0)
    return torch.log_softmax(logits, -1).gather(1, torch.tensor(completion)[:, None]).squeeze(1)


def assert_matches_teacher_forced(model, completion, temperature, atol=1e-4):
    expected = teacher_forced_logprobs(model, completion.prompt_ids, completion.token_ids, temperature)
    torch.testing.assert_close(torch.tensor(completion.logprobs), expected, atol=atol, rtol=0)


def test_sampled_logprobs_match_teacher_forced_hf(model):
    prompts = random_prompts([1, 5, 17, 9, 30, 2, 12])
    prompts.append(prompts[2])  # a repeated prompt shares one prefill
    requests = [Request(i, p, SamplingParams(temperature=(0.7, 1.0)[i % 2], top_p=0.9 if i == 3 else 1.0,
                                             max_new_tokens=4 + 2 * i)) for i, p in enumerate(prompts)]
    engine = BuiltinEngine(model, max_batch=3, max_len=64)  # fewer slots than requests: slots get refilled
    completions = engine.generate(requests)
    assert [c.request_id for c in completions] == list(range(len(prompts)))
    for request, completion in zip(requests, completions):
        assert completion.prompt_ids == request.prompt_ids and completion.finish_reason == "length"
        assert len(completion.token_ids) == request.params.max_new_tokens == len(completion.versions)
        assert completion.versions == [0] * len(completion.token_ids)
        assert_matches_teacher_forced(model, completion, request.params.temperature)


def test_greedy_matches_hf_generate(model, tiny_model_dir):
    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    texts = ["What is 3 + 4? Reply with just the number.", "Hello",
             "Name three colours of the rainbow, please."]
    prompts = [tokenizer(t)["input_ids"] for t in texts]
    engine = BuiltinEngine(model, max_batch=2, max_len=64)
    completions = engine.generate([Request(i, p, SamplingParams(temperature=0, max_new_tokens=12))
                                   for i, p in enumerate(prompts)])
    for prompt, completion in zip(prompts, completions):
        with torch.no_grad():
            reference = model.generate(torch.tensor([prompt]), do_sample=False,
                                       max_new_tokens=12)[0, len(prompt):]
        assert completion.token_ids[:len(reference)] == reference.tolist()
        # Greedy logprobs are those of the argmax under softmax(logits), i.e. T = 1.
        assert_matches_teacher_forced(model, completion, 1.0)


def test_continuous_batching_refills_a_slot_before_the_long_request_ends(model):
    engine = BuiltinEngine(model, max_batch=2, max_len=64)
    long, short, queued = random_prompts([6, 4, 8])
    engine.add(Request(0, long, SamplingParams(max_new_tokens=20)))
    engine.add(Request(1, short, SamplingParams(max_new_tokens=2)))
    engine.add(Request(2, queued, SamplingParams(max_new_tokens=3)))
    finished_at = {}
    for step in range(1, 30):
        for completion in engine.step():
            finished_at[completion.request_id] = step
        if step == 3:  # request 1 left after step 2; request 2 took its slot while request 0 runs on
            assert engine.num_running() == 2 and engine.num_waiting() == 0 and engine.free_slots() == 0
        if engine.num_running() == 0:
            break
    assert finished_at == {1: 2, 2: 5, 0: 20}
    assert engine.free_slots() == 2


def test_in_flight_weight_update_records_versions_and_uses_new_weights(model, tiny_model_dir):
    new_model = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in new_model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    check_an_in_flight_weight_load(model, new_model, vocab=49152)


def check_an_in_flight_weight_load(model, new_model, vocab: int) -> None:
    """Requests in flight when `new_model`'s weights are copied into the engine keep their cache and record
    the new version on later tokens; a request started after samples from the new weights; `model` stays
    untouched."""
    before = {k: v.clone() for k, v in model.state_dict().items()}
    engine = BuiltinEngine(model, max_batch=4, max_len=64)
    prompts = random_prompts([5, 11, 3], vocab=vocab)
    for i, prompt in enumerate(prompts):
        engine.add(Request(i, prompt, SamplingParams(max_new_tokens=10)))
    early = [c for _ in range(4) for c in engine.step()]
    assert early == []

    new_state = new_model.state_dict()
    for name, tensor in engine.weight_tensors().items():
        tensor.copy_(new_state[name])
    engine.adopt_weights(1)
    engine.add(Request(3, prompts[0], SamplingParams(max_new_tokens=6)))
    done = {}
    while engine.num_running() or engine.num_waiting():
        done.update((c.request_id, c) for c in engine.step())

    for i in range(3):  # in flight across the update: kept their cache, later tokens carry the new version
        assert done[i].versions == [0] * 4 + [1] * 6
    assert done[3].versions == [1] * 6
    assert_matches_teacher_forced(new_model, done[3], 1.0)
    for name, tensor in model.state_dict().items():  # the engine owns copies; the HF model is untouched
        assert torch.equal(tensor, before[name]), name


def test_samples_of_one_prompt_share_one_prefill(model):
    engine = BuiltinEngine(model, max_batch=8, max_len=32)
    prefilled = []
    prefill = engine.model.prefill
    engine.model.prefill = lambda k, v, ids, rows, slots: prefilled.append(ids.shape) \
        or prefill(k, v, ids, rows, slots)
    shared, other = random_prompts([9, 5])
    requests = [Request(i, shared, SamplingParams(max_new_tokens=3)) for i in range(5)]
    completions = engine.generate(requests + [Request(5, other, SamplingParams(max_new_tokens=3))])
    assert prefilled == [(2, 8)]  # two distinct prompts, padded to the longer one minus its last token
    assert len({tuple(c.token_ids) for c in completions[:5]}) > 1  # one prefill, still independent samples
    for completion in completions:
        assert_matches_teacher_forced(model, completion, 1.0)


def test_weight_tensors_name_every_parameter_and_own_their_storage(model):
    engine = BuiltinEngine(model, max_batch=2, max_len=32)
    tensors = engine.weight_tensors()
    state = model.state_dict()
    assert set(tensors) == set(state)
    for name, tensor in tensors.items():
        assert tensor.shape == state[name].shape and torch.equal(tensor, state[name]), name
        assert tensor.untyped_storage().data_ptr() != state[name].untyped_storage().data_ptr(), name


def test_stop_token_ends_with_stop_and_max_new_tokens_with_length(model):
    prompt = random_prompts([7])[0]
    engine = BuiltinEngine(model, max_batch=2, max_len=32)
    greedy = engine.generate([Request(0, prompt, SamplingParams(temperature=0, max_new_tokens=8))])[0]
    assert greedy.finish_reason == "length" and len(greedy.token_ids) == 8
    stop = greedy.token_ids[3]
    first = greedy.token_ids.index(stop)  # the stop token may have come earlier too
    stopped = engine.generate([Request(1, prompt, SamplingParams(temperature=0, max_new_tokens=8,
                                                                 stop_token_ids=(stop,)))])[0]
    assert stopped.finish_reason == "stop" and stopped.token_ids == greedy.token_ids[:first + 1]

    with pytest.raises(ValueError, match="max_len"):
        engine.add(Request(2, list(range(30)), SamplingParams(max_new_tokens=3)))
    with pytest.raises(ValueError):
        engine.add(Request(3, [], SamplingParams()))
    engine.add(Request(4, list(range(29)), SamplingParams(max_new_tokens=3)))  # exactly max_len is fine


def test_same_seed_same_tokens(model):
    prompts = random_prompts([4, 9, 4])
    requests = [Request(i, p, SamplingParams(max_new_tokens=6, top_p=0.95)) for i, p in enumerate(prompts)]

    def run(seed):
        return [c.token_ids
                for c in BuiltinEngine(model, max_batch=2, max_len=32, seed=seed).generate(requests)]

    assert run(0) == run(0)
    assert run(0) != run(1)


def test_sampler_follows_the_nucleus_distribution():
    probs = torch.tensor([0.4, 0.3, 0.15, 0.1, 0.05] + [0.0] * 300)
    logits = probs.clamp_min(1e-30).log().expand(20000, -1).clone()
    g = torch.Generator().manual_seed(0)
    tokens, logprobs = sample(logits, torch.ones(20000), torch.full((20000,), 0.8),
                              torch.rand(20000, generator=g))
    counts = torch.bincount(tokens, minlength=305).float() / 20000
    # 0.4 + 0.3 < 0.8 <= 0.4 + 0.3 + 0.15: the nucleus is tokens {0, 1, 2}, renormalised.
    torch.testing.assert_close(counts[:3], torch.tensor([0.4, 0.3, 0.15]) / 0.85, atol=0.015, rtol=0)
    assert counts[3:].sum() == 0
    # Logprobs are of the full distribution, not the renormalised nucleus.
    torch.testing.assert_close(logprobs, probs.log()[tokens])

    weights = torch.rand(3, 1000) ** 4
    weights[0, 600:] = 0  # an all-zero tail, including whole blocks
    draws = inverse_cdf(weights.repeat_interleave(30000, 0), torch.rand(90000, generator=g))
    for row in range(3):
        counts = torch.bincount(draws[row * 30000:(row + 1) * 30000], minlength=1000).float() / 30000
        torch.testing.assert_close(counts, weights[row] / weights[row].sum(), atol=0.004, rtol=0)


def test_the_sampler_takes_bf16_logits_leaves_them_alone_and_draws_what_their_float32_copy_draws():
    """A bf16 engine hands the sampler its head's own logits: the tokens and logprobs are those of their
    float32 copy, bit for bit, at T = 1, at T != 1 with top-p, and greedy; neither tensor is written to."""
    g = torch.Generator().manual_seed(0)
    logits = (torch.randn(6, 4096, generator=g) * 4).bfloat16()
    u = torch.rand(6, generator=g)
    for temperature, top_p in ((1.0, 1.0), (0.7, 0.9), (0.0, 1.0)):
        t, p = torch.full((6,), temperature), torch.full((6,), top_p)
        as_bf16, as_fp32 = logits.clone(), logits.float()
        kept = as_fp32.clone()
        tokens, logprobs = sample(as_bf16, t, p, u)
        expected_tokens, expected_logprobs = sample(as_fp32, t, p, u)
        assert torch.equal(tokens, expected_tokens) and torch.equal(logprobs, expected_logprobs)
        assert torch.equal(as_bf16, logits) and torch.equal(as_fp32, kept)
        reference = (torch.log_softmax(kept / (temperature or 1.0), dim=-1)
                     .gather(1, tokens[:, None]).squeeze(1))
        torch.testing.assert_close(logprobs, reference)


def test_qwen2_style_bias_and_untied_head_match_hf():
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=512, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=False)
    qwen = Qwen2ForCausalLM(config).eval()
    with torch.no_grad():
        for name, p in qwen.named_parameters():
            if name.endswith("bias"):
                p.normal_(0, 0.5)  # HF initialises biases to zero, which would test nothing
    engine = BuiltinEngine(qwen, max_batch=2, max_len=48)
    assert set(engine.weight_tensors()) == set(qwen.state_dict())  # biases and an untied lm_head included
    requests = [Request(i, p, SamplingParams(temperature=0.8, max_new_tokens=10))
                for i, p in enumerate(random_prompts([3, 13, 8], vocab=512))]
    for request, completion in zip(requests, engine.generate(requests)):
        assert_matches_teacher_forced(qwen, completion, 0.8)


def test_bfloat16_engine_stays_close_to_fp32(model):
    engine = BuiltinEngine(model, max_batch=2, max_len=48, dtype=torch.bfloat16)
    requests = [Request(i, p, SamplingParams(max_new_tokens=8))
                for i, p in enumerate(random_prompts([6, 15]))]
    for completion in engine.generate(requests):
        assert_matches_teacher_forced(model, completion, 1.0, atol=0.05)


def test_bfloat16_decode_attention_as_two_matmuls_stays_close_to_fp32(model, monkeypatch):
    """On the CPU, bf16 decode attention is two matmuls where their keys are contiguous: the cache's whole
    width for slots 0..n-1 once the longest sequence holds half of it, and the gathered slots once a slot
    between them has finished. Either way the logprobs stay within bf16's distance of fp32 HF; a wider cache
    keeps the fused kernel until a slot finishes."""
    from engines.llama import Llama
    split, widths = Llama._attend_split, []
    monkeypatch.setattr(Llama, "_attend_split", lambda self, visible: widths.append(visible.shape[-1]) or
                        split(self, visible))
    prompts = random_prompts([6, 15, 9])

    def run(max_len):
        widths.clear()
        engine = BuiltinEngine(model, max_batch=3, max_len=max_len, dtype=torch.bfloat16)
        requests = [Request(i, p, SamplingParams(max_new_tokens=4 if i == 0 else 12))
                    for i, p in enumerate(prompts)]
        for completion in engine.generate(requests):
            assert_matches_teacher_forced(model, completion, 1.0, atol=0.05)
        return list(widths)

    # Decode steps 1-4 read 15-18 positions. Width 32: the fused kernel, then the whole width for steps 2-4;
    # after slot 0's last token, slots 1 and 2 gathered.
    tight = run(32)
    assert tight[:3] == [32, 32, 32] and tight[3:] and all(w < 32 for w in tight[3:])
    wide = run(128)  # the gathered slots only
    assert wide and all(w <= 27 for w in wide) and len(wide) == len(tight) - 3


def test_a_cpu_cache_grows_with_the_longest_sequence_and_keeps_what_it_holds(model, monkeypatch):
    """The fast path's CPU cache starts FIRST_WIDTH positions wide and widens in place, GROWTH positions at a
    time, as the longest sequence needs, up to max_len: the same tokens and logprobs as a cache made max_len
    wide at once, HF-exact in fp32."""
    from engines.llama import Llama

    requests = [Request(i, p, SamplingParams(max_new_tokens=n))
                for i, (p, n) in enumerate(zip(random_prompts([6, 15, 9]), [90, 110, 20]))]
    grown = BuiltinEngine(model, max_batch=2, max_len=200)
    assert grown.k_cache.shape[3] == 64  # FIRST_WIDTH
    memory = grown.k_cache.data_ptr(), grown.v_cache.data_ptr()
    widths = []
    grow = Llama.grow_cache
    monkeypatch.setattr(Llama, "grow_cache",
                        lambda self, k, v, width: widths.append(width) or grow(self, k, v, width))
    done = grown.generate(requests)
    assert widths == [96, 128]  # 15 + 110 - 1 positions, in steps of 32
    assert grown.k_cache.shape[3] == 128 and grown.v_cache.shape[3] == 128
    assert (grown.k_cache.data_ptr(), grown.v_cache.data_ptr()) == memory  # widened where they were
    for completion in done:
        assert_matches_teacher_forced(model, completion, 1.0)
    # A parked sequence's next turn that needs a wider cache: extended after the growth, not prefilled again.
    parked = BuiltinEngine(model, max_batch=1, max_len=200)
    prompt, observation = random_prompts([9, 70], seed=3)
    first = parked.generate([Request(0, prompt, SamplingParams(max_new_tokens=5), park=True)])[0]
    assert parked.k_cache.shape[3] == 64
    second = parked.generate([Request(1, prompt + first.token_ids + observation,
                                      SamplingParams(max_new_tokens=6), resume=0)])[0]
    assert (parked.resumed, parked.resume_misses) == (1, 0) and parked.k_cache.shape[3] == 96
    assert_matches_teacher_forced(model, second, 1.0)
    monkeypatch.setattr(BuiltinEngine, "FIRST_WIDTH", 1 << 30)
    whole = BuiltinEngine(model, max_batch=2, max_len=200)
    assert whole.k_cache.shape[3] == 200
    assert [(c.token_ids, c.logprobs) for c in whole.generate(requests)] \
        == [(c.token_ids, c.logprobs) for c in done]


@pytest.mark.parametrize("lead, width, wider", [((30, 8, 3), 64, 96), ((50,), 10, 11), ((2, 3), 5, 40)])
def test_a_cache_widened_in_place_keeps_every_row_and_zeroes_the_new_positions(lead, width, wider):
    """engines/llama.py `widen`: rows move up in runs that never overlap what they leave (first case), or one
    at a time through a copy where they do (the second case's first ten rows), within the memory the cache
    came in; that memory's unwritten rest (NaN here) never shows."""
    from engines.llama import widen

    rows = math.prod(lead)
    memory = torch.full((rows * wider * 4,), float("nan"))
    cache = memory[:rows * width * 4].view(*lead, width, 4)
    cache.copy_(torch.randn(*lead, width, 4))
    held = cache.clone()
    grown = widen(cache, wider)
    assert grown.shape == (*lead, wider, 4) and grown.data_ptr() == memory.data_ptr()
    assert torch.equal(grown[..., :width, :], held) and bool((grown[..., width:, :] == 0).all())


def test_a_model_that_is_not_a_causal_lm_is_refused():
    # other causal LMs run on the fallback (tests/test_models.py)
    from transformers import T5Config, T5ForConditionalGeneration

    t5 = T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=16, d_ff=32, num_layers=1,
                                             num_heads=2, d_kv=8))
    with pytest.raises(ValueError, match="not a causal LM"):
        BuiltinEngine(t5, max_batch=1, max_len=16)


def test_counter_uniform_is_a_fixed_uniform_stream():
    from engines.sampler import counter_uniform

    keys, pos = torch.arange(200_000) // 100, torch.arange(200_000) % 100
    u = counter_uniform(7, keys, pos)
    assert torch.equal(u, counter_uniform(7, keys, pos)) and not torch.equal(u, counter_uniform(8, keys, pos))
    assert 0 <= u.min() and u.max() < 1
    assert abs(u.mean().item() - 0.5) < 0.005 and abs(u.var().item() - 1 / 12) < 0.002
    hist = torch.histc(u, bins=10, min=0, max=1) / len(u)
    assert (hist - 0.1).abs().max() < 0.005
    assert abs(torch.corrcoef(torch.stack([u[:-1], u[1:]]))[0, 1].item()) < 0.01  # neighbours independent


def test_a_request_samples_the_same_tokens_in_any_batch(model):
    # the draw for token t of request r depends on (seed, r, t) only, not on what else is decoding
    prompts = random_prompts([4, 9, 4, 6])
    requests = [Request(i, p, SamplingParams(max_new_tokens=6)) for i, p in enumerate(prompts)]
    together = BuiltinEngine(model, max_batch=4, max_len=32, seed=3).generate(requests)
    alone = [BuiltinEngine(model, max_batch=1, max_len=32, seed=3).generate([r])[0]
             for r in requests[::-1]][::-1]
    assert [c.token_ids for c in together] == [c.token_ids for c in alone]


@pytest.mark.parametrize("fallback", [False, True])
def test_a_sample_admitted_beside_a_running_sibling_copies_its_prompt_s_cache(model, fallback):
    """More samples of a prompt than free slots: those admitted later copy the prompt's cache from a sibling
    still running instead of prefilling it again, and their logprobs are still a full teacher-forced
    pass's."""
    engine = BuiltinEngine(model, max_batch=2, max_len=40, fallback=fallback)
    prefilled = []
    prefill = engine.model.prefill
    engine.model.prefill = lambda *a: prefilled.append(a[2].shape) or prefill(*a)
    shared, other = random_prompts([11, 7], seed=4)
    # Sample 0 runs throughout; the other prompt holds slot 1 first, so a wrong copy would leave its keys
    # there.
    plan = [(shared, 12), (other, 2), (shared, 3), (shared, 4)]
    requests = [Request(i, prompt, SamplingParams(max_new_tokens=n)) for i, (prompt, n) in enumerate(plan)]
    completions = engine.generate(requests)
    assert prefilled == [(2, 10)] and engine.prefix_copies == 2
    for completion in completions:
        assert_matches_teacher_forced(model, completion, 1.0)


def test_a_parked_sequence_continues_with_only_its_new_tokens_prefilled(model):
    """Multi-turn: a finished turn's slot stays parked; the next turn (its tokens + an observation) extends
    the cache instead of prefilling it all, and its logprobs are those of a full teacher-forced pass."""
    prompt, observation = random_prompts([9, 6], seed=3)
    engine = BuiltinEngine(model, max_batch=2, max_len=64)
    first = engine.generate([Request(0, prompt, SamplingParams(max_new_tokens=5), park=True)])[0]
    assert engine.free_slots() == 2 and list(engine.parked) == [0]
    prefilled = []
    prefill = engine.model.prefill
    engine.model.prefill = lambda *a: prefilled.append(a[2].shape) or prefill(*a)
    second_prompt = prompt + first.token_ids + observation
    second = engine.generate([Request(1, second_prompt, SamplingParams(max_new_tokens=6), resume=0)])[0]
    assert prefilled == [] and (engine.resumed, engine.resume_misses) == (1, 0)
    assert_matches_teacher_forced(model, second, 1.0)
    # The same continuation after its slot was taken by another request: a full prefill, the same tokens.
    other = BuiltinEngine(model, max_batch=1, max_len=64)
    other.generate([Request(0, prompt, SamplingParams(max_new_tokens=5), park=True)])
    # evicts it
    other.generate([Request(7, random_prompts([4], seed=9)[0], SamplingParams(max_new_tokens=2))])
    again = other.generate([Request(1, second_prompt, SamplingParams(max_new_tokens=6), resume=0)])[0]
    assert (other.resumed, other.resume_misses) == (0, 1)
    assert again.token_ids == second.token_ids
    torch.testing.assert_close(torch.tensor(again.logprobs), torch.tensor(second.logprobs), atol=1e-4, rtol=0)


@pytest.mark.parametrize("static", [False, True], ids=["step_by_step", "static"])
def test_a_continuation_after_a_weight_load_is_prefilled_again_under_the_new_weights(model, tiny_model_dir,
                                                                                    static):
    """One rule for new prompts and continuations: no cache holding values of older weights is reused. A
    parked sequence's next turn after a weight load is prefilled in full, and its logprobs are those of a
    teacher-forced pass of the new weights over the whole conversation; counted as a stale resume."""
    new_model = LlamaForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        for p in new_model.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    prompt, observation = random_prompts([9, 6], seed=3)
    engine = BuiltinEngine(model, max_batch=2, max_len=64, static=static)
    first = engine.generate([Request(0, prompt, SamplingParams(max_new_tokens=5), park=True)])[0]
    new_state = new_model.state_dict()
    for name, tensor in engine.weight_tensors().items():
        tensor.copy_(new_state[name])
    engine.adopt_weights(1)
    second_prompt = prompt + first.token_ids + observation
    second = engine.generate([Request(1, second_prompt, SamplingParams(max_new_tokens=6), park=True,
                                      resume=0)])[0]
    assert (engine.resumed, engine.resume_misses, engine.stale_resumes) == (0, 1, 1)
    assert second.versions == [1] * 6
    assert_matches_teacher_forced(new_model, second, 1.0)
    # the next turn, with no load in between, extends the cache the full prefill made
    third = engine.generate([Request(2, second_prompt + second.token_ids + observation,
                                     SamplingParams(max_new_tokens=4), resume=1)])[0]
    assert (engine.resumed, engine.resume_misses, engine.stale_resumes) == (1, 1, 1)
    assert_matches_teacher_forced(new_model, third, 1.0)


def test_a_stop_string_ends_a_sequence_even_inside_a_token(model):
    prompt = random_prompts([7])[0]
    engine = BuiltinEngine(model, max_batch=2, max_len=32)
    sampled = engine.generate([Request(1, prompt, SamplingParams(max_new_tokens=8))])[0].token_ids
    assert len(set(sampled[:4])) == 4  # distinct tokens, so the texts below belong to one position each
    vocabulary = [f"<{i}>" for i in range(49152)]
    vocabulary[sampled[2]], vocabulary[sampled[3]] = "ab</ca", "lc>zz"  # the stop string ends inside token 3
    stops = SamplingParams(max_new_tokens=8, stop_strings=("</calc>",))
    with pytest.raises(ValueError, match="use_vocabulary"):
        engine.add(Request(1, prompt, stops))
    engine.use_vocabulary(vocabulary)
    stopped = engine.generate([Request(1, prompt, stops)])[0]  # the same request id samples the same tokens
    assert stopped.finish_reason == "stop" and stopped.token_ids == sampled[:4]


def test_an_engine_that_cannot_stop_on_text_is_cut_after_the_stop_string():
    from engines.base import Completion, cut_at_stop_string

    vocabulary = ["a", "<ca", "lc>", "1+1", "</ca", "lc>x", "zz"]
    done = Completion(5, [9], [1, 2, 3, 4, 5, 6], [-1.0] * 6, [0] * 6, "length")
    cut = cut_at_stop_string(done, ("</calc>",), vocabulary)
    assert cut.token_ids == [1, 2, 3, 4, 5] and cut.finish_reason == "stop" and len(cut.logprobs) == 5
    assert cut_at_stop_string(done, ("</python>",), vocabulary) == done


@pytest.mark.parametrize("large_cache", [False, True])
def test_a_cpu_engine_s_process_keeps_the_chunks_it_frees_and_makes_again(tiny_model_dir, monkeypatch,
                                                                          large_cache):
    """A CPU engine that keeps its cache frees its blocked weights every version and makes them again at once:
    the process that opens it keeps freed chunks resident, up to its weights' bytes above heap.KEEP_TOP. One
    whose cache is handed back while idle hands the heap's pages back too, and keeps nothing."""
    import engines.builtin
    from heap import KEEP_TOP

    calls = []
    monkeypatch.setattr(engines.builtin, "keep_freed_chunks", lambda keep, top: calls.append((keep, top)))
    monkeypatch.setattr(BuiltinEngine, "IDLE_RELEASE_BYTES", 1 if large_cache else 1 << 40)
    with engines.builtin.BuiltinEngineSpec.on_cpu(2, 48, "float32").open(tiny_model_dir, 0) as engine:
        weights = sum(t.nbytes for t in engine.weight_tensors().values())
        assert engine.release_when_idle == large_cache
    assert calls == ([] if large_cache else [(True, KEEP_TOP + weights)])


def test_an_idle_engine_with_a_large_cache_hands_it_back_and_samples_the_same_tokens(model, monkeypatch):
    prompts = random_prompts([4, 9, 4, 7])
    batches = [[Request(i, p, SamplingParams(max_new_tokens=6)) for i, p in enumerate(prompts[:2])],
               [Request(i + 2, p, SamplingParams(max_new_tokens=6)) for i, p in enumerate(prompts[2:])]]
    kept = BuiltinEngine(model, max_batch=2, max_len=32)
    assert not kept.release_when_idle  # a small cache stays
    expected = [[c.token_ids for c in kept.generate(batch)] for batch in batches]
    assert kept.k_cache is not None

    monkeypatch.setattr(BuiltinEngine, "IDLE_RELEASE_BYTES", 1)
    engine = BuiltinEngine(model, max_batch=2, max_len=32)
    parked = engine.generate([Request(9, prompts[0], SamplingParams(max_new_tokens=2), park=True)])
    assert parked and engine.k_cache is not None  # a parked sequence keeps its cache
    engine = BuiltinEngine(model, max_batch=2, max_len=32)
    assert engine.k_cache is None  # made by the first requests, not held from construction
    assert engine.model.cache_bytes(2, 32) \
        == sum(t.numel() * t.element_size() for t in kept.model.new_cache(2, 32))
    for batch, tokens in zip(batches, expected):
        assert [c.token_ids for c in engine.generate(batch)] == tokens
        assert engine.k_cache is None and engine.v_cache is None


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matmuls_read_blocked_weights_that_follow_each_new_version(model, dtype):
    """Where engines/llama.py `blocks_weights` says so (bf16 with AVX-512, fp32 with AVX2 only), the fast
    path's matmuls read oneDNN-blocked copies of its weights: in bf16 the same tokens and logprobs as F.linear
    on the plain weights, in fp32 the same tokens and logprobs within fp32's rounding. adopt_weights drops the
    copies and the next step makes them again, so a request after a weight load samples from the new weights
    exactly as a fresh engine would."""
    from engines.llama import blocks_weights

    def run(engine):
        requests = [Request(i, p, SamplingParams(max_new_tokens=8))
                    for i, p in enumerate(random_prompts([6, 15, 9]))]
        return [(c.token_ids, c.logprobs) for c in engine.generate(requests)]

    engine = BuiltinEngine(model, max_batch=2, max_len=48, dtype=dtype)
    blocked = run(engine)
    if not blocks_weights(torch.device("cpu"), dtype):
        assert engine.model.blocked == {}  # F.linear on the plain weights
        pytest.skip(f"this CPU keeps F.linear for {dtype}")
    assert len(engine.model.blocked) == 1 + 4 * len(engine.model.layers)
    engine.model.drop_blocked()
    engine.model.blocks = False
    plain = run(engine)
    assert engine.model.blocked == {}
    if dtype == torch.bfloat16:
        assert plain == blocked
    else:
        assert [tokens for tokens, _ in plain] == [tokens for tokens, _ in blocked]
        for (_, a), (_, b) in zip(plain, blocked):
            assert torch.allclose(torch.tensor(a), torch.tensor(b), atol=1e-5)

    shifted = LlamaForCausalLM(model.config).eval()
    shifted.load_state_dict(model.state_dict())
    with torch.no_grad():
        for p in shifted.parameters():
            p.add_(torch.randn_like(p) * 0.05)
    engine = BuiltinEngine(model, max_batch=2, max_len=48, dtype=dtype)
    assert run(engine) == blocked
    state = shifted.state_dict()
    with torch.no_grad():
        for name, tensor in engine.weight_tensors().items():
            tensor.copy_(state[name])
    engine.adopt_weights(1)
    assert run(engine) == run(BuiltinEngine(shifted, max_batch=2, max_len=48, dtype=dtype)) != blocked
    assert engine.model.blocked


def test_an_idle_engine_with_a_large_cache_gives_back_its_blocked_weights_too(model, monkeypatch):
    """The idle release (BuiltinEngine.IDLE_RELEASE_BYTES) drops the KV cache and the blocked copies, and
    hands the heap's free pages back; the copies are made again when requests come."""
    import engines.builtin
    from engines.llama import blocks_weights

    released = []
    monkeypatch.setattr(engines.builtin, "release_free_heap", lambda: released.append(1))

    dtype = next((d for d in (torch.bfloat16, torch.float32) if blocks_weights(torch.device("cpu"), d)), None)
    if dtype is None:
        pytest.skip("this CPU keeps F.linear in both precisions: the engine keeps no blocked copies")
    engine = BuiltinEngine(model, max_batch=2, max_len=48, dtype=dtype)
    engine.release_when_idle = True  # as a cache of IDLE_RELEASE_BYTES or more would
    done = engine.generate([Request(0, [5, 6, 7], SamplingParams(max_new_tokens=4))])
    assert len(done[0].token_ids) == 4 and engine.k_cache is None and engine.model.blocked == {}
    # and glibc handed their pages back (heap.py): dropped alone, most would stay resident
    assert released == [1]
    engine.add(Request(1, [5, 6, 7], SamplingParams(max_new_tokens=4)))
    engine.step()
    assert engine.k_cache is not None and engine.model.blocked
