"""GSPO and CISPO against references written here with plain Python loops from the papers' equations."""
import dataclasses
import math

import pytest
import torch

import algos
from tests.test_algos import (
    KINDS,
    LENGTHS,
    REWARDS,
    T,
    assert_close,
    correction_reference,
    group_adv,
    make_mb,
    off_policy_mb,
    ppo_token,
    rows,
    run,
)

GSPO, CISPO = algos.get("gspo"), algos.get("cispo")


# ---- GSPO ----

def gspo_reference(mb, lo, hi, scale=True, c=None):
    """s_i = exp(mean_t log pi/pi_prox); l_i = -cbar_i min(s A, clip(s) A), each token's gradient weighted by
    its own c_it (GSPO-token); L = sum_i l_i / n. Also the sequences the clip cuts (s below lo with A < 0,
    above hi with A > 0) and the mean s."""
    lp, old_lp, n = rows(mb, "logprobs"), rows(mb, "prox_logprobs"), len(mb.rewards)
    adv = group_adv(mb.rewards.tolist(), scale)
    loss, grad, cut, ratios = 0.0, [[0.0] * T for _ in range(n)], 0, []
    for i in range(n):
        length = LENGTHS[i]
        s = math.exp(sum(lp[i][t] - old_lp[i][t] for t in range(length)) / length)
        ratios.append(s)
        weight = [c[i][t] if c is not None else 1.0 for t in range(length)]
        seq_loss, d_log_s = ppo_token(s, adv[i], lo, hi)  # d/d(log s_i); d log s_i / d logp_it = 1/|y_i|
        loss += sum(weight) / length * seq_loss / n
        for t in range(length):
            grad[i][t] = weight[t] * d_log_s / length / n
        cut += (s < lo and adv[i] < 0) or (s > hi and adv[i] > 0)
    return loss, grad, cut, sum(ratios) / n


@pytest.mark.parametrize("cfg", [{}, {"clip_eps": 0.05, "clip_eps_high": 0.08}, {"scale_std": False}])
def test_gspo_matches_reference(cfg):
    mb = make_mb(REWARDS)
    lo, hi = 1 - cfg.get("clip_eps", 3e-4), 1 + cfg.get("clip_eps_high", 4e-4)
    want_loss, want_grad, cut, ratio_mean = gspo_reference(mb, lo, hi, scale=cfg.get("scale_std", True))
    loss, grad, metrics = run(GSPO, mb, **cfg)
    assert_close(loss, grad, want_loss, want_grad)
    trained = [i for i in range(len(grad)) if any(grad[i])]
    assert 0 < cut < len(grad) and trained  # both branches of min(): sequences cut and sequences trained
    assert metrics["gspo/clip_frac"] == pytest.approx(cut / len(grad))
    assert metrics["gspo/ratio_mean"] == pytest.approx(ratio_mean)
    assert metrics["gspo/clip_frac_low"] + metrics["gspo/clip_frac_high"] == pytest.approx(cut / len(grad))


def test_gspo_ratio_is_per_sequence_not_per_token():
    """One token far off-policy moves its whole sequence's ratio by 1/|y_i| of its log-ratio, and every token
    of the sequence gets the same gradient."""
    mb = make_mb(REWARDS)
    with torch.no_grad():
        mb.logprobs[0] = mb.prox_logprobs[0]
        mb.logprobs[0, 1] += math.log(1.0001 ** 4)  # s_0 = 1.0001: inside (1 - 3e-4, 1 + 4e-4)
    _, grad, _ = run(GSPO, mb)
    assert grad[0][0] != 0.0 and grad[0] == pytest.approx([grad[0][0]] * LENGTHS[0], rel=1e-12)


def test_gspo_takes_its_ratio_against_the_proximal_policy_not_the_engine_s():
    """The first update of a batch: the trainer's weights are pi_prox, so every s_i is 1 and nothing is
    clipped, however far the engine's logprobs are from the trainer's (before, the ratio was taken against
    pi_behav and this engine-trainer mismatch alone clipped sequences)."""
    mb = make_mb(REWARDS)
    with torch.no_grad():
        mb.logprobs.copy_(mb.prox_logprobs)  # behav differs from both by 0.3 x N(0, 1) a token
    assert GSPO.Loss(GSPO.Config()).needs_proximal
    _, grad, metrics = run(GSPO, mb)
    assert metrics["gspo/clip_frac"] == 0.0 and metrics["gspo/ratio_mean"] == pytest.approx(1.0, abs=1e-12)
    assert all(any(row) for row, r in zip(grad, REWARDS) if r != sum(REWARDS) / len(REWARDS))


@pytest.mark.parametrize("kind", KINDS)
def test_gspo_with_correction_weights_each_token_by_its_own_correction(kind):
    mb = off_policy_mb()
    c = correction_reference(mb, kind)
    want_loss, want_grad, _, _ = gspo_reference(mb, 0.95, 1.08, c=c)
    assert GSPO.Loss(GSPO.Config(correction=kind)).needs_proximal
    loss, grad, metrics = run(GSPO, mb, correction=kind, clip_eps=0.05, clip_eps_high=0.08)
    assert_close(loss, grad, want_loss, want_grad)
    assert any(k.startswith("correction/") for k in metrics)


