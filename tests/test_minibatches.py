"""train.minibatches, train.epochs and the off-policy diagnostics: the Learner against loops written out by
hand."""
import math

import pytest
import torch
from transformers import AutoModelForCausalLM

import algos
from buffer.ring import Group
from runtime.schema import RolloutConfig, TrainConfig
from trainer.batch import pack
from trainer.diagnostics import OffPolicyStats
from trainer.learner import Learner
from trainer.policy import TokenLogprobs

K, STEPS = 3, 6


def _groups(count, seed=0, versions=0):
    """`count` groups of K random completions; behaviour logprobs are junk filled in by `_behaviour`."""
    g = torch.Generator().manual_seed(seed)
    groups = []
    for index in range(count):
        lens = torch.randint(1, STEPS + 1, (K,), generator=g)
        ids = torch.zeros(K, STEPS, dtype=torch.long)
        for i in range(K):
            ids[i, : lens[i]] = torch.randint(3, 1000, (int(lens[i]),), generator=g)
        groups.append(Group(
            prompt_ids=torch.randint(3, 1000, (int(torch.randint(3, 8, (1,), generator=g)),), generator=g),
            completion_ids=ids, completion_lens=lens, logprobs=torch.zeros(K, STEPS),
            versions=torch.full((K, STEPS), versions, dtype=torch.long), rewards=torch.rand(K, generator=g),
            truncated=torch.zeros(K, dtype=torch.bool), prompt_index=index, group_id=index, worker_id=0))
    return groups


def _inputs(batch, temperature=1.0):
    return batch.input_ids, batch.position_ids, batch.segments, batch.gather, batch.targets, temperature


def _behaviour(model_dir, batch, noise=0.3, seed=1):
    """Behaviour logprobs: the initial model's, plus noise (the engine sampled with other weights)."""
    policy = TokenLogprobs(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32))
    with torch.no_grad():
        exact = policy(*_inputs(batch))
    g = torch.Generator().manual_seed(seed)
    batch.behav_logprobs = (exact + noise * torch.randn(exact.shape, generator=g)) * batch.mask
    return exact


def _learner(model_dir, algo, minibatches, lr=1e-2, rollout=None, epochs=1, entropy_coef=0.0):
    train = TrainConfig(batch_groups=4, minibatches=minibatches, epochs=epochs, micro_tokens=0, lr=lr,
                        grad_clip=1.0, autocast="none", entropy_coef=entropy_coef)
    return Learner(model_path=model_dir, train=train, algo=algo,
                   rollout=rollout or RolloutConfig(group_size=K, max_new_tokens=STEPS, temperature=1.0))


def _hand_loop(model_dir, batch, algo, minibatches, lr=1e-2, epochs=1, entropy_coef=0.0):
    """What train.minibatches = M and train.epochs = E mean, written out: proximal logprobs of every minibatch
    at the starting weights (with M = 1, the first forward's own), then E times over the minibatches a
    forward, the rule's loss normalised by that minibatch (and train.entropy_coef's - coef x its token-mean
    entropy), clip, AdamW; the embeddings (and the head tied to them) frozen, as train.freeze_embeddings'
    default."""
    policy = TokenLogprobs(AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32))
    policy.lm.get_input_embeddings().requires_grad_(False)
    optimizer = torch.optim.AdamW([p for p in policy.parameters() if p.requires_grad], lr=lr,
                                  weight_decay=0.0, fused=True)
    loss_fn = algos.get(algo.name).Loss(algo)
    size = batch.num_groups // minibatches
    parts = [batch.groups(i, i + size) for i in range(0, batch.num_groups, size)]
    prox = [None]
    if minibatches > 1:
        with torch.no_grad():
            prox = [policy(*_inputs(p)) for p in parts]
    for _ in range(epochs):
        for i, part in enumerate(parts):
            out = policy(*_inputs(part), bool(entropy_coef), bool(entropy_coef))
            logprobs, entropy = out if entropy_coef else (out, None)
            if prox[i] is None:
                prox[i] = logprobs.detach()
            loss, _ = loss_fn(algos.MicroBatch(
                logprobs=logprobs, behav_logprobs=part.behav_logprobs, mask=part.mask, rewards=part.rewards,
                group_size=K, batch_sequences=part.targets.shape[0], batch_tokens=int(part.mask.sum()),
                max_new_tokens=STEPS, step=0, prox_logprobs=prox[i]))
            if entropy_coef:
                loss = loss - entropy_coef * (entropy * part.mask).sum() / part.mask.sum()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(policy.parameters(), 1.0)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
    return {n: p.detach() for n, p in policy.named_parameters()}


