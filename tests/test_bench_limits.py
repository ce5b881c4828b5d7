"""The limits the benchmarks hold the engine to: compute from the matmul peak, memory from the bytes a decode
step reads (bench/generate.py), and the copy bandwidth they come from (bench/common.py)."""
from types import SimpleNamespace

import pytest
import torch

from bench.common import copy_bandwidth
from bench.generate import limits


def test_the_memory_limit_counts_the_weights_once_and_every_sequence_s_cache():
    config = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=1, hidden_size=8, num_attention_heads=2)
    prompts = [[1] * 10, [1] * 30]  # mean prompt 20; 40 tokens generated, 20 each, 10 cached on average
    compute, memory = limits(config, params=1000, prompts=prompts, new_tokens=20, tokens=40,
                             dtype=torch.bfloat16, peak=4e6, bandwidth=1e6)
    weights, _ = limits(config, 1000, prompts, 20, 40, torch.bfloat16, 4e6, 1e6, attention=False)
    assert weights == pytest.approx(4e6 / 2000 * 40 / (40 + 40))  # 40 generated and 10 + 30 prefilled tokens
    # Attention's two matmuls, 4 x 2 layers x 2 heads x head_dim 4 = 64 FLOPs a position attended: 40
    # generated tokens at the mean context of 30, and the prompts' tokens causally (1 + ... + 10
    # and 1 + ... + 30 positions).
    flops = 2 * 1000 * (40 + 40) + 64 * (40 * 30 + 55 + 465)
    assert compute == pytest.approx(4e6 * 40 / flops)
    kv_per_token = 2 * 2 * 1 * 4 * 2  # K and V, layers, kv heads, head dim, bytes
    step_bytes = 1000 * 2 + 2 * 30 * kv_per_token
    assert memory == pytest.approx(2 * 1e6 / step_bytes)
    _, memory32 = limits(config, 1000, prompts, 20, 40, torch.float32, 4e6, 1e6)
    assert memory32 == pytest.approx(memory / 2)  # twice the bytes a step


def test_copy_bandwidth_is_a_plausible_rate():
    assert 1e8 < copy_bandwidth(megabytes=16, repeats=2) < 1e13


def test_slots_fewer_than_prompts_read_the_cache_of_the_slots_only():
    config = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=1, hidden_size=8, num_attention_heads=2)
    prompts = [[1] * 10, [1] * 30] * 4  # 8 requests through 2 slots, 20 tokens each
    compute, memory = limits(config, 1000, prompts, 20, 160, torch.bfloat16, 4e6, 1e6, slots=2,
                             attention=False)
    assert compute == pytest.approx(4e6 / 2000 * 160 / (160 + 40))  # a repeated prompt is prefilled once
    kv_per_token = 2 * 2 * 1 * 4 * 2
    assert memory == pytest.approx(2 * 1e6 / (1000 * 2 + 2 * 30 * kv_per_token))  # as 2 prompts in 2 slots


@pytest.mark.parametrize("native, expected", [(True, ["fp32", "bf16"]), (False, ["fp32"])])
def test_the_benches_run_bf16_only_where_the_cpu_has_it_unless_asked(monkeypatch, native, expected):
    import launch.plan
    from bench.common import bench_dtypes

    monkeypatch.setattr(launch.plan, "native_bf16", lambda plan: native)
    assert bench_dtypes("auto") == expected
    assert bench_dtypes("fp32,bf16") == ["fp32", "bf16"]  # asked for: run as asked
    with pytest.raises(SystemExit, match="--dtypes 'fp16'"):
        bench_dtypes("fp16")


def test_the_head_logits_comparison_alternates_three_ways_and_leaves_the_default(tiny_model_dir, monkeypatch):
    """bench/train_step.py --head-logits both: steps alternate between the frozen head's forward-made
    direction, kept and recomputed logits on one learner; the defaults are back in place after."""
    from transformers import AutoTokenizer

    import bench.train_step as train_step
    from trainer.head import _HeadLogprob

    seen = []
    step = train_step.Learner.step
    monkeypatch.setattr(train_step.Learner, "step", lambda self, *a: seen.append(
        (_HeadLogprob.FROZEN_DIRECTION, _HeadLogprob.KEEP_LOGITS_BYTES)) or step(self, *a))
    keep = _HeadLogprob.KEEP_LOGITS_BYTES
    medians = train_step.head_logits(tiny_model_dir, AutoTokenizer.from_pretrained(tiny_model_dir), False, 2,
                                     "grpo", 8)
    assert set(medians) == {"direction", "keep", "recompute"} and min(medians.values()) > 0
    d, k, r = (True, keep), (False, keep), (False, 0)
    assert seen == [d, k, r, d, k, r, r, k, d]  # a warm-up each, then in order, then in reverse
    assert (_HeadLogprob.FROZEN_DIRECTION, _HeadLogprob.KEEP_LOGITS_BYTES) == (True, keep)