def test_gspo_gives_no_gradient_to_a_token_its_correction_drops():
    """mis_token drops token (0, 0) (weight 3 > 2): it gets no gradient, while the other tokens of its
    sequence do (before, the correction was folded into one weight per sequence, and the dropped token was
    trained)."""
    mb = off_policy_mb()
    with torch.no_grad():
        mb.logprobs.copy_(mb.prox_logprobs)  # inside the clip: every sequence with an advantage trains
    _, grad, _ = run(GSPO, mb, correction="mis_token")
    assert grad[0][0] == 0.0 and all(g != 0.0 for g in grad[0][1:LENGTHS[0]])


# ---- CISPO ----

def cispo_reference(mb, lo, hi, scale=True, old="behav_logprobs", c=None):
    """L = -sum_it sg[clip(r_it, lo, hi)] A_i log pi(y_it) / batch_tokens; and the tokens clipped at the
    top."""
    lp, old_lp, n = rows(mb, "logprobs"), rows(mb, old), len(mb.rewards)
    adv = group_adv(mb.rewards.tolist(), scale)
    loss, grad, top, weights = 0.0, [[0.0] * T for _ in range(n)], 0, []
    for i in range(n):
        for t in range(LENGTHS[i]):
            r = math.exp(lp[i][t] - old_lp[i][t])
            w = min(max(r, lo), hi)
            weights.append(w)
            top += r > hi
            ci = c[i][t] if c is not None else 1.0
            loss += -ci * w * adv[i] * lp[i][t] / mb.batch_tokens
            grad[i][t] = -ci * w * adv[i] / mb.batch_tokens  # w is a constant: d/dlogp of w A logp = w A
    return loss, grad, top, sum(weights) / len(weights)


def far_off_policy_mb():
    """Ratios of 8 (above 1 + 4) and 0.01 (below 1 - 0.2) on tokens with non-zero advantage."""
    mb = make_mb(REWARDS)
    with torch.no_grad():
        mb.logprobs[1, 0] = mb.behav_logprobs[1, 0] + math.log(8.0)
        mb.logprobs[4, 2] = mb.behav_logprobs[4, 2] + math.log(0.01)
    return mb


@pytest.mark.parametrize("cfg", [{}, {"clip_eps": 0.2, "clip_eps_high": 0.2}, {"scale_std": False}])
def test_cispo_matches_reference(cfg):
    mb = far_off_policy_mb()
    lo, hi = 1 - cfg.get("clip_eps", 1.0), 1 + cfg.get("clip_eps_high", 4.0)
    want_loss, want_grad, top, weight_mean = cispo_reference(mb, lo, hi, scale=cfg.get("scale_std", True))
    loss, grad, metrics = run(CISPO, mb, **cfg)
    assert_close(loss, grad, want_loss, want_grad)
    assert top >= 1 and metrics["cispo/weight_clipped_frac"] == pytest.approx(top / mb.batch_tokens)
    assert metrics["cispo/weight_mean"] == pytest.approx(weight_mean)


def test_cispo_clipped_tokens_keep_their_gradient_at_the_bound():
    """Unlike the PPO clip (zero gradient once cut), a clipped token trains with its weight held
    at 1 + eps_high."""
    mb = far_off_policy_mb()
    adv = group_adv(REWARDS, scale=True)
    _, grad, _ = run(CISPO, mb)
    assert grad[1][0] == pytest.approx(-5.0 * adv[1] / mb.batch_tokens, rel=1e-12) and grad[1][0] != 0.0
    grpo_mb = far_off_policy_mb()
    _, grpo_grad, _ = run(algos.get("grpo"), grpo_mb)
    assert grpo_grad[1][0] == 0.0  # the same token under GRPO's clip: dropped


@pytest.mark.parametrize("kind", KINDS)
def test_cispo_with_correction_uses_proximal_and_weights_each_token(kind):
    mb = off_policy_mb()
    c = correction_reference(mb, kind)
    want_loss, want_grad, _, _ = cispo_reference(mb, 0.8, 1.2, old="prox_logprobs", c=c)
    assert CISPO.Loss(CISPO.Config(correction=kind)).needs_proximal \
        and not CISPO.Loss(CISPO.Config()).needs_proximal
    loss, grad, _ = run(CISPO, mb, correction=kind, clip_eps=0.2, clip_eps_high=0.2)
    assert_close(loss, grad, want_loss, want_grad)


# ---- both ----

BOTH = [("gspo", {}), ("gspo", {"clip_eps": 0.05, "clip_eps_high": 0.08}), ("gspo", {"correction": "tis"}),
        ("gspo", {"correction": "mis_seq", "clip_eps": 0.05}), ("cispo", {}),
        ("cispo", {"clip_eps": 0.2, "clip_eps_high": 0.2}), ("cispo", {"correction": "mis_token"})]