@pytest.mark.parametrize("minibatches,epochs", [(1, 1), (2, 1), (4, 1), (1, 2), (2, 3)])
def test_minibatch_steps_match_the_hand_written_loop(tiny_model_dir, minibatches, epochs):
    batch = pack(_groups(4))
    _behaviour(tiny_model_dir, batch)
    algo = algos.get("ppo").Config()
    want = _hand_loop(tiny_model_dir, batch, algo, minibatches, epochs=epochs)
    learner = _learner(tiny_model_dir, algo, minibatches, epochs=epochs)
    metrics = learner.step(batch, 1)
    got = dict(learner.policy.named_parameters())
    for name, value in want.items():
        # one minibatch: the very same operations, bit for bit; more: the same maths in another pass order
        if minibatches == 1:
            assert torch.equal(got[name], value), name
        else:
            assert torch.allclose(got[name], value, atol=1e-6, rtol=1e-5), name
    start = dict(TokenLogprobs(AutoModelForCausalLM.from_pretrained(tiny_model_dir)).named_parameters())
    # the steps moved them
    assert sum(not torch.equal(got[name], start[name]) for name in want) > len(want) // 2
    assert metrics["train/tokens"] == epochs * batch.num_tokens  # the tokens the learner computed


@pytest.mark.parametrize("minibatches,coef", [(1, -0.5), (2, 0.3)])
def test_an_entropy_term_matches_the_hand_written_loop(tiny_model_dir, minibatches, coef):
    """train.entropy_coef: each minibatch's loss gets - coef x its token-mean entropy, with the gradient; the
    steps are the hand loop's with that term, not those without it, and `loss/entropy` is the term (at M = 1,
    the entropy of the weights before the step)."""
    batch = pack(_groups(4))
    _behaviour(tiny_model_dir, batch)
    algo = algos.get("ppo").Config()
    want = _hand_loop(tiny_model_dir, batch, algo, minibatches, entropy_coef=coef)
    without = _hand_loop(tiny_model_dir, batch, algo, minibatches)
    learner = _learner(tiny_model_dir, algo, minibatches, entropy_coef=coef)
    metrics = learner.step(batch, 1)
    got = dict(learner.policy.named_parameters())
    for name, value in want.items():
        assert torch.allclose(got[name], value, atol=1e-6, rtol=1e-5), name
    assert sum(not torch.allclose(want[name], without[name], atol=1e-4) for name in want) > len(want) // 2
    if minibatches == 1:
        with torch.no_grad():
            _, entropy = TokenLogprobs(AutoModelForCausalLM.from_pretrained(tiny_model_dir))(
                *_inputs(batch), True)
        term = -coef * float((entropy * batch.mask).sum() / batch.mask.sum())
        assert metrics["loss/entropy"] == pytest.approx(term, rel=1e-5) and abs(term) > 0.1


