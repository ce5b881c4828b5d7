"""The models ringrl runs: Qwen3 and Llama 3.x on the engine's fast path, every other causal LM on the
fallback, each against the Hugging Face forward; the trainer on any of them; refusals at start; chat-template
options."""
import json

import pytest
import torch
from transformers import AutoConfig

from engines.arch import engine_path
from engines.base import Request, SamplingParams
from engines.builtin import BuiltinEngine
from engines.hf import HFForward
from engines.llama import Llama
from tests.test_engine import assert_matches_teacher_forced, check_an_in_flight_weight_load, random_prompts
from tests.test_trainer import check_packed_equals_separate
from tests.tiny_models import FALLBACK, FAST, tiny_config, tiny_model
from trainer.policy import decoder_layers

FORWARD = {**{kind: Llama for kind in FAST}, **{kind: HFForward for kind in FALLBACK}}


@pytest.mark.parametrize("kind", FAST + FALLBACK)
def test_sampled_logprobs_match_the_hf_forward(kind):
    model = tiny_model(kind)
    engine = BuiltinEngine(model, max_batch=3, max_len=64)  # fewer slots than requests: slots get refilled
    assert type(engine.model) is FORWARD[kind]
    prompts = random_prompts([1, 5, 17, 9, 30, 2], vocab=512)
    prompts.append(prompts[2])  # a repeated prompt shares one prefill
    requests = [Request(i, p, SamplingParams(temperature=(0.7, 1.0)[i % 2], top_p=0.9 if i == 3 else 1.0,
                                             max_new_tokens=4 + 2 * i)) for i, p in enumerate(prompts)]
    for request, completion in zip(requests, engine.generate(requests)):
        assert len(completion.token_ids) == request.params.max_new_tokens
        assert_matches_teacher_forced(model, completion, request.params.temperature)


def test_the_fallback_samples_what_the_fast_path_samples(model_kind="qwen3"):
    model = tiny_model(model_kind)
    prompts = random_prompts([3, 12, 7, 12], vocab=512)
    requests = [Request(i, p, SamplingParams(temperature=0.9, max_new_tokens=9))
                for i, p in enumerate(prompts)]
    fast = BuiltinEngine(model, max_batch=2, max_len=32, seed=4)
    slow = BuiltinEngine(model, max_batch=2, max_len=32, seed=4, fallback=True)
    assert type(fast.model) is Llama and type(slow.model) is HFForward
    for a, b in zip(fast.generate(requests), slow.generate(requests)):
        assert a.token_ids == b.token_ids
        torch.testing.assert_close(torch.tensor(a.logprobs), torch.tensor(b.logprobs), atol=1e-4, rtol=0)


@pytest.mark.parametrize("kind", ["qwen3", "gpt_neox"])
def test_greedy_logits_match_the_hf_forward(kind):
    model = tiny_model(kind)
    engine = BuiltinEngine(model, max_batch=2, max_len=48)
    [prompt] = random_prompts([7], vocab=512)
    [completion] = engine.generate([Request(0, prompt, SamplingParams(temperature=0, max_new_tokens=10))])
    with torch.no_grad():
        logits = model(torch.tensor([prompt + completion.token_ids])).logits[0]
    assert completion.token_ids == logits[len(prompt) - 1:-1].argmax(-1).tolist()


@pytest.mark.parametrize("kind", ["qwen3", "llama3", "gpt_neox", "phi"])
def test_decoding_across_an_in_flight_weight_load(kind):
    check_an_in_flight_weight_load(tiny_model(kind, seed=0), tiny_model(kind, seed=1), vocab=512)


@pytest.mark.parametrize("kind", FAST + FALLBACK)
def test_the_trainer_matches_separate_sequences_on_every_family(kind):
    model = tiny_model(kind, vocab=1024)
    assert len(decoder_layers(model)) == 2
    grads = check_packed_equals_separate(model)
    if kind == "phi":  # an output head with a bias, trained through the fused log-prob head
        assert model.get_output_embeddings().bias is not None and grads["lm_head.bias"].abs().sum() > 0


