"""Learning rules. One file per rule, each exposing `Config` (its knobs and their defaults) and `Loss`.

A `Loss` is built from its Config and called on one `MicroBatch`; it returns `(loss, metrics)` where `loss` is
this micro-batch's share of the whole batch's loss (the trainer sums the shares and backpropagates each).
Class attributes tell the trainer what to provide: `needs_reference`, `needs_proximal`; optionally `sampler`
("fifo" or "tba", the replay buffer `buffer.sampler=auto` picks), `any_policy` (its objective holds for data
from any policy, so buffer.sampler=tba may replay groups past max_staleness for it; launch/config.py refuses
tba for the others), `summed_metrics` (metric keys that are counts, summed over micro-batches and ranks
instead of averaged) and `tied_groups_learn_nothing` (true where a group whose K rewards all tie has zero
advantage, so no loss and no gradient: the trainer then leaves such groups out of its passes,
train.skip_tied_groups, and divides by the whole batch's counts as before), and `trim_group` (a function from
a group to the completions the loss reads, in the order it reads them: the learner is given only those;
online_dpo's chosen and rejected). Adding a rule: copy algos/grpo.py to algos/<name>.py and change the maths
(`algo=<name>` finds it by its file; conf/algo/<name>.yaml only where the rule sets other keys, as tb.yaml
sets train.lr).
"""
import os
from dataclasses import dataclass
from typing import Optional

import torch

from registry import Registry, require


@dataclass
class MicroBatch:
    """Whole groups of K completions (a group's sequences are contiguous): n = G * K sequences, T tokens."""
    logprobs: torch.Tensor  # [n, T] current policy, requires grad
    behav_logprobs: torch.Tensor  # [n, T] recorded by the rollout engine when sampling
    # [n, T] 1.0 on the tokens the policy sampled (the record's loss mask); 0.0 on padding, on an
    # environment's tokens, and on every token of a sample env.mask keeps out of the loss (no term reads it)
    mask: torch.Tensor
    rewards: torch.Tensor  # [n]
    group_size: int  # K: the batch's completions per group (rollout.group_size, or what a trim_group kept)
    batch_sequences: int  # sequences in the whole optimizer batch, across ranks
    batch_tokens: int  # tokens on the mask in the whole optimizer batch, across ranks (0: every one masked)
    max_new_tokens: int  # the sampling budget (Dr. GRPO's constant normaliser)
    # batches trained on so far, i.e. the policy version (for schedules; not train.minibatches' or epochs')
    step: int
    ref_logprobs: Optional[torch.Tensor] = None  # [n, T] frozen initial policy, if the loss needs it
    prox_logprobs: Optional[torch.Tensor] = None  # [n, T] weights before this batch's first update, if needed
    # [n, T] the policy turn (0, 1, ...) of each token (an observation: the turn before it; padding: 0)
    turn_ids: Optional[torch.Tensor] = None
    turn_rewards: Optional[torch.Tensor] = None  # [n, R] each turn's step reward (0 past an episode's turns)
    turns: Optional[torch.Tensor] = None  # [n] policy turns of each episode


CORRECTIONS = ("none", "tis", "mis_token", "mis_seq")


@dataclass
class PGConfig:
    """What the policy-gradient rules' Configs (ppo, grpo, rloo) share: the rule's name, and the correction
    for the mismatch between the engine's sampling policy and the trainer's.

    The engine sampled with pi_behav; the trainer's weights before this batch are pi_prox. With a correction
    on, a rule takes its ratio against pi_prox and weights each token by (no gradient):
        w_it = pi_prox(y_it) / pi_behav(y_it)
        tis        c_it = min(w_it, tis_cap)                                    truncated IS (Yao et al. 2025)
        mis_token  c_it = w_it * [mis_low <= w_it <= mis_high]                  masked IS per token (icepop)
        mis_seq    w_i = exp(mean_t log w_it);  c_it = w_i * [mis_low <= w_i <= mis_high]   per sequence
    tb and online_dpo take none: both are off-policy objectives that hold for any sampling policy.
    """
    name: str = ""  # the rule (each rule's Config sets it)
    correction: str = "none"  # none | tis | mis_token | mis_seq (above)
    tis_cap: float = 2.0  # tis: the largest weight C
    mis_low: float = 0.5  # mis_*: tokens / sequences with a weight below this are dropped
    mis_high: float = 2.0  # mis_*: ... and above this

    def check_correction(self):
        require(self.correction in CORRECTIONS, "algo.correction", f"must be one of {', '.join(CORRECTIONS)}",
                self.correction)
        require(self.tis_cap > 0, "algo.tis_cap", "must be > 0", self.tis_cap)
        require(0 <= self.mis_low < 1, "algo.mis_low", "must be in [0, 1)", self.mis_low)
        require(self.mis_high > 1, "algo.mis_high", "must be > 1", self.mis_high)


