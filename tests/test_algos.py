"""Every learning rule against a reference written here with plain Python loops: loss and gradient."""
import dataclasses
import math

import pytest
import torch

import algos
from algos import MicroBatch

K, T = 3, 4
LENGTHS = [4, 2, 3, 1, 4, 3, 2, 4, 1]  # completion lengths of rows 0.. (padding after)


def turns_of(rewards):
    """Row i's episode in min(1 + i % 3, its length) turns, its tokens spread over them in order, and its
    reward split over its turns in the ratio 1 : 2 : 3: (turn_ids [n, T], turn_rewards [n, 3], turns [n])."""
    n = len(rewards)
    turns = [min(1 + i % 3, LENGTHS[i]) for i in range(n)]
    ids = [[min(t * turns[i] // LENGTHS[i], turns[i] - 1) if t < LENGTHS[i] else 0 for t in range(T)]
           for i in range(n)]
    shares = [[(k + 1) / sum(range(1, turns[i] + 1)) if k < turns[i] else 0.0 for k in range(3)]
              for i in range(n)]
    return (torch.tensor(ids), torch.tensor([[r * w for w in row] for r, row in zip(rewards, shares)],
                                            dtype=torch.float64), torch.tensor(turns))


def make_mb(rewards, seed=0, step=0, **overrides):
    """Groups of K=3 with padding; padded positions hold junk values that must not matter. Episodes of 1 to 3
    turns (turns_of)."""
    g = torch.Generator().manual_seed(seed)
    n = len(rewards)
    rand = lambda: torch.randn(n, T, generator=g, dtype=torch.float64)  # noqa: E731
    mask = torch.tensor([[1.0 if t < LENGTHS[i] else 0.0 for t in range(T)] for i in range(n)],
                        dtype=torch.float64)
    behav = -1.0 - rand().abs()
    logprobs = (behav + 0.3 * rand()).requires_grad_(True)
    fields = dict(logprobs=logprobs, behav_logprobs=behav, mask=mask,
                  rewards=torch.tensor(rewards, dtype=torch.float64), group_size=K, batch_sequences=n,
                  batch_tokens=int(mask.sum()), max_new_tokens=T, step=step,
                  ref_logprobs=behav + 0.3 * rand(), prox_logprobs=behav + 0.3 * rand())
    fields.update(zip(("turn_ids", "turn_rewards", "turns"), turns_of(rewards)))
    fields.update(overrides)
    return MicroBatch(**fields)


def rows(mb, name):
    return getattr(mb, name).detach().tolist()


def run(module, mb, **cfg):
    loss_fn = module.Loss(module.Config(**cfg))
    loss, metrics = loss_fn(mb)
    loss.backward()
    return loss.item(), mb.logprobs.grad.tolist(), metrics


def assert_close(got_loss, got_grad, want_loss, want_grad):
    assert got_loss == pytest.approx(want_loss, rel=1e-9, abs=1e-12)
    for got_row, want_row in zip(got_grad, want_grad):
        assert got_row == pytest.approx(want_row, rel=1e-9, abs=1e-12)


def split(mb, groups):
    """Groups [start, stop) of `mb` as a micro-batch that keeps the whole batch's counts."""
    s = slice(groups[0] * K, groups[1] * K)
    cut = lambda x: x[s] if x is not None else None  # noqa: E731
    leaf = mb.logprobs.detach()[s].clone().requires_grad_(True)
    return dataclasses.replace(mb, logprobs=leaf, behav_logprobs=cut(mb.behav_logprobs), mask=cut(mb.mask),
                               rewards=cut(mb.rewards), ref_logprobs=cut(mb.ref_logprobs),
                               prox_logprobs=cut(mb.prox_logprobs), turn_ids=cut(mb.turn_ids),
                               turn_rewards=cut(mb.turn_rewards), turns=cut(mb.turns))


def seq_sum(x, i):
    return sum(x[i][t] for t in range(LENGTHS[i]))


def group_adv(r, scale):
    adv = []
    for g in range(len(r) // K):
        grp = r[g * K:(g + 1) * K]
        mean = sum(grp) / K
        std = math.sqrt(sum((x - mean) ** 2 for x in grp) / (K - 1))
        adv += [(x - mean) / (std + 1e-4) if scale else x - mean for x in grp]
    return adv


def ppo_token(rho, a, lo, hi):
    """(-min(rho a, clip(rho) a), d/dlogp of it): the clipped branch has no gradient once clipped."""
    c = min(max(rho, lo), hi)
    if rho * a <= c * a or lo < rho < hi:
        return -rho * a, -rho * a
    return -c * a, 0.0


REWARDS = [0.0, 1.0, 1.0, 1.0, 0.0, 0.0]


# ---- GRPO ----

@pytest.mark.parametrize("dr_grpo", [False, True])
def test_grpo_matches_reference(dr_grpo):
    mb = make_mb(REWARDS)
    lp, bh, r = rows(mb, "logprobs"), rows(mb, "behav_logprobs"), mb.rewards.tolist()
    adv, n = group_adv(r, scale=not dr_grpo), len(r)
    want_loss, want_grad = 0.0, [[0.0] * T for _ in range(n)]
    for i in range(n):
        norm = T if dr_grpo else LENGTHS[i]
        for t in range(LENGTHS[i]):
            token_loss, d = ppo_token(math.exp(lp[i][t] - bh[i][t]), adv[i], 0.8, 1.2)
            want_loss += token_loss / norm / n
            want_grad[i][t] = d / norm / n
    loss, grad, _ = run(algos.get("grpo"), mb, dr_grpo=dr_grpo)
    assert_close(loss, grad, want_loss, want_grad)


def dual_token(rho, a, lo, hi, c):
    """ppo_token with the dual clip: for a < 0 the loss is at most -c a, and then has no gradient."""
    loss, d = ppo_token(rho, a, lo, hi)
    if a < 0 and -loss < c * a:  # the objective min(...) = -loss lies below the floor c * a
        return -c * a, 0.0
    return loss, d


@pytest.mark.parametrize("token_mean,dual_clip", [(True, 0.0), (False, 3.0), (True, 3.0)])
def test_grpo_token_mean_and_dual_clip_match_reference(token_mean, dual_clip):
    """DAPO's token-level mean (one normaliser: the batch's tokens) and dual-clip PPO (Ye et al. 2020)."""
    mb = make_mb(REWARDS, seed=1)
    with torch.no_grad():  # push a few ratios of negative-advantage rows past c = 3
        mb.logprobs[0, :2] += 1.5
        mb.logprobs[4, 0] += 2.0
    lp, bh, r = rows(mb, "logprobs"), rows(mb, "behav_logprobs"), mb.rewards.tolist()
    adv, n, tokens = group_adv(r, scale=True), len(r), sum(LENGTHS[:len(r)])
    want_loss, want_grad, cut = 0.0, [[0.0] * T for _ in range(n)], 0
    for i in range(n):
        for t in range(LENGTHS[i]):
            rho = math.exp(lp[i][t] - bh[i][t])
            token_loss, d = dual_token(rho, adv[i], 0.8, 1.2, dual_clip) if dual_clip else \
                ppo_token(rho, adv[i], 0.8, 1.2)
            cut += dual_clip > 0 and (token_loss, d) != ppo_token(rho, adv[i], 0.8, 1.2)
            norm = tokens if token_mean else LENGTHS[i] * n
            want_loss += token_loss / norm
            want_grad[i][t] = d / norm
    loss, grad, metrics = run(algos.get("grpo"), mb, token_mean=token_mean, dual_clip=dual_clip)
    assert_close(loss, grad, want_loss, want_grad)
    if dual_clip:
        assert cut > 0 and metrics["grpo/dual_clip_frac"] == pytest.approx(cut / tokens)


def test_ppo_dual_clip_caps_a_negative_advantage_s_loss():
    mb = make_mb(REWARDS, seed=1, prox_logprobs=None)
    mb.prox_logprobs = mb.behav_logprobs.clone()  # w = 1: decoupled PPO is standard PPO here
    with torch.no_grad():
        mb.logprobs[0, :2] += 1.5
    lp, bh, r = rows(mb, "logprobs"), rows(mb, "behav_logprobs"), mb.rewards.tolist()
    adv, n, tokens = group_adv(r, scale=True), len(r), sum(LENGTHS[:len(r)])
    want_loss, want_grad = 0.0, [[0.0] * T for _ in range(n)]
    for i in range(n):
        for t in range(LENGTHS[i]):
            token_loss, d = dual_token(math.exp(lp[i][t] - bh[i][t]), adv[i], 0.8, 1.2, 3.0)
            want_loss, want_grad[i][t] = want_loss + token_loss / tokens, d / tokens
    loss, grad, metrics = run(algos.get("ppo"), mb, dual_clip=3.0)
    assert_close(loss, grad, want_loss, want_grad)
    assert metrics["ppo/dual_clip_frac"] > 0


def test_overlong_shaping_is_dapo_s_linear_ramp():
    from algos.grpo import overlong_shaping

    got = overlong_shaping(torch.tensor([10, 16, 17, 18, 20, 25]), max_new_tokens=20, buffer_frac=0.2,
                           penalty=1.0)
    assert got.tolist() == pytest.approx([0.0, 0.0, -0.25, -0.5, -1.0, -1.0])


def test_grpo_overlong_penalty_enters_the_advantage():
    """Same rewards, one long completion per group: with the shaping the long ones' advantages drop, so the
    loss equals plain grpo on the shaped rewards."""
    mb = make_mb(REWARDS)
    lengths = mb.mask.sum(1)
    # max_new_tokens 4, a buffer of 2: from 0 at 2 tokens to -1 at 4
    ramp = {1: 0.0, 2: 0.0, 3: -0.5, 4: -1.0}
    shaped = mb.rewards + torch.tensor([ramp[int(n)] for n in lengths], dtype=torch.float64)
    want, _, _ = run(algos.get("grpo"), make_mb(shaped.tolist()))
    got, _, metrics = run(algos.get("grpo"), make_mb(REWARDS), overlong_buffer_frac=0.5, overlong_penalty=1.0)
    assert got == pytest.approx(want, rel=1e-12) and metrics["grpo/overlong_frac"] > 0


def test_dapo_is_grpo_with_dapo_s_defaults():
    dapo = algos.get("dapo")
    cfg = dapo.Config()
    assert (cfg.clip_eps, cfg.clip_eps_high, cfg.token_mean, cfg.overlong_buffer_frac) \
        == (0.2, 0.28, True, 0.2)
    loss, grad, metrics = run(dapo, make_mb(REWARDS))
    want, want_grad, _ = run(algos.get("grpo"), make_mb(REWARDS), clip_eps_high=0.28, token_mean=True,
                             overlong_buffer_frac=0.2)
    assert_close(loss, grad, want, want_grad)
    assert "loss/dapo" in metrics and "dapo/clip_frac" in metrics


# ---- TB ----

def tb_reference(mb, beta, length_normalize=False, normalize=True):
    lp, ref, r, n = rows(mb, "logprobs"), rows(mb, "ref_logprobs"), mb.rewards.tolist(), len(mb.rewards)
    norm = [LENGTHS[i] if length_normalize else 1 for i in range(n)]
    scale = beta * beta / 2 if normalize else 1.0
    delta = [(seq_sum(lp, i) - seq_sum(ref, i)) / norm[i] - r[i] / beta for i in range(n)]
    log_z = [-sum(delta[g * K:(g + 1) * K]) / K for g in range(n // K)]
    loss, grad = 0.0, [[0.0] * T for _ in range(n)]
    for i in range(n):
        resid = log_z[i // K] + delta[i]
        loss += scale * resid ** 2 / n
        for t in range(LENGTHS[i]):
            grad[i][t] = scale * 2 * resid / norm[i] / n  # log Z is a constant: no term through it
    return loss, grad, log_z


@pytest.mark.parametrize("length_normalize, normalize", [(False, True), (True, True), (False, False)])
def test_tb_matches_reference_with_log_z_as_minus_mean_delta(length_normalize, normalize):
    mb = make_mb(REWARDS)
    want_loss, want_grad, log_z = tb_reference(mb, 0.5, length_normalize, normalize)
    loss, grad, metrics = run(algos.get("tb"), mb, beta_start=0.5, beta_end=0.5,
                              length_normalize=length_normalize, normalize=normalize)
    assert_close(loss, grad, want_loss, want_grad)
    assert metrics["tb/log_z"] == pytest.approx(sum(log_z) / len(log_z))
    assert metrics["tb/beta"] == 0.5


def test_tb_log_z_is_per_prompt_not_per_batch():
    mb = make_mb([0.0, 1.0, 1.0, 1.0, 1.0, 1.0])
    _, _, log_z = tb_reference(mb, 1.0)
    _, metrics = algos.get("tb").Loss(algos.get("tb").Config(beta_start=1.0, beta_end=1.0))(split(mb, (1, 2)))
    assert metrics["tb/log_z"] == pytest.approx(log_z[1])


def test_tb_beta_schedule():
    tb = algos.get("tb")
    cfg = tb.Config(beta_start=1.0, beta_end=0.2, beta_steps=8)
    assert [tb.beta_at(cfg, s) for s in (0, 2, 4, 8, 100)] == pytest.approx([1.0, 0.8, 0.6, 0.2, 0.2])
    assert tb.beta_at(tb.Config(beta_start=1.0, beta_end=0.3, beta_steps=0), 0) == 0.3
    mb = make_mb(REWARDS, step=4)
    want_loss, want_grad, _ = tb_reference(mb, 0.6)
    loss, grad, metrics = run(tb, mb, beta_start=1.0, beta_end=0.2, beta_steps=8)
    assert metrics["tb/beta"] == pytest.approx(0.6)
    assert_close(loss, grad, want_loss, want_grad)


# ---- PPO ----

def ppo_reference(mb, prox, cap=5.0):
    lp, bh, n = rows(mb, "logprobs"), rows(mb, "behav_logprobs"), len(mb.rewards)
    adv = group_adv(mb.rewards.tolist(), scale=True)
    loss, grad, masked = 0.0, [[0.0] * T for _ in range(n)], 0
    for i in range(n):
        for t in range(LENGTHS[i]):
            w = math.exp(prox[i][t] - bh[i][t])
            if w > cap:
                masked += 1
                continue
            token_loss, d = ppo_token(math.exp(lp[i][t] - prox[i][t]), adv[i], 0.8, 1.2)
            loss += w * token_loss / mb.batch_tokens
            grad[i][t] = w * d / mb.batch_tokens
    return loss, grad, masked


def test_ppo_decoupled_matches_reference_and_masks_capped_weights():
    mb = make_mb(REWARDS)
    mb.prox_logprobs[1, 1] = mb.behav_logprobs[1, 1] + math.log(10.0)  # w = 10 > cap 5
    mb.prox_logprobs[1, 3] = mb.behav_logprobs[1, 3] + math.log(10.0)  # padding: neither used nor counted
    want_loss, want_grad, masked = ppo_reference(mb, rows(mb, "prox_logprobs"))
    assert masked == 1
    loss, grad, metrics = run(algos.get("ppo"), mb)
    assert_close(loss, grad, want_loss, want_grad)
    assert grad[1][1] == 0.0
    assert metrics["ppo/behav_weight_masked_frac"] == pytest.approx(1 / mb.batch_tokens)


def test_ppo_decoupled_with_prox_equal_behaviour_is_standard_ppo():
    ppo = algos.get("ppo")
    assert ppo.Loss(ppo.Config(decoupled=True)).needs_proximal
    assert not ppo.Loss(ppo.Config(decoupled=False)).needs_proximal
    same = make_mb(REWARDS)
    same = dataclasses.replace(same, prox_logprobs=same.behav_logprobs.clone())
    loss_a, grad_a, _ = run(ppo, same, decoupled=True)
    standard = make_mb(REWARDS, prox_logprobs=None)
    loss_b, grad_b, _ = run(ppo, standard, decoupled=False)
    assert loss_a == loss_b and grad_a == grad_b
    want_loss, want_grad, _ = ppo_reference(standard, rows(standard, "behav_logprobs"))
    assert_close(loss_b, grad_b, want_loss, want_grad)


# ---- RLOO ----

@pytest.mark.parametrize("kl_coef", [0.0, 0.5])
def test_rloo_leave_one_out_matches_reference(kl_coef):
    mb = make_mb([0.0, 1.0, 0.5, 1.0, 0.0, 0.0])
    lp, bh, ref, n = rows(mb, "logprobs"), rows(mb, "behav_logprobs"), rows(mb, "ref_logprobs"), 6
    r = [mb.rewards[i].item() - kl_coef * (seq_sum(bh, i) - seq_sum(ref, i)) for i in range(n)]
    want_loss, want_grad = 0.0, [[0.0] * T for _ in range(n)]
    for i in range(n):
        g = i // K
        others = [r[j] for j in range(g * K, g * K + K) if j != i]
        adv = r[i] - sum(others) / len(others)
        want_loss += -adv * seq_sum(lp, i) / n
        for t in range(LENGTHS[i]):
            want_grad[i][t] = -adv / n
    rloo = algos.get("rloo")
    assert rloo.Loss(rloo.Config(kl_coef=kl_coef)).needs_reference == (kl_coef > 0)
    loss, grad, metrics = run(rloo, mb, kl_coef=kl_coef)
    assert_close(loss, grad, want_loss, want_grad)
    assert ("rloo/kl" in metrics) == (kl_coef > 0)


# ---- online DPO ----

def dpo_reference(mb, beta, loss_type):
    lp, ref, r, n = rows(mb, "logprobs"), rows(mb, "ref_logprobs"), mb.rewards.tolist(), len(mb.rewards)
    loss, grad, skipped = 0.0, [[0.0] * T for _ in range(n)], 0
    for g in range(n // K):
        idx = list(range(g * K, g * K + K))
        best = max(idx, key=lambda i: r[i])
        worst = min(idx, key=lambda i: r[i])
        if r[best] == r[worst]:
            skipped += 1
            continue
        h = (seq_sum(lp, best) - seq_sum(lp, worst)) - (seq_sum(ref, best) - seq_sum(ref, worst))
        if loss_type == "sigmoid":
            loss += math.log(1 + math.exp(-beta * h)) / (n // K)
            dh = -beta / (1 + math.exp(beta * h)) / (n // K)
        else:
            loss += (h - 1 / (2 * beta)) ** 2 / (n // K)
            dh = 2 * (h - 1 / (2 * beta)) / (n // K)
        for t in range(T):
            grad[best][t] += dh if t < LENGTHS[best] else 0.0
            grad[worst][t] -= dh if t < LENGTHS[worst] else 0.0
    return loss, grad, skipped


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_online_dpo_picks_best_and_worst_and_skips_ties(loss_type):
    rewards = [0.5, 1.0, 0.0, 0.3, 0.3, 0.3, 0.2, -1.0, 0.7]  # group 1 ties
    mb = make_mb(rewards)
    want_loss, want_grad, skipped = dpo_reference(mb, 0.2, loss_type)
    assert skipped == 1
    loss, grad, metrics = run(algos.get("online_dpo"), mb, beta=0.2, loss_type=loss_type)
    assert_close(loss, grad, want_loss, want_grad)
    assert metrics["dpo/skipped_groups"] == 1.0
    assert grad[0] == [0.0] * T and grad[6] == [0.0] * T  # neither best nor worst
    assert all(g == [0.0] * T for g in grad[3:6])  # the tied group


@pytest.mark.parametrize("loss_type", ["sigmoid", "ipo"])
def test_online_dpo_on_each_group_s_pair_alone_is_the_same_loss_and_gradient(loss_type):
    """pack_pairs: the learner gets each group as its chosen and rejected completions (online_dpo.pair); the
    loss, its metrics and the gradient of those completions are the full group's, and the others had none."""
    from algos.online_dpo import pair
    from buffer.ring import Group

    rewards = [0.5, 1.0, 0.0, 0.3, 0.3, 0.3, 0.2, -1.0, 1.0]  # group 1 ties; group 2's best is its last
    groups = [Group(prompt_ids=torch.tensor([5]), completion_ids=torch.arange(g * K, g * K + K)[:, None],
                    completion_lens=torch.ones(K, dtype=torch.long), logprobs=torch.zeros(K, 1),
                    versions=torch.zeros(K, 1, dtype=torch.long),
                    rewards=torch.tensor(rewards[g * K:g * K + K]),
                    truncated=torch.zeros(K, dtype=torch.bool), prompt_index=g, group_id=g, worker_id=0)
              for g in range(3)]
    # the completions' ids: their rows
    rows_kept = [int(i) for g in groups for i in pair(g).completion_ids[:, 0]]
    assert rows_kept == [1, 2, 3, 3, 8, 7]
    assert [float(r) for g in groups for r in pair(g).rewards] \
        == pytest.approx([1.0, 0.0, 0.3, 0.3, 1.0, -1.0])

    full = make_mb(rewards)
    want_loss, want_grad, want_metrics = run(algos.get("online_dpo"), full, beta=0.2, loss_type=loss_type)
    idx = torch.tensor(rows_kept)
    cut = lambda x: x[idx]  # noqa: E731
    paired = dataclasses.replace(full, logprobs=full.logprobs.detach()[idx].clone().requires_grad_(True),
                                 behav_logprobs=cut(full.behav_logprobs), mask=cut(full.mask),
                                 rewards=cut(full.rewards), ref_logprobs=cut(full.ref_logprobs),
                                 prox_logprobs=cut(full.prox_logprobs), group_size=2,
                                 batch_sequences=2 * len(groups))
    loss, grad, metrics = run(algos.get("online_dpo"), paired, beta=0.2, loss_type=loss_type)
    assert loss == pytest.approx(want_loss, rel=1e-12) and metrics == pytest.approx(want_metrics, rel=1e-12)
    for row, i in enumerate(rows_kept):
        if i != 3:  # the tied group's completion, taken twice, has no gradient either way
            assert grad[row] == pytest.approx(want_grad[i], rel=1e-12)
    assert all(v == 0.0 for i, r in enumerate(want_grad) if i not in rows_kept for v in r)

    # what the learner loop packs: the pairs, or every completion with pack_pairs=false
    from trainer.batch import batch_for

    rule = algos.get("online_dpo")
    batch = batch_for(groups, rule.Loss(rule.Config()))
    assert batch.group_size == 2 and batch.targets[:, 0].tolist() == rows_kept
    whole = batch_for(groups, rule.Loss(rule.Config(pack_pairs=False)))
    assert whole.group_size == K and whole.targets[:, 0].tolist() == list(range(3 * K))
    assert batch_for(groups, algos.get("ppo").Loss(algos.get("ppo").Config())).group_size == K


def test_online_dpo_all_tied_gives_zero_loss_with_a_graph():
    mb = make_mb([1.0] * 6)
    loss, grad, metrics = run(algos.get("online_dpo"), mb)
    assert loss == 0.0 and all(v == 0.0 for row in grad for v in row)
    assert metrics["dpo/skipped_groups"] == 2.0


# ---- off-policy corrections (algos.PGConfig) ----

def correction_reference(mb, kind, cap=2.0, low=0.5, high=2.0):
    """c_it per token, from plain Python: TIS min(w, C); MIS w in [low, high] else 0, per token or per
    sequence."""
    prox, bh = rows(mb, "prox_logprobs"), rows(mb, "behav_logprobs")
    c = [[0.0] * T for _ in range(len(prox))]
    for i in range(len(prox)):
        logs = [prox[i][t] - bh[i][t] for t in range(LENGTHS[i])]
        for t, log_w in enumerate(logs):
            w = math.exp(sum(logs) / len(logs)) if kind == "mis_seq" else math.exp(log_w)
            c[i][t] = min(w, cap) if kind == "tis" else (w if low <= w <= high else 0.0)
    return c


def off_policy_mb():
    """Weights w = pi_prox/pi_behav inside and outside [0.5, 2]: one token at 3, one at 0.3, a sequence
    at 2.5."""
    mb = make_mb(REWARDS)
    with torch.no_grad():
        mb.prox_logprobs[0, 0] = mb.behav_logprobs[0, 0] + math.log(3.0)
        mb.prox_logprobs[2, 1] = mb.behav_logprobs[2, 1] + math.log(0.3)
        mb.prox_logprobs[4] = mb.behav_logprobs[4] + math.log(2.5)
    return mb


KINDS = ["tis", "mis_token", "mis_seq"]


def clipped_against_proximal(mb, c, divisor):
    """sum_it c_it * -min(rho A, clip(rho) A) / divisor(i), rho = pi / pi_prox, and its gradient."""
    lp, prox, n = rows(mb, "logprobs"), rows(mb, "prox_logprobs"), len(mb.rewards)
    adv = group_adv(mb.rewards.tolist(), scale=True)
    loss, grad = 0.0, [[0.0] * T for _ in range(n)]
    for i in range(n):
        for t in range(LENGTHS[i]):
            token_loss, d = ppo_token(math.exp(lp[i][t] - prox[i][t]), adv[i], 0.8, 1.2)
            loss += c[i][t] * token_loss / divisor(i)
            grad[i][t] = c[i][t] * d / divisor(i)
    return loss, grad


@pytest.mark.parametrize("kind", KINDS)
def test_correction_weights_match_reference(kind):
    mb = off_policy_mb()
    want = correction_reference(mb, kind)
    got, metrics = algos.correction_weights(algos.get("grpo").Config(correction=kind), mb.prox_logprobs,
                                            mb.behav_logprobs, mb.mask)
    assert got.tolist() == [pytest.approx(row, rel=1e-12, abs=0) for row in want]
    valid = [(i, t) for i in range(len(want)) for t in range(LENGTHS[i])]
    if kind == "tis":
        truncated = sum(math.exp(rows(mb, "prox_logprobs")[i][t] - rows(mb, "behav_logprobs")[i][t]) > 2.0
                        for i, t in valid)
        assert truncated >= 4 \
            and metrics["correction/truncated_frac"] == pytest.approx(truncated / len(valid))
    else:
        dropped = sum(want[i][t] == 0.0 for i, t in valid)
        assert dropped >= 1 and metrics["correction/masked_frac"] == pytest.approx(dropped / len(valid))
    if kind == "mis_seq":  # whole sequences: row 4's geometric mean is 2.5
        assert want[4][:LENGTHS[4]] == [0.0] * LENGTHS[4] and all(v > 0 for v in want[0][:LENGTHS[0]])


@pytest.mark.parametrize("kind", KINDS)
def test_grpo_with_correction_clips_against_proximal_and_weights_tokens(kind):
    mb = off_policy_mb()
    c = correction_reference(mb, kind)
    want_loss, want_grad = clipped_against_proximal(mb, c, lambda i: LENGTHS[i] * len(mb.rewards))
    grpo = algos.get("grpo")
    assert grpo.Loss(grpo.Config(correction=kind)).needs_proximal \
        and not grpo.Loss(grpo.Config()).needs_proximal
    loss, grad, _ = run(grpo, mb, correction=kind)
    assert_close(loss, grad, want_loss, want_grad)


@pytest.mark.parametrize("kind", KINDS)
def test_ppo_correction_replaces_the_cap_rather_than_stacking_on_it(kind):
    mb = off_policy_mb()
    with torch.no_grad():
        mb.prox_logprobs[1, 0] = mb.behav_logprobs[1, 0] + math.log(10.0)  # above behav_weight_cap = 5
    c = correction_reference(mb, kind)
    want_loss, want_grad = clipped_against_proximal(mb, c, lambda i: mb.batch_tokens)
    loss, grad, metrics = run(algos.get("ppo"), mb, correction=kind)
    assert_close(loss, grad, want_loss, want_grad)
    if kind == "tis":  # the capped token trains with weight C = 2, where the cap alone would have masked it
        assert c[1][0] == 2.0 and grad[1][0] != 0.0


@pytest.mark.parametrize("kind", KINDS)
def test_rloo_with_correction_weights_each_token(kind):
    mb = off_policy_mb()
    c = correction_reference(mb, kind)
    lp, r, n = rows(mb, "logprobs"), mb.rewards.tolist(), len(mb.rewards)
    want_loss, want_grad = 0.0, [[0.0] * T for _ in range(n)]
    for i in range(n):
        g = i // K
        adv = r[i] - sum(r[j] for j in range(g * K, g * K + K) if j != i) / (K - 1)
        for t in range(LENGTHS[i]):
            want_loss += -adv * c[i][t] * lp[i][t] / n
            want_grad[i][t] = -adv * c[i][t] / n
    loss, grad, _ = run(algos.get("rloo"), mb, correction=kind)
    assert_close(loss, grad, want_loss, want_grad)


@pytest.mark.parametrize("name", ["grpo", "ppo"])
def test_clip_fraction_counts_only_the_tokens_the_clip_cuts(name):
    """A token is clipped when its ratio leaves the range on the side its advantage pushes (below 1 - eps with
    A < 0, above 1 + eps with A > 0): exactly the tokens whose gradient the clip zeroes. Outside the range on
    the other side, min() keeps the unclipped term and the token still learns."""
    mb = make_mb(REWARDS, seed=2)  # a draw with tokens on every side of both ranges
    lp, bh = rows(mb, "logprobs"), rows(mb, "behav_logprobs")
    old = bh if name == "grpo" else rows(mb, "prox_logprobs")
    adv = group_adv(REWARDS, scale=True)
    tokens = [(math.exp(lp[i][t] - old[i][t]), adv[i], i, t)
              for i in range(len(lp)) for t in range(LENGTHS[i])]
    _, grad, metrics = run(algos.get(name), mb, **({"behav_weight_cap": 100.0} if name == "ppo" else {}))
    low = [(i, t) for rho, a, i, t in tokens if rho < 0.8 and a < 0]
    high = [(i, t) for rho, a, i, t in tokens if rho > 1.2 and a > 0]
    outside = sum(rho < 0.8 or rho > 1.2 for rho, *_ in tokens)
    assert low and high and outside > len(low) + len(high)  # some tokens lie outside on the unclipped side
    assert metrics[f"{name}/clip_frac_low"] == pytest.approx(len(low) / len(tokens))
    assert metrics[f"{name}/clip_frac_high"] == pytest.approx(len(high) / len(tokens))
    assert metrics[f"{name}/clip_frac"] == pytest.approx((len(low) + len(high)) / len(tokens))
    zero_grad = {(i, t) for _, a, i, t in tokens if a != 0 and grad[i][t] == 0.0}
    assert zero_grad == set(low) | set(high)  # the counted tokens are those the clip stopped


# ---- per-turn credit (turn_credit=return_to_go) ----

# Two groups of K=3 episodes of 1 to 3 turns: (step rewards, tokens per turn as (sampled, observation)).
EPISODES = [([1.0, 0.0, 2.0], [(2, 1), (1, 1), (2, 0)]), ([0.0, 3.0], [(1, 2), (2, 0)]), ([0.0], [(3, 0)]),
            ([0.5], [(2, 0)]), ([0.2, 0.2, 0.0], [(1, 1), (1, 1), (1, 0)]), ([0.0, 0.1], [(1, 1), (2, 0)])]
WIDTH = 8  # T of the batch: the longest episode is 7 tokens
SAMPLED = sum(sampled for _, tokens in EPISODES for sampled, _ in tokens)  # the batch's tokens on the mask


def multi_turn_mb(episodes=EPISODES, dtype=torch.float64, **overrides):
    """A batch of episodes whose observation tokens are off the mask, logprobs equal to the behaviour's (every
    ratio 1, so a token's gradient is its advantage over the rule's normaliser), rewards the step rewards'
    sums."""
    n = len(episodes)
    mask, turn_ids = torch.zeros(n, WIDTH, dtype=dtype), torch.zeros(n, WIDTH, dtype=torch.long)
    turn_rewards = torch.zeros(n, 3, dtype=dtype)
    for i, (steps, tokens) in enumerate(episodes):
        turn_rewards[i, :len(steps)] = torch.tensor(steps, dtype=dtype)
        t = 0
        for k, (sampled, observed) in enumerate(tokens):
            mask[i, t:t + sampled] = 1
            turn_ids[i, t:t + sampled + observed] = k
            t += sampled + observed
    behav = -1.0 - torch.rand(n, WIDTH, generator=torch.Generator().manual_seed(0), dtype=dtype)
    fields = dict(logprobs=behav.clone().requires_grad_(True), behav_logprobs=behav, mask=mask,
                  rewards=turn_rewards.sum(1), group_size=K, batch_sequences=n, batch_tokens=int(mask.sum()),
                  max_new_tokens=WIDTH, step=0, prox_logprobs=behav.clone(), turn_ids=turn_ids,
                  turn_rewards=turn_rewards, turns=torch.tensor([len(steps) for steps, _ in episodes]))
    fields.update(overrides)
    return MicroBatch(**fields)


def return_to_go_reference(episodes, gamma, scale):
    """Each turn's advantage with plain loops: its discounted return-to-go minus the group's mean episode
    return, over the group's std of episode returns; 0 in a group whose returns tie."""
    out = []
    for g in range(len(episodes) // K):
        steps = [s for s, _ in episodes[g * K:(g + 1) * K]]
        togo = [[sum(gamma ** (j - k) * r[j] for j in range(k, len(r))) for k in range(len(r))]
                for r in steps]
        first = [G[0] for G in togo]
        mean = sum(first) / K
        std = math.sqrt(sum((x - mean) ** 2 for x in first) / (K - 1))
        tied = max(first) - min(first) < 1e-9
        out += [[0.0 if tied else (x - mean) / (std + 1e-4 if scale else 1.0) for x in G] for G in togo]
    return out


def token_advantages(mb, grad, divisor):
    """The advantage each masked-in token was weighted with, read off its gradient at ratio 1: -A / divisor
    (divisor [n] or a number); per episode, per turn, the set of values its tokens got."""
    lengths = mb.mask.sum(1).tolist()
    out = []
    for i in range(len(grad)):
        d = divisor(i, lengths[i]) if callable(divisor) else divisor
        per_turn = {}
        for t in range(WIDTH):
            if mb.mask[i, t]:
                per_turn.setdefault(int(mb.turn_ids[i, t]), set()).add(round(-grad[i][t] * d, 9))
        out.append([sorted(per_turn[k]) for k in sorted(per_turn)])
    return out


def test_return_to_go_by_hand():
    """Group 0, Dr. GRPO (no std): returns-to-go [3, 2, 2], [3, 3], [0] against the mean return 2, and with
    gamma = 0.5 [1.5, 1, 2], [1.5, 3], [0] against 1. Group 1 with the std, against the loop reference."""
    for gamma, want in ((1.0, [[1, 0, 0], [1, 1], [-2]]), (0.5, [[0.5, 0, 1], [0.5, 2], [-1]])):
        per_turn = algos.turn_advantages(multi_turn_mb().turn_rewards, K, gamma, scale=False)
        for i, row in enumerate(want):
            assert per_turn[i, :len(row)].tolist() == pytest.approx(row, abs=1e-12)
    scaled = algos.turn_advantages(multi_turn_mb().turn_rewards, K, 1.0, scale=True)
    reference = return_to_go_reference(EPISODES, 1.0, scale=True)
    for i in range(K, 2 * K):
        assert scaled[i, :len(reference[i])].tolist() == pytest.approx(reference[i], rel=1e-12)


@pytest.mark.parametrize("gamma", [1.0, 0.5])
@pytest.mark.parametrize("name,cfg,divisor", [
    ("grpo", {}, lambda i, length: length * 6), ("grpo", {"dr_grpo": True}, WIDTH * 6),
    ("grpo", {"token_mean": True}, SAMPLED), ("ppo", {"decoupled": False}, SAMPLED),
    ("ppo", {"scale_std": False}, SAMPLED), ("cispo", {}, SAMPLED)])
def test_each_token_is_weighted_by_its_turn_s_advantage(name, cfg, divisor, gamma):
    """grpo, ppo and cispo with turn_credit=return_to_go: every sampled token of turn k carries A_ik (the loop
    reference), observation tokens carry nothing; at ratio 1 a token's gradient is -A over the rule's
    normaliser (grpo: the episode's tokens x n, or max_new_tokens x n; else the batch's tokens)."""
    mb = multi_turn_mb()
    scale = not cfg.get("dr_grpo", False) and cfg.get("scale_std", True)
    _, grad, metrics = run(algos.get(name), mb, turn_credit="return_to_go", turn_gamma=gamma, **cfg)
    want = return_to_go_reference(EPISODES, gamma, scale)
    got = token_advantages(mb, grad, divisor)
    for i, (g, w) in enumerate(zip(got, want)):
        assert [values[0] for values in g] == pytest.approx(w, rel=1e-6, abs=1e-9), i
        assert all(len(values) == 1 for values in g), i  # one advantage per turn
    assert all(grad[i][t] == 0.0 for i in range(len(grad)) for t in range(WIDTH) if not mb.mask[i, t])
    tokens = [w[int(mb.turn_ids[i, t])] for i, w in enumerate(want) for t in range(WIDTH) if mb.mask[i, t]]
    assert metrics[f"{name}/turn_adv_abs_mean"] == pytest.approx(sum(map(abs, tokens)) / len(tokens))
    assert metrics[f"{name}/adv_abs_mean"] == pytest.approx(sum(abs(w[0]) for w in want) / len(want))


@pytest.mark.parametrize("name,cfg", [("grpo", {}), ("grpo", {"dr_grpo": True}), ("dapo", {}),
                                      ("ppo", {}), ("ppo", {"scale_std": False}), ("cispo", {})])
def test_turn_credit_none_reads_no_turn_and_one_turn_episodes_get_the_sequence_advantage(name, cfg):
    """turn_credit=none on a multi-turn batch: the same loss, gradient and metrics, bit for bit, whatever the
    turn fields hold (garbage here) or without them; return_to_go on one-turn episodes (a one-shot task) is
    the sequence-level rule bit for bit, whatever turn_gamma."""
    module = algos.get(name)
    results = []
    for turns in (dict(turn_rewards=torch.rand(6, 3, dtype=torch.float64) * 9), dict(turn_ids=None,
                  turn_rewards=None, turns=None), {}):
        mb = make_mb(REWARDS, seed=2, **turns)
        results.append(run(module, mb, **cfg))
    assert results[0] == results[1] == results[2]
    one_turn = dict(turn_ids=torch.zeros(6, T, dtype=torch.long), turns=torch.ones(6, dtype=torch.long),
                    turn_rewards=torch.tensor(REWARDS, dtype=torch.float64)[:, None])
    for gamma in (1.0, 0.3):
        loss, grad, metrics = run(module, make_mb(REWARDS, seed=2, **one_turn), turn_credit="return_to_go",
                                  turn_gamma=gamma, **cfg)
        assert (loss, grad) == results[0][:2]
        assert {k: v for k, v in metrics.items() if "turn_adv" not in k} == results[0][2]


def test_a_group_whose_returns_tie_learns_nothing_from_when_its_rewards_came():
    """Returns that tie (1.0 every time, rewards at different turns, their float32 sums 1 ulp apart as the
    record's rewards are not) leave nothing to compare: A = 0 at every turn, not offsets divided by the 1e-4
    of a (near) zero std. The trainer may then leave such a group out unless a discount can untie returns."""
    steps = [[0.1, 0.2, 0.7], [0.2, 0.35, 0.45], [1.0]]
    episodes = [(s, [(1, 0)] * len(s)) for s in steps] + EPISODES[3:]
    mb = multi_turn_mb(episodes, dtype=torch.float32)
    returns = torch.zeros(K)
    for k in reversed(range(3)):  # G_i0 as the rule sums them, last turn first, in float32
        returns = mb.turn_rewards[:K, k] + returns
    assert returns.unique().numel() > 1
    assert mb.rewards.new_tensor([sum(s) for s in steps]).unique().numel() == 1  # the record's rewards tie
    _, grad, _ = run(algos.get("grpo"), mb, turn_credit="return_to_go")
    assert not any(v for row in grad[:K] for v in row) and any(v for row in grad[K:] for v in row)
    for name in ("grpo", "ppo", "cispo"):
        module = algos.get(name)
        learns = [module.Loss(module.Config(**cfg)).tied_groups_learn_nothing for cfg in (
            {}, {"turn_credit": "return_to_go"}, {"turn_credit": "return_to_go", "turn_gamma": 0.9})]
        assert learns == [True, True, False], name


def test_dapo_s_length_penalty_joins_the_last_turn_s_reward():
    """With rewards on the last turn and gamma = 1, return_to_go with DAPO's overlong penalty is the
    sequence-level rule with it: the penalty is part of every turn's return-to-go."""
    steps = [[0.0, 1.0], [0.0, 0.0, 0.5], [2.0], [0.0, 0.3], [1.0], [0.0, 0.0, 0.0]]
    episodes = [(s, [(1, 1)] * (len(s) - 1) + [(WIDTH - 2 * len(s) + 2, 0)]) for s in steps]
    mb = multi_turn_mb(episodes)  # every episode runs to max_new_tokens: the full penalty
    base, _, base_metrics = run(algos.get("dapo"), multi_turn_mb(episodes))
    loss, _, metrics = run(algos.get("dapo"), mb, turn_credit="return_to_go")
    assert metrics["dapo/overlong_penalty_mean"] < 0 and loss == pytest.approx(base, rel=1e-12)
    assert metrics["dapo/turn_adv_abs_mean"] != base_metrics["dapo/adv_abs_mean"]  # tokens, not episodes


# ---- every rule ----

ALL = [("grpo", {}), ("tb", {}), ("ppo", {}), ("ppo", {"decoupled": False}), ("rloo", {"kl_coef": 0.1}),
       ("online_dpo", {}), ("online_dpo", {"loss_type": "ipo"}), ("grpo", {"correction": "tis"}),
       ("ppo", {"correction": "mis_seq"}), ("rloo", {"correction": "mis_token"}), ("dapo", {}),
       ("grpo", {"dual_clip": 3.0, "token_mean": True}), ("ppo", {"dual_clip": 3.0}), ("gspo", {}),
       ("gspo", {"clip_eps": 0.05, "clip_eps_high": 0.08}), ("gspo", {"correction": "tis"}), ("cispo", {}),
       ("cispo", {"clip_eps": 0.2, "clip_eps_high": 0.2}), ("cispo", {"correction": "mis_token"}),
       ("grpo", {"turn_credit": "return_to_go"}), ("cispo", {"turn_credit": "return_to_go"}),
       ("dapo", {"turn_credit": "return_to_go", "turn_gamma": 0.9}),
       ("ppo", {"turn_credit": "return_to_go", "turn_gamma": 0.5})]


@pytest.mark.parametrize("name,cfg", ALL)
def test_micro_batch_shares_sum_to_the_whole_batch_loss(name, cfg):
    """Normalisers are batch-level: the trainer's sum over micro-batches must equal the whole-batch loss."""
    module = algos.get(name)
    mb = make_mb([0.0, 1.0, 0.0, 1.0, 1.0, 0.0, 0.2, 0.9, 0.4])
    whole, _, _ = run(module, mb, **cfg)
    whole_grad = mb.logprobs.grad
    shares, grads = 0.0, []
    for part in ((0, 1), (1, 3)):
        sub = split(mb, part)
        loss, grad, _ = run(module, sub, **cfg)
        shares += loss
        grads.append(sub.logprobs.grad)
    assert shares == pytest.approx(whole, rel=1e-12)
    assert torch.allclose(torch.cat(grads), whole_grad, rtol=1e-12, atol=1e-15)


@pytest.mark.parametrize("name,cfg", ALL)
def test_metrics_are_namespaced_floats(name, cfg):
    _, _, metrics = run(algos.get(name), make_mb(REWARDS), **cfg)
    prefix = {"online_dpo": "dpo"}.get(name, name)
    assert f"loss/{prefix}" in metrics
    for key, value in metrics.items():
        assert type(value) is float and math.isfinite(value), key
        assert key.split("/")[0] in ("loss", prefix) + (("correction",) if "correction" in cfg else ()), key


@pytest.mark.parametrize("name", algos.names())
@pytest.mark.parametrize("sign", [1.0, -1.0])
def test_every_rule_stays_finite_with_log_ratios_of_100(name, sign):
    """Log-ratios of +-100 against the behaviour, proximal and reference policies, in padding (garbage the
    mask must hide) and on two real tokens (an overflowing ratio must be clamped, not turned into inf * 0):
    every rule's loss and gradient stay finite. In float32, as the trainer's logprobs are: exp(100) is inf."""
    mb = make_mb(REWARDS)
    mb = dataclasses.replace(mb, **{f: getattr(mb, f).detach().float() for f in (
        "behav_logprobs", "mask", "rewards", "ref_logprobs", "prox_logprobs")})
    mb.logprobs = mb.logprobs.detach().float().requires_grad_(True)
    with torch.no_grad():
        pad = mb.mask == 0
        mb.logprobs[pad] = mb.behav_logprobs[pad] + sign * 100
        mb.logprobs[1, 0] = mb.behav_logprobs[1, 0] + sign * 100
        mb.logprobs[4, 1] = mb.behav_logprobs[4, 1] - sign * 100
        mb.prox_logprobs[pad] = mb.behav_logprobs[pad] - sign * 100
        mb.ref_logprobs[pad] = mb.behav_logprobs[pad] - sign * 100
    module = algos.get(name)
    for cfg in ({}, {"correction": "tis"}) \
            if "correction" in {f.name for f in dataclasses.fields(module.Config)} else ({},):
        mb.logprobs.grad = None
        loss_fn = module.Loss(module.Config(**cfg))
        loss, metrics = loss_fn(mb)
        loss.backward()
        assert math.isfinite(loss.item()) and torch.isfinite(mb.logprobs.grad).all(), (name, cfg)
        assert all(math.isfinite(v) for v in metrics.values()), (name, cfg, metrics)


BAD = [("grpo", "clip_eps", 1.5), ("grpo", "clip_eps_high", 0.0),
       ("grpo", "dual_clip", 0.5), ("ppo", "dual_clip", 1.0), ("grpo", "overlong_buffer_frac", 1.0),
       ("grpo", "overlong_penalty", -1.0), ("dapo", "clip_eps_high", 0.0),
       ("tb", "beta_start", 0.0), ("tb", "beta_end", -1.0), ("tb", "beta_steps", -1),
       ("ppo", "clip_eps", 0.0), ("ppo", "clip_eps_high", -0.1), ("ppo", "behav_weight_cap", 0.5),
       ("rloo", "kl_coef", -0.1), ("grpo", "correction", "is"), ("rloo", "tis_cap", 0.0),
       ("ppo", "mis_low", 1.0), ("ppo", "mis_high", 0.9),
       ("online_dpo", "beta", 0.0), ("online_dpo", "loss_type", "hinge"), ("grpo", "turn_credit", "per_turn"),
       ("dapo", "turn_gamma", 1.5), ("ppo", "turn_gamma", -0.1), ("cispo", "turn_credit", "gae")]


@pytest.mark.parametrize("name,key,value", BAD)
def test_config_check_names_the_bad_key(name, key, value):
    module = algos.get(name)
    module.Config().check()
    with pytest.raises(ValueError, match=rf"config key 'algo\.{key}' must"):
        module.Config(**{key: value}).check()


def test_standard_ppo_refuses_a_correction():
    with pytest.raises(ValueError,
                       match=r"'algo.correction' must be none .*set algo.decoupled=true \(got 'tis'\)"):
        algos.get("ppo").Config(decoupled=False, correction="tis").check()


@pytest.mark.parametrize("name", algos.names())
def test_registry_module_has_a_named_config_and_a_loss(name):
    """Each rule's Config is its schema (its preset conf/algo/<name>.yaml only pulls it in:
    tests/test_config.py)."""
    module = algos.get(name)
    assert hasattr(module, "Config") and hasattr(module, "Loss")
    fields = dataclasses.fields(module.Config)
    assert fields[0].name == "name" and module.Config().name == name
    loss_fn = module.Loss(module.Config())
    assert isinstance(loss_fn.needs_reference, bool) and isinstance(loss_fn.needs_proximal, bool)