def test_paths_and_refusals_are_decided_from_the_config():
    assert engine_path(tiny_config("qwen3")) == ("fast", "Qwen3ForCausalLM")
    assert engine_path(tiny_config("llama3")) == ("fast", "LlamaForCausalLM")
    assert engine_path(tiny_config("gpt_neox")) == ("fallback", "GPTNeoXForCausalLM")
    assert engine_path(tiny_config("phi")) == ("fallback", "PhiForCausalLM")
    with pytest.raises(ValueError, match="t5 model .* not a causal LM"):
        engine_path(AutoConfig.for_model("t5"))
    with pytest.raises(ValueError, match="final_logit_softcapping=30"):
        engine_path(AutoConfig.for_model("gemma2", final_logit_softcapping=30.0))
    gemma3 = AutoConfig.for_model("gemma3_text", final_logit_softcapping=None, num_hidden_layers=6)
    with pytest.raises(ValueError, match="sliding_attention layers"):
        engine_path(gemma3)
    # a window as long as every sequence is full attention; a shorter one is not
    for kind in ("mistral", "phi3"):
        windowed = AutoConfig.for_model(kind, sliding_window=64)
        assert engine_path(windowed, max_len=64)[0] == ("fast" if kind == "mistral" else "fallback")
        with pytest.raises(ValueError, match="sliding window of 64 tokens < max_len=65"):
            engine_path(windowed, max_len=65)


def test_stop_tokens_come_from_generation_config_too(tmp_path, tiny_model_dir):
    import shutil

    from models.facts import stop_ids

    shutil.copytree(tiny_model_dir, tmp_path / "m")
    assert stop_ids(str(tmp_path / "m")) == (2,)
    (tmp_path / "m" / "generation_config.json").write_text(json.dumps({"eos_token_id": [2, 7]}))
    assert stop_ids(str(tmp_path / "m")) == (2, 7)


THINKING_TEMPLATE = ("{% for m in messages %}<|{{ m.role }}|>{{ m.content }}\n{% endfor %}"
                     "{% if add_generation_prompt %}<|assistant|>{% if enable_thinking is defined and "
                     "not enable_thinking %}<think></think>{% endif %}{% endif %}")


def test_chat_template_options_reach_every_prompt(tmp_path, tiny_model_dir):
    from transformers import AutoTokenizer

    import tasks

    tokenizer = AutoTokenizer.from_pretrained(tiny_model_dir)
    tokenizer.chat_template = THINKING_TEMPLATE
    tokenizer.save_pretrained(tmp_path)
    plain = tasks.prompt_ids(tasks.load_tokenizer(str(tmp_path)), "2+2?")
    off = tasks.prompt_ids(tasks.load_tokenizer(str(tmp_path), {"enable_thinking": False}), "2+2?")
    assert tokenizer.decode(plain).endswith("<|assistant|>")
    assert tokenizer.decode(off).endswith("<|assistant|><think></think>")


def _run(tmp_path, model_dir, *overrides):
    from tests.helpers import TINY, run_train

    return run_train(tmp_path / "run", f"model.path={model_dir}", *TINY, *overrides)


def _rows(run_dir):
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.parametrize("kind, line", [("qwen3", "engine: fast path (Qwen3ForCausalLM)"),
                                        ("gpt_neox", "engine: fallback (GPTNeoXForCausalLM)")])
def test_a_tiny_model_trains_on_its_path_and_the_engine_logprobs_match_the_trainer(tmp_path, tokenizer_dir,
                                                                                   kind, line):
    from tests.tiny_models import save_tiny

    model_dir = save_tiny(kind, str(tmp_path / kind), tokenizer_dir)
    result = _run(tmp_path, model_dir, "steps=2", "rollout.dtype=float32", "train.autocast=none",
                  "checkpoint.at_end=false")
    assert result.returncode == 0, result.stderr[-3000:]
    assert line in result.stderr.splitlines()
    rows = _rows(tmp_path / "run")
    assert [r["step"] for r in rows] == [1, 2] and "eval_pass@1" in rows[-1]
    # tokens the trainer's own version sampled: engine and trainer hold the same fp32 weights
    assert rows[0]["mismatch/abs_logprob_diff"] < 1e-4


def test_a_model_that_is_not_a_causal_lm_stops_at_start_in_one_line(tmp_path, tokenizer_dir):
    from transformers import AutoTokenizer, T5Config, T5ForConditionalGeneration

    folder = tmp_path / "t5"
    T5ForConditionalGeneration(T5Config(vocab_size=64, d_model=16, d_ff=32, num_layers=1, num_heads=2,
                                        d_kv=8)).save_pretrained(folder)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(folder)
    result = _run(tmp_path, str(folder), "steps=2")
    assert result.returncode == 2
    assert result.stderr.strip().splitlines() == [
        "error: model.path is a t5 model (T5ForConditionalGeneration), not a causal LM: ringrl trains "
        "decoder-only models that AutoModelForCausalLM loads (Llama, Qwen, Mistral, Gemma, Phi, ...)"]
    assert not (tmp_path / "run" / "metrics.jsonl").exists()  # nothing started
