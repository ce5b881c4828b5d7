"""train.skip_tied_groups: a group whose K rewards all tie is left out of the learner's passes where the rule
gives it zero advantage, and the step is the one the whole batch would have made."""
import pytest
import torch

import algos
from buffer.ring import Group
from runtime.schema import RolloutConfig, TrainConfig
from tests.test_trainer import random_group
from trainer.batch import pack
from trainer.learner import Learner

K = 3


def _groups(rewards: list[list[float]], seed=0) -> list[Group]:
    g = torch.Generator().manual_seed(seed)
    return [random_group(g, index, 4 + index, K, group_rewards, behaviour=True)
            for index, group_rewards in enumerate(rewards)]


def test_untied_keeps_the_groups_with_a_spread_topped_up_to_a_multiple_of_the_ranks():
    def batch(*tied):
        return pack(_groups([[1.0] * K if t else [0.0, 1.0, 0.5] for t in tied]))

    assert batch(False, True, False, True).untied(1) == [0, 2]
    assert batch(False, True, False, True).untied(2) == [0, 2]
    assert batch(True, False, True, True).untied(2) == [0, 1]  # the first tied one makes up the pair
    assert batch(True, True, True, True).untied(1) == [0]  # a step still runs: its gradient is zero
    assert batch(True, True, True, True).untied(2) == [0, 1]
    assert batch(False, False, False, False).untied(4) == [0, 1, 2, 3]
    nan = pack(_groups([[float("nan")] * K, [1.0] * K]))
    assert nan.untied(1) == [0]  # NaN ties nothing: a poisoned group reaches the loss, which skips the step