def test_the_frozen_embeddings_comparison_alternates_two_learners(tiny_model_dir, monkeypatch):
    """bench/train_step.py --freeze-embeddings both: two learners, one with frozen embeddings, steps
    alternating."""
    from transformers import AutoTokenizer

    import bench.train_step as train_step

    seen = []
    step = train_step.Learner.step
    monkeypatch.setattr(train_step.Learner, "step", lambda self, *a: seen.append(
        (self.train.freeze_embeddings, self.policy.lm.get_input_embeddings().weight.requires_grad))
        or step(self, *a))
    ratio = train_step.freeze_embeddings(tiny_model_dir, AutoTokenizer.from_pretrained(tiny_model_dir), False,
                                         2, "grpo", 8)
    assert ratio > 0
    frozen, trained = (True, False), (False, True)
    assert seen == [frozen, trained, frozen, trained, trained, frozen]


def test_the_attention_comparison_alternates_the_ways_on_one_learner_and_restores_the_trainer_s(
        tiny_model_dir, monkeypatch, capsys):
    """bench/train_step.py --attention matmuls,dense: steps alternate between the ways; the trainer's settings
    after."""
    from transformers import AutoTokenizer

    import bench.train_step as train_step
    import trainer.attention as attention

    as_run = attention.MIN_ROW, attention.MATMUL_ROW, attention.MATMUL_DTYPES
    seen, learners = [], set()
    step = train_step.Learner.step
    monkeypatch.setattr(train_step.Learner, "step", lambda self, *a: learners.add(id(self)) or seen.append(
        (attention.MIN_ROW, attention.MATMUL_ROW, torch.float32 in attention.MATMUL_DTYPES))
        or step(self, *a))
    monkeypatch.setattr(train_step, "matmul_peak_flops", lambda dtype: 1e15)  # not timed here
    medians = train_step.attention_ways(tiny_model_dir, AutoTokenizer.from_pretrained(tiny_model_dir), False,
                                        2, "grpo", 8, ["matmuls", "dense", "segments"])
    assert set(medians) == {"matmuls", "dense", "segments"} and min(medians.values()) > 0
    matmuls, dense, segments = (1 << 62, 1 << 62, True), (1 << 62, 0, False), (0, as_run[1], False)
    # a warm-up each, then the ways in order and in reverse
    assert seen == [matmuls, dense, segments, matmuls, dense, segments, segments, dense, matmuls]
    assert len(learners) == 1
    assert (attention.MIN_ROW, attention.MATMUL_ROW, attention.MATMUL_DTYPES) == as_run
    line = capsys.readouterr().out
    assert line.startswith("fp32") \
        and all(f"{way} {medians[way]:.2f} s/step (MFU " in line for way in medians)


def test_each_engine_run_is_held_to_the_higher_peak_on_either_side_of_it(monkeypatch):
    """bench.generate --repeats: run i's limits come from max(peak before it, peak after it) and the same of
    the copy bandwidth, never from a reading around another run."""
    import bench.generate as generate

    peaks, rates = iter([4e6, 2e6, 8e6, 1e6]), iter([100.0, 50.0, 300.0])
    monkeypatch.setattr(generate, "matmul_peak_flops", lambda dtype: next(peaks))
    monkeypatch.setattr(generate, "run_engine", lambda *a, **k: (40, 40 / next(rates)))
    bandwidths = iter([2e9, 0.5e9, 3e9])  # read after each run; the bench read 1e9 before the first
    monkeypatch.setattr(generate, "copy_bandwidth", lambda: next(bandwidths))
    config = SimpleNamespace(num_hidden_layers=2, num_key_value_heads=1, hidden_size=8, num_attention_heads=2)
    args = SimpleNamespace(repeats=3, new_tokens=20, ignore_eos=True, sequences=2)
    runs = generate.engine_runs(SimpleNamespace(config=config), [[1] * 10, [1] * 30], args, None,
                                torch.bfloat16, params=1000, bandwidth=1e9)
    assert [r.peak for r in runs] == [4e6, 8e6, 8e6]
    assert [r.bandwidth for r in runs] == [2e9, 2e9, 3e9]
    for rate, at, compute, memory, peak, tokens, at_weights, bandwidth in runs:
        assert memory \
            == pytest.approx(generate.limits(config, 1000, [[1] * 10, [1] * 30], 20, 40, torch.bfloat16,
                                             peak, bandwidth, slots=2)[1])
        assert compute == pytest.approx(peak * 40 / (2000 * 80 + 64 * (40 * 30 + 55 + 465))) \
            and compute < memory
        assert at == pytest.approx(rate / compute) and tokens == 40  # compute is the lower limit here
        assert at_weights == pytest.approx(rate / (peak / 2000 * 40 / 80)) and at_weights < at


def test_the_decode_attention_bench_times_the_engine_s_split_path_and_holds_it_to_float64(capsys):
    """bench/decode_attention.py: every way is timed, and the engine's two-matmul path (engines/llama.py) and
    the fused kernel stay within bf16's rounding of a float64 attention over the visible positions only."""
    from bench.decode_attention import main

    us, errors = main(["--sequences", "4", "--width", "48", "--visible", "40", "--layers", "2",
                       "--rounds", "2"])
    assert set(us) == {"read", "matmuls", "fused"} and all(t > 0 for t in us.values())
    assert set(errors) == {"matmuls", "fused"} and all(e < 0.02 for e in errors.values())
    assert f"matmuls_vs_read={us['matmuls'] / us['read']:.2f}" in capsys.readouterr().out