def extreme_mb(dtype, sign, masked_only=False):
    """Log-ratios of +-100 against behav (and prox) in padding, and (unless masked_only) in two length-1
    rows."""
    mb = make_mb([0.0, 1.0, 0.0, 1.0, 0.0, 0.0, 0.2, 0.9, 0.4])
    lp = mb.logprobs.detach().clone()
    prox = mb.prox_logprobs.clone()
    for i, t, s in [(1, 2, 1), (1, 3, -1), (3, 2, 1), (3, 3, -1), (8, 1, -1), (8, 3, 1)]:  # padding
        lp[i, t] = mb.behav_logprobs[i, t] + 100.0 * s * sign
        prox[i, t] = mb.behav_logprobs[i, t]
    if not masked_only:
        for i, s in [(3, 1), (8, -1)]:  # rows of length 1: the token's log-ratio is the sequence's
            lp[i, 0] = mb.behav_logprobs[i, 0] + 100.0 * s * sign
            prox[i, 0] = mb.behav_logprobs[i, 0]
    cast = lambda x: x.to(dtype)  # noqa: E731
    return dataclasses.replace(mb, logprobs=cast(lp).requires_grad_(True),
                               behav_logprobs=cast(mb.behav_logprobs), mask=cast(mb.mask),
                               rewards=cast(mb.rewards), ref_logprobs=cast(mb.ref_logprobs),
                               prox_logprobs=cast(prox))


@pytest.mark.parametrize("name,cfg", BOTH)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("sign", [1, -1])
def test_log_ratios_of_a_hundred_give_a_finite_loss_and_gradient(name, cfg, dtype, sign):
    module = algos.get(name)
    mb = extreme_mb(dtype, sign)
    loss, metrics = module.Loss(module.Config(**cfg))(mb)
    loss.backward()
    assert math.isfinite(loss.item()) and torch.isfinite(mb.logprobs.grad).all()
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    assert (mb.logprobs.grad * (1 - mb.mask) == 0).all()  # padding never gets a gradient


@pytest.mark.parametrize("name,cfg", BOTH)
def test_garbage_in_padding_changes_nothing(name, cfg):
    module = algos.get(name)
    clean = extreme_mb(torch.float32, 1, masked_only=True)
    with torch.no_grad():
        for field in (clean.logprobs, clean.prox_logprobs):
            field.copy_(torch.where(clean.mask > 0, field, clean.behav_logprobs))
    dirty = extreme_mb(torch.float32, 1, masked_only=True)
    losses = []
    for mb in (clean, dirty):
        loss, _ = module.Loss(module.Config(**cfg))(mb)
        loss.backward()
        losses.append(loss.item())
    assert losses[0] == losses[1]
    assert torch.equal(clean.logprobs.grad, dirty.logprobs.grad)


@pytest.mark.parametrize("name,cfg", BOTH)
def test_metrics_are_namespaced_floats(name, cfg):
    _, _, metrics = run(algos.get(name), make_mb(REWARDS), **cfg)
    assert f"loss/{name}" in metrics and f"{name}/adv_abs_mean" in metrics
    for key, value in metrics.items():
        assert type(value) is float and math.isfinite(value), key
        assert key.split("/")[0] in ("loss", name) + (("correction",) if "correction" in cfg else ()), key


BAD = [("gspo", "clip_eps", 0.0), ("gspo", "clip_eps", 1.0), ("gspo", "clip_eps_high", 0.0),
       ("gspo", "correction", "is"), ("gspo", "mis_high", 1.0),
       ("cispo", "clip_eps", 0.0), ("cispo", "clip_eps", 1.5), ("cispo", "clip_eps_high", -0.1),
       ("cispo", "tis_cap", 0.0), ("cispo", "correction", "seq")]


@pytest.mark.parametrize("name,key,value", BAD)
def test_config_check_names_the_bad_key(name, key, value):
    module = algos.get(name)
    module.Config().check()
    with pytest.raises(ValueError, match=rf"config key 'algo\.{key}' must .*\(got {value!r}\)"):
        module.Config(**{key: value}).check()


def test_cispo_allows_no_lower_bound():
    CISPO.Config(clip_eps=1.0).check()


@pytest.mark.parametrize("name, defaults", [("gspo", {"clip_eps": 3e-4, "clip_eps_high": 4e-4}),
                                            ("cispo", {"clip_eps": 1.0, "clip_eps_high": 4.0})])
def test_registry_preset_and_defaults(name, defaults):
    from launch.config import compose, parse

    assert name in algos.names()
    module = algos.get(name)
    fields = dataclasses.fields(module.Config)
    assert fields[0].name == "name" and module.Config().name == name
    assert all(getattr(module.Config(), k) == v for k, v in defaults.items())
    loss_fn = module.Loss(module.Config())
    # GSPO's ratio is against the proximal policy, with or without a correction; CISPO's only with one
    assert loss_fn.needs_reference is False and loss_fn.needs_proximal is (name == "gspo")
    assert parse(compose([f"algo={name}"])).algo == module.Config()  # no preset: the registry selects it