def test_take_gives_the_groups_that_slicing_gives():
    batch = pack(_groups([[0.0, 1.0, 0.5], [1.0] * K, [0.0] * K, [0.2, 0.1, 0.0]]))
    for a, b in ((batch.take([1, 2]), batch.groups(1, 3)), (batch.take([3]), batch.groups(3, 4))):
        for name in ("input_ids", "position_ids", "segments", "gather", "targets", "mask", "behav_logprobs",
                     "versions", "rewards", "lens"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
    picked = batch.take([0, 3])
    assert picked.rewards.tolist() == pytest.approx([0.0, 1.0, 0.5, 0.2, 0.1, 0.0])
    assert picked.num_tokens == batch.groups(0, 1).num_tokens + batch.groups(3, 4).num_tokens


def _step(tiny_model_dir, rule: str, skip: bool, rewards, minibatches=1, **algo):
    train = TrainConfig(batch_groups=len(rewards), minibatches=minibatches, lr=1e-2, grad_clip=100.0,
                        autocast="none", freeze_embeddings=False, skip_tied_groups=skip)
    learner = Learner(model_path=tiny_model_dir, train=train, algo=algos.get(rule).Config(**algo),
                      rollout=RolloutConfig(group_size=K, max_new_tokens=6, temperature=1.0))
    metrics = learner.step(pack(_groups(rewards)), 1)
    return metrics, {n: p.detach().clone() for n, p in learner.policy.named_parameters()}


MIXED = [[0.0, 1.0, 0.0], [1.0] * K, [0.0] * K, [1.0, 0.0, 1.0]]  # groups 1 and 2 tie


@pytest.mark.parametrize("rule,minibatches,algo", [
    ("ppo", 1, {}), ("ppo", 2, {}), ("grpo", 1, {}), ("grpo", 1, {"dr_grpo": True}), ("rloo", 1, {}),
    ("cispo", 1, {}), ("gspo", 1, {}), ("grpo", 1, {"token_mean": True})])
def test_leaving_tied_groups_out_makes_the_whole_batch_s_step(tiny_model_dir, rule, minibatches, algo):
    whole, before = _step(tiny_model_dir, rule, False, MIXED, minibatches, **algo)
    skipped, after = _step(tiny_model_dir, rule, True, MIXED, minibatches, **algo)
    assert whole["train/tied_groups_skipped"] == 0 and skipped["train/tied_groups_skipped"] == 2
    assert skipped["train/tokens"] < whole["train/tokens"]
    # the same loss and gradient: the rule's denominators are the whole batch's
    assert skipped["loss"] == pytest.approx(whole["loss"], rel=1e-4, abs=1e-7)
    assert skipped["train/grad_norm"] == pytest.approx(whole["train/grad_norm"], rel=1e-4)
    assert whole["train/grad_norm"] > 0
    for name, p in before.items():
        assert torch.allclose(p, after[name], atol=1e-6), name


def test_a_batch_of_ties_runs_one_group_and_changes_nothing(tiny_model_dir):
    metrics, weights = _step(tiny_model_dir, "ppo", True, [[1.0] * K, [0.0] * K])
    assert metrics["train/tied_groups_skipped"] == 1 and metrics["train/grad_norm"] == 0.0
    fresh = Learner(model_path=tiny_model_dir, algo=algos.get("ppo").Config(),
                    train=TrainConfig(batch_groups=2, autocast="none", freeze_embeddings=False),
                    rollout=RolloutConfig(group_size=K, max_new_tokens=6))
    assert all(torch.equal(p, weights[n]) for n, p in fresh.policy.named_parameters())


@pytest.mark.parametrize("rule,algo", [("tb", {}), ("online_dpo", {}),
                                       ("grpo", {"overlong_buffer_frac": 0.5}), ("rloo", {"kl_coef": 0.1})])
def test_a_rule_that_learns_from_a_tie_trains_on_every_group(tiny_model_dir, rule, algo):
    metrics, _ = _step(tiny_model_dir, rule, True, MIXED, **algo)
    assert metrics["train/tied_groups_skipped"] == 0


def test_the_entropy_term_is_the_mean_over_the_groups_trained_on(tiny_model_dir):
    """With tied groups skipped, train.entropy_coef's term is the token-mean entropy of the groups left in:
    the batch of those groups alone gets the same term (before, the skipped groups' tokens were counted in
    its denominator, so the coefficient shrank as more groups tied)."""
    groups = _groups(MIXED)

    def step(batch, skip):
        train = TrainConfig(batch_groups=len(batch), lr=1e-2, grad_clip=100.0, autocast="none",
                            freeze_embeddings=False, skip_tied_groups=skip, entropy_coef=-0.1)
        learner = Learner(model_path=tiny_model_dir, train=train, algo=algos.get("grpo").Config(),
                          rollout=RolloutConfig(group_size=K, max_new_tokens=6, temperature=1.0))
        return learner.step(pack(batch), 1)

    skipped, alone = step(groups, True), step([groups[0], groups[3]], False)
    assert skipped["train/tied_groups_skipped"] == 2 and alone["loss/entropy"] > 0
    assert skipped["loss/entropy"] == pytest.approx(alone["loss/entropy"], rel=1e-5)


def test_a_pass_s_metrics_weigh_by_its_trained_tokens(tiny_model_dir):
    """Three passes of one group each, of different lengths: a rule's metric is their token-weighted mean
    (before, each pass weighed the same whatever its tokens)."""
    train = TrainConfig(batch_groups=3, micro_groups=1, autocast="none", freeze_embeddings=False,
                        skip_tied_groups=False)
    learner = Learner(model_path=tiny_model_dir, train=train, algo=algos.get("grpo").Config(),
                      rollout=RolloutConfig(group_size=K, max_new_tokens=6, temperature=1.0))
    rule, seen = learner.loss_fn, []

    class Probe:
        needs_reference, needs_proximal = False, False

        def __call__(self, mb):
            loss, metrics = rule(mb)
            seen.append((float(len(seen)), float(mb.mask.sum())))  # this pass's value: 0, 1, 2
            return loss, {**metrics, "probe/value": seen[-1][0]}

    learner.loss_fn = Probe()
    metrics = learner.step(pack(_groups([[0.0, 1.0, 0.5], [1.0, 0.0, 0.5], [0.2, 0.1, 0.0]])), 1)
    assert len(seen) == 3 and len({tokens for _, tokens in seen}) > 1
    want = sum(v * t for v, t in seen) / sum(t for _, t in seen)
    assert metrics["probe/value"] == pytest.approx(want) and want != pytest.approx(1.0)