def test_four_minibatches_separate_the_three_policies(tiny_model_dir):
    """Decoupled PPO with M = 4: after the first update, current != proximal != behaviour, and the ratio
    clips."""
    batch = pack(_groups(4))
    _behaviour(tiny_model_dir, batch)
    learner = _learner(tiny_model_dir, algos.get("ppo").Config(), minibatches=4, lr=0.05)
    seen, loss_fn = [], learner.loss_fn

    def recording(mb):
        seen.append((mb.logprobs.detach().clone(), mb.prox_logprobs.clone(), mb.behav_logprobs.clone(),
                     mb.mask))
        return loss_fn(mb)

    learner.loss_fn = recording
    learner.loss_fn.needs_proximal = True
    metrics = learner.step(batch, 1)
    assert len(seen) == 4
    current, prox, behav, mask = seen[0]
    assert torch.equal(current * mask, prox * mask)  # the first minibatch runs on the proximal weights
    for current, prox, behav, mask in seen[1:]:
        on = mask.bool()
        assert (current - prox)[on].abs().min() > 0 and (prox - behav)[on].abs().min() > 0
    assert metrics["ppo/clip_frac"] > 0
    assert metrics["ppo/clip_frac"] \
        == pytest.approx(metrics["ppo/clip_frac_low"] + metrics["ppo/clip_frac_high"])


def test_one_minibatch_has_no_clipping_and_no_extra_pass(tiny_model_dir):
    batch = pack(_groups(4))
    _behaviour(tiny_model_dir, batch)
    learner = _learner(tiny_model_dir, algos.get("ppo").Config(), minibatches=1, lr=0.05)
    calls = []
    learner.policy.register_forward_hook(lambda *args: calls.append(1))
    metrics = learner.step(batch, 1)
    assert len(calls) == 1 and metrics["ppo/clip_frac"] == 0.0


def test_a_second_epoch_clips_against_the_first_forward_and_adds_no_pass(tiny_model_dir):
    """Decoupled PPO with M = 1, E = 2: the first epoch runs on the proximal weights (its forward is pi_prox,
    no extra pass), the second on weights one update on, so its ratio leaves 1 and clips; metrics are the
    means."""
    batch = pack(_groups(4))
    _behaviour(tiny_model_dir, batch)
    learner = _learner(tiny_model_dir, algos.get("ppo").Config(), minibatches=1, lr=0.05, epochs=2)
    calls, seen, loss_fn = [], [], learner.loss_fn
    learner.policy.register_forward_hook(lambda *args: calls.append(1))

    def recording(mb):
        seen.append((mb.logprobs.detach().clone(), mb.prox_logprobs.clone(), mb.mask))
        loss, metrics = loss_fn(mb)
        seen[-1] += (metrics["ppo/clip_frac"],)
        return loss, metrics

    learner.loss_fn = recording
    learner.loss_fn.needs_proximal = True
    metrics = learner.step(batch, 1)
    assert len(calls) == 2 and len(seen) == 2
    (first, prox1, mask, clip1), (second, prox2, _, clip2) = seen
    assert torch.equal(prox1, prox2) and torch.equal(first * mask, prox1 * mask)
    assert (second - prox2)[mask.bool()].abs().min() > 0
    assert clip1 == 0.0 and clip2 > 0
    assert metrics["ppo/clip_frac"] == pytest.approx((clip1 + clip2) / 2)


def test_minibatches_must_divide_the_batch_and_the_ranks():
    from runtime.schema import ClusterConfig, Config

    with pytest.raises(ValueError, match=r"config key 'train.minibatches' must divide train.batch_groups=8"):
        TrainConfig(batch_groups=8, minibatches=3).check()
    with pytest.raises(ValueError, match=r"config key 'train.epochs' must be >= 1"):
        TrainConfig(epochs=0).check()
    cfg = Config(train=TrainConfig(batch_groups=4, minibatches=4), cluster=ClusterConfig(trainer_ranks=2,
                                                                                        oversubscribe=True))
    with pytest.raises(ValueError,
                       match=r"must be divisible by cluster.trainer_ranks=2 times train.minibatches=4"):
        cfg.check()


# ---- diagnostics ----

