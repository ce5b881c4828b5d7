"""LoRA training: only the adapters learn, the reference is the base with them off, engines and checkpoints
get W + (alpha / r) B A, and a checkpoint's adapter reloads onto the base."""
import pytest
import torch
from transformers import AutoModelForCausalLM

import algos
from runtime.schema import LoraConfig, RolloutConfig, TrainConfig
from tests.test_trainer import _groups
from trainer.batch import pack
from trainer.learner import Learner
from trainer.lora import ADAPTER_DIR, adapters_off, add_adapters, merged
from trainer.policy import full_state

LORA = LoraConfig(rank=4, alpha=8.0)


def _learner(model_dir, algo="tb", lora=LORA, init_path="", autocast="none"):
    train = TrainConfig(batch_groups=2, micro_tokens=0, lr=1e-2, autocast=autocast, lora=lora)
    return Learner(model_path=model_dir, train=train, algo=algos.get(algo).Config(), init_path=init_path,
                   rollout=RolloutConfig(group_size=3, max_new_tokens=6, temperature=1.0))


def _inputs(batch):
    return batch.input_ids, batch.position_ids, batch.segments, batch.gather, batch.targets, 1.0


def _perturb_adapters(lm):
    with torch.no_grad():
        for name, p in lm.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05)  # peft starts B at 0, which would make every merge the identity


def test_merged_weights_equal_peft_merge_under_the_engine_names(tiny_model_dir):
    from peft import LoraConfig as PeftLoraConfig
    from peft import get_peft_model

    lm = add_adapters(AutoModelForCausalLM.from_pretrained(tiny_model_dir), LORA, torch.float32)
    _perturb_adapters(lm)
    ours = dict(merged(((k.removeprefix("lm."), v) for k, v in lm.state_dict().items()), lm))
    reference = AutoModelForCausalLM.from_pretrained(tiny_model_dir)
    names = set(reference.state_dict())
    peft = get_peft_model(reference, PeftLoraConfig(r=4, lora_alpha=8.0, target_modules="all-linear"))
    peft.load_state_dict({"base_model.model." + k: v for k, v in lm.state_dict().items()})
    expected = peft.merge_and_unload().state_dict()
    assert set(ours) == names  # what the weight store and the engines expect, no adapter names
    for name in names:
        torch.testing.assert_close(ours[name], expected[name], atol=1e-6, rtol=0)
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    assert any(not torch.equal(ours[name], base[name]) for name in names)  # the merge did something


def test_only_adapters_learn_and_the_reference_is_the_base(tiny_model_dir):
    learner = _learner(tiny_model_dir)
    trainable = {n for n, p in learner.policy.named_parameters() if p.requires_grad}
    assert trainable and all("lora_" in n for n in trainable)
    assert sum(len(g["params"]) for g in learner.optimizer.param_groups) == len(trainable)
    _perturb_adapters(learner.policy.lm)
    before = {n: p.detach().clone() for n, p in learner.policy.named_parameters()}
    batch = pack(_groups())
    with torch.no_grad():
        ref = learner.reference(*_inputs(batch))
        policy = learner.policy(*_inputs(batch))
        plain = type(learner.policy)(AutoModelForCausalLM.from_pretrained(tiny_model_dir))(*_inputs(batch))
    torch.testing.assert_close(ref, plain, atol=1e-5, rtol=0)  # the reference: the base, adapters off
    assert not torch.allclose(policy, ref, atol=1e-4)  # the policy: the base with its adapters
    learner.step(batch, 1)
    for name, p in learner.policy.named_parameters():
        assert torch.equal(p, before[name]) != (name in trainable), name  # adapters moved, nothing else did


def test_the_base_is_held_in_bfloat16_when_the_trainer_computes_in_bf16(tiny_model_dir):
    learner = _learner(tiny_model_dir, algo="grpo", autocast="bfloat16")
    dtypes = {p.dtype for n, p in learner.policy.named_parameters() if "lora_" not in n}
    assert dtypes == {torch.bfloat16}
    assert {p.dtype for p in learner.optimizer.param_groups[0]["params"]} == {torch.float32}
    assert learner.reference is None  # grpo uses none: nothing extra held
    learner.step(pack(_groups()), 1)