def correction_weights(cfg: PGConfig, prox: torch.Tensor, behav: torch.Tensor,
                       mask: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """[n, T] logprobs of pi_prox and pi_behav, mask -> c [n, T] (PGConfig's docstring; 0 on padding),
    metrics."""
    with torch.no_grad():
        log_w = torch.where(mask > 0, prox - behav, 0.0).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT)  # [n, T]
        tokens = mask.sum().clamp(min=1).item()
        if cfg.correction == "tis":
            w = log_w.exp()
            c = w.clamp(max=cfg.tis_cap) * mask
            return c, {"correction/truncated_frac": ((w > cfg.tis_cap).float() * mask).sum().item() / tokens}
        if cfg.correction == "mis_token":
            w = log_w.exp()
        else:
            assert cfg.correction == "mis_seq", cfg.correction
            w = (log_w.sum(1, keepdim=True) / mask.sum(1, keepdim=True).clamp(min=1)).exp().expand_as(mask)
        kept = mask * (w >= cfg.mis_low) * (w <= cfg.mis_high)
        return w * kept, {"correction/masked_frac": (mask - kept).sum().item() / tokens}


LOG_RATIO_LIMIT = 20.0  # |log pi/pi'| beyond this is clamped before exp: e^20 is finite, e^89 is not (fp32)