def test_off_policy_stats_match_hand_computed_sums():
    train = torch.tensor([[-1.0, -2.0, -0.5], [-0.3, -1.2, 0.0]])
    behav = torch.tensor([[-1.1, -1.5, -0.5], [-0.2, -1.0, -9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 1.0, 0.0]])
    versions = torch.tensor([[4, 4, 3], [2, 4, 4]])
    entropy = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 99.0]])
    stats = OffPolicyStats(version=4)
    stats.add(train, behav, mask, versions, entropy)
    fresh, old = [(0, 0), (0, 1), (1, 1)], [(0, 2), (1, 0)]

    def mean(f, cells):
        return sum(f(train[i, t].item() - behav[i, t].item()) for i, t in cells) / len(cells)

    k3 = lambda d: math.exp(d) - 1 - d  # noqa: E731
    w = [math.exp(train[i, t].item() - behav[i, t].item()) for i, t in fresh + old]
    got = stats.metrics()
    assert got["mismatch/abs_logprob_diff"] == pytest.approx(mean(abs, fresh))
    assert got["mismatch/kl"] == pytest.approx(mean(k3, fresh))
    assert got["offpolicy/abs_logprob_diff"] == pytest.approx(mean(abs, old))
    assert got["offpolicy/kl"] == pytest.approx(mean(k3, old))
    assert got["offpolicy/ess"] == pytest.approx(sum(w) ** 2 / (5 * sum(x * x for x in w)))
    assert got["offpolicy/fresh_frac"] == pytest.approx(3 / 5)
    assert got["policy/entropy"] == pytest.approx(3.0)
    only_fresh = OffPolicyStats(version=4)
    only_fresh.add(train, behav, mask, torch.full_like(versions, 4), entropy)
    assert "offpolicy/kl" not in only_fresh.metrics() and "mismatch/kl" in only_fresh.metrics()


def test_head_entropy_is_the_entropy_of_the_full_softmax(tiny_model_dir):
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    batch = pack(_groups(2))
    logprobs, entropy = TokenLogprobs(model)(*_inputs(batch, 0.7), entropy=True)
    assert torch.equal(logprobs, TokenLogprobs(model)(*_inputs(batch, 0.7)))
    row = 0
    g = batch.groups(0, 1)
    c = g.targets[row, : int(g.mask[row].sum())]
    ids = torch.cat([g.input_ids[0][g.segments[0] == 0], c])[None]
    prompt = int((g.segments[0] == 0).sum())
    logits = model(input_ids=ids).logits[0, prompt - 1: -1] / 0.7
    want = torch.distributions.Categorical(logits=logits).entropy()
    assert torch.allclose(entropy[row, : len(c)], want, atol=1e-5)


def test_mismatch_is_zero_when_the_engine_sampled_with_the_trainers_weights(tiny_model_dir):
    """Fresh tokens whose behaviour logprobs are the trainer's own: no mismatch; marked older: the off-policy
    keys."""
    for minibatches in (1, 2):
        batch = pack(_groups(4))
        batch.behav_logprobs = _behaviour(tiny_model_dir, batch, noise=0.0)
        metrics = _learner(tiny_model_dir, algos.get("grpo").Config(), minibatches).step(batch, 1)
        assert metrics["mismatch/abs_logprob_diff"] < 1e-6 and abs(metrics["mismatch/kl"]) < 1e-9
        assert metrics["offpolicy/ess"] == pytest.approx(1.0) and metrics["offpolicy/fresh_frac"] == 1.0
        assert "offpolicy/kl" not in metrics and metrics["policy/entropy"] > 0
    stale = pack(_groups(4, versions=0))
    _behaviour(tiny_model_dir, stale, noise=0.3)
    metrics = _learner(tiny_model_dir, algos.get("grpo").Config(), 1).step(stale, 3)  # holds version 2
    assert "mismatch/kl" not in metrics and metrics["offpolicy/kl"] > 0 and metrics["offpolicy/ess"] < 1