def test_a_checkpoint_is_the_merged_model_and_its_adapter_resumes(tiny_model_dir, tmp_path, monkeypatch):
    from peft import PeftModel

    import trainer.checkpoint as checkpoint

    monkeypatch.setattr(checkpoint.dist, "get_rank", lambda: 0)
    learner = _learner(tiny_model_dir)
    _perturb_adapters(learner.policy.lm)
    learner.step(pack(_groups()), 1)
    path = checkpoint.save_checkpoint(learner.policy, tiny_model_dir, str(tmp_path), 1)
    saved = AutoModelForCausalLM.from_pretrained(path).state_dict()
    published = dict(full_state(learner.policy))
    assert set(saved) == set(published)
    for name, tensor in published.items():  # what the engines get is what the checkpoint holds
        torch.testing.assert_close(saved[name], tensor, atol=1e-6, rtol=0)
    base_plus_adapter = PeftModel.from_pretrained(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                                                  f"{path}/{ADAPTER_DIR}").merge_and_unload().state_dict()
    for name, tensor in saved.items():
        torch.testing.assert_close(base_plus_adapter[name], tensor, atol=1e-6, rtol=0)

    resumed = _learner(tiny_model_dir, init_path=path)
    batch = pack(_groups(seed=1))
    with torch.no_grad():
        torch.testing.assert_close(resumed.policy(*_inputs(batch)), learner.policy(*_inputs(batch)),
                                   atol=1e-6, rtol=0)
        # the reference stays the base, not the merged checkpoint
        torch.testing.assert_close(resumed.reference(*_inputs(batch)), learner.reference(*_inputs(batch)),
                                   atol=1e-6, rtol=0)


def test_adapters_off_restores_training_mode(tiny_model_dir):
    lm = add_adapters(AutoModelForCausalLM.from_pretrained(tiny_model_dir), LORA, torch.float32)
    with adapters_off(lm):
        assert not any(p.requires_grad for p in lm.parameters())
    assert all(p.requires_grad == ("lora_" in n) for n, p in lm.named_parameters())


def test_unknown_target_modules_are_one_line(tiny_model_dir):
    with pytest.raises(ValueError, match=r"train.lora.target_modules=\['nope'\]"):
        add_adapters(AutoModelForCausalLM.from_pretrained(tiny_model_dir),
                     LoraConfig(rank=2, target_modules=["nope"]), torch.float32)


def test_a_lora_run_trains_publishes_merged_weights_and_checkpoints_the_adapter(tiny_model_dir, tmp_path):
    import json

    from tests.helpers import TINY, run_train

    result = run_train(tmp_path, f"model.path={tiny_model_dir}", *TINY, "steps=2", "algo=tb",
                       "train.lora.rank=4", "train.lr=1e-2", "rollout.dtype=float32", "train.autocast=none",
                       "max_staleness=0", "task.reward=tests.toy_rewards:length_parity")
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 2]
    # step 2 trains on tokens sampled after step 1's merged weights reached the engine
    fresh = [r["mismatch/abs_logprob_diff"] for r in rows if "mismatch/abs_logprob_diff" in r]
    assert fresh and max(fresh) < 1e-4
    step = tmp_path / "checkpoints" / "step_2"
    assert (step / ADAPTER_DIR / "adapter_model.safetensors").exists()
    merged_model = AutoModelForCausalLM.from_pretrained(step).state_dict()
    base = AutoModelForCausalLM.from_pretrained(tiny_model_dir).state_dict()
    moved = [n for n in base if not torch.equal(base[n], merged_model[n])]
    assert moved and all(n.endswith("proj.weight") for n in moved)  # only adapted weights, lr 1e-2 moved them


def test_the_gpu_weight_path_plans_the_merged_weights_a_lora_policy_streams(tiny_model_dir):
    """GPUWeights plans its buckets from what the policy will stream (merged weights, each bias before its
    weight), not from the raw peft state dict: a LoRA policy's publish reaches a built-in engine whole."""
    import functools
    import multiprocessing as mp
    import threading

    from engines.buckets import WeightChannel
    from engines.builtin import BuiltinEngine, BuiltinEngineSpec
    from engines.weight_sync import GPUWeights, receive_version
    from trainer.policy import TokenLogprobs

    policy = TokenLogprobs(add_adapters(AutoModelForCausalLM.from_pretrained(tiny_model_dir), LORA,
                                        torch.float32))
    _perturb_adapters(policy.lm)
    assert any(".base_layer." in n for n in policy.state_dict())  # peft's names are not what gets streamed
    engine = BuiltinEngine(AutoModelForCausalLM.from_pretrained(tiny_model_dir), max_batch=4, max_len=32,
                           seed=0)
    path = GPUWeights(WeightChannel(1, mp.get_context("spawn")), [1], BuiltinEngineSpec.bucket_payloads,
                      "ipc", 1 << 14, torch.float32)
    try:
        path.follower(engine, 0)
        # fails, not hangs, if cut
        sync = functools.partial(receive_version, engine, path.channel, 0, timeout_s=30)
        publish = path.publisher(policy, True, None)
        errors = []

        def ship():
            try:
                publish(full_state(policy), 1)
            except Exception as e:  # the test's thread: surface it below
                errors.append(e)

        shipping = threading.Thread(target=ship)
        shipping.start()
        while engine.version < 1 and shipping.is_alive():
            sync()
        shipping.join()
        assert not errors, errors[0]
        assert engine.version == 1
        expected = dict(full_state(policy))
        for name, tensor in engine.weight_tensors().items():
            torch.testing.assert_close(tensor, expected[name], atol=1e-6, rtol=0)
    finally:
        path.channel.close()
