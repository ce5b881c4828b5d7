"""Reward-model tasks on tiny models the tests build: preference (RM score) and red-teaming
(victim + classifier)."""
import json

import pytest
import torch

from tests.helpers import TINY, run_train


def _classifier(tmp_path_factory, tokenizer_dir, labels):
    from transformers import AutoTokenizer, LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(labels)
    config = LlamaConfig(vocab_size=49152, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, head_dim=16, num_labels=labels,
                         pad_token_id=2, eos_token_id=2, bos_token_id=1)
    out = tmp_path_factory.mktemp(f"classifier{labels}")
    LlamaForSequenceClassification(config).save_pretrained(out)
    AutoTokenizer.from_pretrained(tokenizer_dir).save_pretrained(out)
    return str(out)


@pytest.fixture(scope="module")
def reward_model_dir(tmp_path_factory, tokenizer_dir):
    return _classifier(tmp_path_factory, tokenizer_dir, 1)


@pytest.fixture(scope="module")
def toxicity_dir(tmp_path_factory, tokenizer_dir):
    return _classifier(tmp_path_factory, tokenizer_dir, 2)


def test_reward_model_scores_are_deterministic_and_depend_on_the_text(reward_model_dir, toxicity_dir):
    from rewards import get_reward

    rm = get_reward("reward_model", model_path=reward_model_dir, label=0)
    a, b = rm("a short summary", "the post"), rm("something else entirely, longer", "the post")
    assert a == rm("a short summary", "the post") and a != b
    prob = get_reward("reward_model", model_path=toxicity_dir, label=1)("some reply", "")
    assert 0.0 < prob < 1.0
    with pytest.raises(ValueError, match="label 5"):
        get_reward("reward_model", model_path=toxicity_dir, label=5)


def test_redteam_diversity_penalises_a_repeated_attack(tiny_model_dir, toxicity_dir):
    from rewards import get_reward

    plain = get_reward("redteam", victim_path=tiny_model_dir, classifier_path=toxicity_dir, label=1,
                       victim_max_new_tokens=4, diversity=0.0)
    diverse = get_reward("redteam", victim_path=tiny_model_dir, classifier_path=toxicity_dir, label=1,
                         victim_max_new_tokens=4, diversity=0.5)
    attack = "Tell me what you really think about cooking"
    base = plain(attack)
    assert diverse(attack) == pytest.approx(base)  # nothing seen yet
    assert diverse(attack) == pytest.approx(base - 0.5)  # identical to the last attack
    assert plain(attack) == pytest.approx(base)


@pytest.mark.slow  # a long end-to-end run: CI's suite must stay under 15 minutes on 2 cores
def test_preference_task_trains(tiny_model_dir, reward_model_dir, tmp_path):
    data = tmp_path / "tldr.jsonl"
    data.write_text("".join(json.dumps({"subreddit": "cooking", "title": f"Dinner {i}",
                                        "post": f"I made pasta {i} times this week and it was fine."}) + "\n"
                            for i in range(10)))
    run_dir = tmp_path / "run"
    result = run_train(run_dir, f"model.path={tiny_model_dir}", "task=preference", f"task.path={data}",
                       f"task.reward_model={reward_model_dir}", "task.test_size=2", "steps=2", *TINY)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    assert rows[-1]["reward/errors"] == 0 and rows[-1]["reward/timeouts"] == 0


@pytest.mark.slow  # a long end-to-end run: CI's suite must stay under 15 minutes on 2 cores
def test_redteam_task_trains(tiny_model_dir, toxicity_dir, tmp_path):
    result = run_train(tmp_path, f"model.path={tiny_model_dir}", "task=redteam",
                       f"task.victim_model={tiny_model_dir}", f"task.classifier={toxicity_dir}",
                       "task.victim_max_new_tokens=4", "task.diversity=0.2", "steps=2", *TINY)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2] and 0 < rows[0]["reward_mean"] < 1
    assert rows[-1]["reward/errors"] == 0


def test_reward_model_tasks_need_their_models(tmp_path):
    result = run_train(tmp_path, "task=preference", "task.path=x.jsonl", timeout=60)
    assert result.returncode == 2 and "task.reward_model' is required" in result.stderr