def test_rules_without_a_proximal_policy_still_get_it_per_batch(tiny_model_dir):
    """tb with M = 2: one extra no-grad pass feeds the diagnostics; the rule itself asks for no proximal."""
    batch = pack(_groups(4))
    _behaviour(tiny_model_dir, batch)
    learner = _learner(tiny_model_dir, algos.get("tb").Config(), minibatches=2)
    metrics = learner.step(batch, 1)
    assert not learner.loss_fn.needs_proximal and "mismatch/kl" in metrics and math.isfinite(metrics["loss"])


def test_kept_and_dropped_groups_are_described_apart():
    from trainer.row_metrics import kept_and_dropped

    kept, dropped = _groups(2, seed=3), _groups(1, seed=4)
    got = kept_and_dropped(kept, dropped)
    lens = [int(n) for g in kept for n in g.completion_lens]
    assert got["staleness/kept_len"] == pytest.approx(sum(lens) / len(lens))
    assert got["staleness/dropped_reward"] == pytest.approx(dropped[0].rewards.mean().item())
    assert "staleness/dropped_len" not in kept_and_dropped(kept, [])


def test_adamw_state_is_made_before_the_first_step_and_changes_nothing(tiny_model_dir):
    learner = _learner(tiny_model_dir, algos.get("grpo").Config(), minibatches=1)
    fresh = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    for name, p in fresh.named_parameters():
        assert torch.equal(learner.policy.lm.get_parameter(name), p), name  # a step at lr 0 moved nothing
    for group in learner.optimizer.param_groups:
        assert group["lr"] == 1e-2
        for p in group["params"]:
            state = learner.optimizer.state[p]
            assert p.grad is None and float(state["step"]) == 0.0
            assert not state["exp_avg"].any() and not state["exp_avg_sq"].any()


def test_warmup_ramps_the_learning_rate_and_adam_takes_its_betas_and_eps(tiny_model_dir):
    batch = pack(_groups(4))
    _behaviour(tiny_model_dir, batch)
    algo = algos.get("ppo").Config()
    want = _hand_loop(tiny_model_dir, batch, algo, 1, lr=1e-2 / 4)  # step 1 of a 3-step warm-up: lr / 4
    train = TrainConfig(batch_groups=4, micro_tokens=0, lr=1e-2, grad_clip=1.0, autocast="none",
                        warmup_steps=3, adam_beta1=0.8, adam_beta2=0.99, adam_eps=1e-6)
    learner = Learner(model_path=tiny_model_dir, train=train, algo=algo,
                      rollout=RolloutConfig(group_size=K, max_new_tokens=STEPS, temperature=1.0))
    group = learner.optimizer.param_groups[0]
    assert group["betas"] == (0.8, 0.99) and group["eps"] == 1e-6
    assert [learner.learning_rate(s) for s in (1, 2, 3, 4, 50)] == [2.5e-3, 5e-3, 7.5e-3, 1e-2, 1e-2]
    train.decay_steps, train.min_lr = 4, 2e-3  # then down to 2e-3 over steps 5-8, and held
    assert [learner.learning_rate(s) for s in (3, 4, 5, 6, 8, 9, 50)] == pytest.approx(
        [7.5e-3, 1e-2, 8e-3, 6e-3, 2e-3, 2e-3, 2e-3], abs=1e-12)
    train.warmup_steps = 0  # without a warm-up the decay starts at step 1
    assert [learner.learning_rate(s) for s in (1, 3, 5, 6)] \
        == pytest.approx([1e-2, 6e-3, 2e-3, 2e-3], abs=1e-12)
    train.warmup_steps, train.decay_steps = 3, 0
    train.adam_beta1, train.adam_beta2, train.adam_eps = 0.9, 0.999, 1e-8  # as the hand loop's AdamW
    learner = Learner(model_path=tiny_model_dir, train=train, algo=algo,
                      rollout=RolloutConfig(group_size=K, max_new_tokens=STEPS, temperature=1.0))
    metrics = learner.step(batch, 1)
    assert metrics["train/lr"] == 2.5e-3
    got = dict(learner.policy.named_parameters())
    for name, value in want.items():
        assert torch.equal(got[name], value), name