def safe_ratio(log_ratio: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """exp(log_ratio) [n, T], exactly 1 where mask is 0 and from a log-ratio clamped to +-LOG_RATIO_LIMIT
    elsewhere: garbage in a masked position (padding, an environment's tokens) can never make inf * 0 = NaN,
    and an overflowing token gets a large finite ratio (no gradient past the clamp) instead of poisoning the
    step."""
    return torch.where(mask > 0, log_ratio,
                       torch.zeros_like(log_ratio)).clamp(-LOG_RATIO_LIMIT, LOG_RATIO_LIMIT).exp()


def old_policy(cfg: PGConfig, mb: MicroBatch) -> tuple[torch.Tensor, torch.Tensor, dict]:
    """The logprobs a policy-gradient rule takes its ratio against, each token's weight, and the correction's
    metrics: pi_behav and the mask, or with algo.correction pi_prox and c_it (PGConfig's docstring)."""
    if cfg.correction == "none":
        return mb.behav_logprobs, mb.mask, {}
    assert mb.prox_logprobs is not None, f"{cfg.name} with a correction needs proximal logprobs"
    weight, metrics = correction_weights(cfg, mb.prox_logprobs, mb.behav_logprobs, mb.mask)
    return mb.prox_logprobs, weight, metrics


class PGLoss:
    """What grpo's, gspo's and cispo's Loss share: no reference, and pi_prox only for a correction."""
    needs_reference = False

    def __init__(self, cfg: PGConfig):
        self.cfg = cfg
        self.needs_proximal = cfg.correction != "none"
        self.tied_groups_learn_nothing = True  # A_i = 0 on a tie, and each term is a multiple of A_i


def clip_fractions(ratio: torch.Tensor, low: float, high: float, mask: torch.Tensor,
                   adv: torch.Tensor) -> dict:
    """Fractions of the masked tokens that the clip actually cuts, per side: the ratio [n, T] below `low` with
    a negative advantage, or above `high` with a positive one (adv [n, 1] or [n, T]). A token outside the
    range on the other side keeps its unclipped term in min(), so it is not counted."""
    tokens = mask.sum().clamp(min=1).item()
    below = (((low - ratio) > 1e-6) & (adv < 0)).float() * mask
    above = (((ratio - high) > 1e-6) & (adv > 0)).float() * mask
    return {"clip_frac_low": below.sum().item() / tokens, "clip_frac_high": above.sum().item() / tokens}


def clipped_objective(ratio: torch.Tensor, adv: torch.Tensor, eps: float, eps_high: float,
                      dual_clip: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's per-token objective min(rho A, clip(rho, 1 - eps, 1 + eps_high) A) [n, T], and with dual_clip
    c > 1 (Ye et al. 2020) max(that, c A) where A < 0: a very large ratio on a negative advantage cannot push
    without bound. Returns the objective and the 0/1 mask of tokens the dual clip cut."""
    clipped = ratio.clamp(1 - eps, 1 + eps_high)
    objective = torch.min(ratio * adv, clipped * adv)
    if not dual_clip:
        return objective, torch.zeros_like(objective)
    floor = dual_clip * adv
    dual = (adv < 0) & (objective < floor)
    return torch.where(dual, floor.expand_as(objective), objective), dual.float()


LOSSES = Registry("algo", __name__, os.path.dirname(__file__))  # algos/<name>.py: Config and Loss


def names() -> list[str]:
    return LOSSES.names()


def get(name: str):
    """The module of rule `name` (it has `Config` and `Loss`)."""
    return LOSSES.get(name)


def group_advantages(rewards: torch.Tensor, group_size: int, scale: bool = True) -> torch.Tensor:
    """[n] rewards -> [n] advantages: reward minus its group's mean, optionally over the group's std."""
    r = rewards.view(-1, group_size)
    adv = r - r.mean(dim=1, keepdim=True)
    if scale:
        adv = adv / (r.std(dim=1, keepdim=True) + 1e-4)
    return adv.reshape(-1)


def sequence_logprobs(logprobs: torch.Tensor, mask: torch.Tensor, normalize: bool = False) -> torch.Tensor:
    """[n, T] token logprobs -> [n] log-probability of each completion (over its length if `normalize`), each
    token weighted by `mask` (0/1, or a correction weight); a masked position counts 0 whatever it holds
    (where, not only a product: inf * 0 is NaN)."""
    total = torch.where(mask > 0, logprobs * mask, 0.0).sum(1)
    return total / mask.sum(1).clamp(min=1) if normalize else total


TURN_CREDITS = ("none", "return_to_go")
TIE_TOLERANCE = 1e-6  # episode returns closer than this (relative) tie: the rounding of turn sums, not a win


@dataclass
class TurnCredit:
    """Per-turn credit, a knob of the rules that weight each token by an advantage (grpo, dapo, ppo, cispo):
    none gives every token its episode's advantage (group_advantages), return_to_go its turn's
    (turn_advantages, which states the estimator and its bias)."""
    # none: each token gets its episode's advantage; return_to_go: its turn's (algos.turn_advantages)
    turn_credit: str = "none"
    turn_gamma: float = 1.0  # return_to_go: a step reward k turns later counts gamma^k

    def check_turn_credit(self):
        require(self.turn_credit in TURN_CREDITS, "algo.turn_credit",
                f"must be one of {', '.join(TURN_CREDITS)}", self.turn_credit)
        require(0 <= self.turn_gamma <= 1, "algo.turn_gamma", "must be in [0, 1]", self.turn_gamma)

    def ties_learn_nothing(self) -> bool:
        """Whether a group whose K rewards tie gets A = 0 at every token (the trainer may leave it out):
        always at the sequence level, and per turn with turn_gamma = 1 (discounting can untie the returns)."""
        return self.turn_credit == "none" or self.turn_gamma == 1


def turn_advantages(turn_rewards: torch.Tensor, group_size: int, gamma: float,
                    scale: bool = True) -> torch.Tensor:
    """[n, R] step rewards of each episode's turns -> [n, R] their advantages (turn_credit=return_to_go):

        G_ik = sum_{k' >= k} gamma^(k' - k) r_ik'        turn k's return-to-go               [n, R]
        b_g  = mean_{j in g} G_j0                        the group's mean episode return     [G]
        A_ik = (G_ik - b_g) / std_{j in g} G_j0          (scale false: no division)           [n, R]
        A_ik = 0 at every k where the group's G_j0 tie (TIE_TOLERANCE): no episode did better than another

    With one turn, or with rewards on the last turn only and gamma = 1 (every shipped task), G_ik = G_i0 and
    this is group_advantages over the episode returns (bit for bit with one turn).

    Bias. b_g estimates the return from turn 0, not the return-to-go E[G_k | s_k] expected at a later turn,
    which a group of K cannot estimate turn by turn. The per-turn baselines peers use carry worse biases: a
    mean per turn index (MT-GRPO's) averages at turn k only the episodes that lasted k turns, so an episode's
    own stopping turn picks its baseline: action-dependent, it adds minus the mean intermediate reward to
    every decision to take another turn (verl RFC #7244); one mean and std pooled over every turn of the group
    weighs long episodes more (verifiers #1554; #536 makes each turn a sample with its discounted return). b_g
    is one constant for every turn of the group, so what it subtracts, b_g * grad log pi(turn k), has mean
    zero at each turn whatever the episode's length: the gradient is GRPO's expectation, with GRPO's own bias
    (the episode's 1/K share of b_g and of the std). The cost is variance: G_ik - b_g is offset by about minus
    the reward expected before turn k, so where rewards come early in an episode its later turns are pushed
    down in a batch by noise that cancels only over batches, and the division by the spread of whole returns
    amplifies that offset in a group whose returns nearly agree (dr_grpo or scale_std=false leave it
    unscaled). With gamma < 1, b_g averages returns discounted from turn 0 while G_ik is discounted from turn
    k: with the reward at the end, a later turn gets more credit for its position alone (G_ik =
    gamma^(T_i-1-k) r_i; PipelineRL #135: gamma, not a good turn, orders the turns), and rewards that tie need
    not tie in G_j0. Turns stay inside their episode's sequence (not step-wise samples, SkyRL #1278), so a
    rule's normaliser over |y_i| is unchanged.
    """
    n, width = turn_rewards.shape
    returns = torch.empty_like(turn_rewards)
    running = torch.zeros_like(turn_rewards[:, 0])
    for k in reversed(range(width)):
        running = turn_rewards[:, k] + gamma * running
        returns[:, k] = running
    episode = returns[:, 0].view(-1, group_size)  # G_j0 [G, K]
    adv = returns.view(-1, group_size, width) - episode.mean(dim=1, keepdim=True)[:, :, None]
    if scale:
        adv = adv / (episode.std(dim=1, keepdim=True)[:, :, None] + 1e-4)
    tied = episode.amax(1) - episode.amin(1) <= TIE_TOLERANCE * episode.abs().amax(1).clamp(min=1)  # [G]
    return adv.masked_fill(tied[:, None, None], 0.0).reshape(n, width)


def advantages(cfg: TurnCredit, mb: MicroBatch, scale: bool,
               bonus: Optional[torch.Tensor] = None) -> tuple[torch.Tensor, dict]:
    """The advantage a rule weights each token with, and its metrics: A_i [n, 1] from the episode rewards
    (turn_credit none, group_advantages) or A_it [n, T], its turn's (return_to_go, turn_advantages).
    `bonus` [n] (DAPO's length shaping) is added to each episode's reward, that is to its last turn's.
    adv_abs_mean is per episode (turn 0's under return_to_go), turn_adv_abs_mean per token on the mask."""
    if cfg.turn_credit == "none":
        rewards = mb.rewards if bonus is None else mb.rewards + bonus
        adv = group_advantages(rewards, mb.group_size, scale=scale)[:, None]
        return adv, {"adv_abs_mean": adv.abs().mean().item()}
    assert mb.turn_rewards is not None and mb.turn_ids is not None and mb.turns is not None, \
        "turn_credit=return_to_go needs the batch's turn_ids, turn_rewards and turns"
    turn_rewards = mb.turn_rewards
    if bonus is not None:
        last = (mb.turns - 1).clamp(min=0)[:, None]
        turn_rewards = turn_rewards.scatter_add(1, last, bonus[:, None].to(turn_rewards.dtype))
    per_turn = turn_advantages(turn_rewards, mb.group_size, cfg.turn_gamma, scale)  # [n, R]
    adv = per_turn.gather(1, mb.turn_ids)  # [n, T]
    tokens = mb.mask.sum().clamp(min=1).item()
    return adv, {"adv_abs_mean": per_turn[:, 0].abs().mean().item(),
                 "turn_adv_abs_mean": (adv.abs() * mb.mask).sum().item() / tokens}
