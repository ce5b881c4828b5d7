"""The embedded model end to end: a short run on every CI pass, the full default run under `-m slow`."""
import json

import pytest

from tests.helpers import run_train


def _rewards(run_dir):
    with open(run_dir / "metrics.jsonl") as f:
        return [json.loads(line)["reward_mean"] for line in f]


def test_real_model_short_run_checkpoint_loads_and_generates(tmp_path):
    result = run_train(tmp_path, "steps=2", "train.batch_groups=2", "rollout.max_new_tokens=8",
                       "eval.max_examples=4", timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert len(_rewards(tmp_path)) == 2

    from transformers import AutoModelForCausalLM, AutoTokenizer

    checkpoint = tmp_path / "checkpoints" / "step_2"
    model = AutoModelForCausalLM.from_pretrained(checkpoint)
    tokenizer = AutoTokenizer.from_pretrained(checkpoint)
    text = tokenizer.apply_chat_template([{"role": "user", "content": "What is 2 + 3?"}], tokenize=False,
                                         add_generation_prompt=True)
    ids = tokenizer(text, return_tensors="pt").input_ids
    reply = tokenizer.decode(model.generate(ids, max_new_tokens=12, do_sample=False)[0, ids.shape[1]:])
    assert reply.strip(), "the checkpoint generated nothing"


@pytest.mark.slow
def test_default_run_learns(tmp_path):
    """Issue 2's bar: the last quarter's mean reward is at least 0.15 above the first quarter's."""
    result = run_train(tmp_path, timeout=1500)
    assert result.returncode == 0, result.stderr[-3000:]
    rewards = _rewards(tmp_path)
    quarter = len(rewards) // 4
    first, last = sum(rewards[:quarter]) / quarter, sum(rewards[-quarter:]) / quarter
    assert last - first >= 0.15, (first, last)
