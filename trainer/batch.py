"""From groups out of the ring to training tensors, with shared-prompt packing.

A group is one row: its prompt once, then its K completions back to back. Each completion attends to the
prompt and to itself only (`segments` says which is which), so the prompt's forward and backward run once
per group instead of K times, and the result is exactly that of K separate sequences.
"""
from dataclasses import dataclass, fields

import torch

PAD = -1  # segment id of padding


@dataclass
class Batch:
    """G groups of K completions; rows of `input_ids` are groups, rows of `targets` are completions."""
    input_ids: torch.Tensor  # [G, L] prompt, completion 1, ..., completion K, padding
    position_ids: torch.Tensor  # [G, L] positions as if each completion followed the prompt alone
    segments: torch.Tensor  # [G, L] 0 prompt, i + 1 completion i, PAD padding
    gather: torch.Tensor  # [G, K * T] row index whose output predicts completion token t
    targets: torch.Tensor  # [G * K, T] completion tokens (0 in padding)
    # [G * K, T] float, 1.0 on the tokens the policy sampled (the record's loss mask): 0.0 on padding and on
    # the environment's tokens of a multi-turn episode, which every loss, count and diagnostic leaves out
    mask: torch.Tensor
    behav_logprobs: torch.Tensor  # [G * K, T], 0 where mask is 0
    versions: torch.Tensor  # [G * K, T] policy version that sampled each token (-1 where mask is 0)
    rewards: torch.Tensor  # [G * K]
    lens: torch.Tensor  # [G * K] completion tokens, sampled or not
    turn_ids: torch.Tensor  # [G * K, T] the policy turn each token belongs to (its observation: its turn's)
    turn_rewards: torch.Tensor  # [G * K, R] float, each turn's step reward (0 past an episode's turns)
    turns: torch.Tensor  # [G * K] policy turns of each episode
    group_size: int

    @property
    def num_groups(self) -> int:
        return self.input_ids.shape[0]

    @property
    def num_tokens(self) -> int:
        return int((self.segments != PAD).sum())

    def groups(self, start: int, stop: int) -> "Batch":
        """Groups [start, stop) as a smaller batch, trimmed to its own longest row and completion."""
        k = self.group_size
        return self._rows(slice(start, stop), slice(start * k, stop * k), stop - start)

    def take(self, index: list[int]) -> "Batch":
        """The groups at `index`, in that order, as a smaller batch (copies), trimmed as `groups` trims."""
        rows = torch.tensor(index, dtype=torch.long)
        seqs = (rows[:, None] * self.group_size + torch.arange(self.group_size)).reshape(-1)
        return self._rows(rows, seqs, len(index))

    def _rows(self, rows, seqs, count: int) -> "Batch":
        k = self.group_size
        t = max(int(self.lens[seqs].max()), 1)
        seg = self.segments[rows]
        length = int((seg != PAD).sum(1).max())
        steps = self.mask.shape[1]
        gather = self.gather[rows].view(-1, k, steps)[:, :, :t].reshape(count, k * t)
        return Batch(self.input_ids[rows, :length], self.position_ids[rows, :length], seg[:, :length],
                     gather, self.targets[seqs, :t], self.mask[seqs, :t], self.behav_logprobs[seqs, :t],
                     self.versions[seqs, :t], self.rewards[seqs], self.lens[seqs], self.turn_ids[seqs, :t],
                     self.turn_rewards[seqs], self.turns[seqs], k)

    def untied(self, multiple: int) -> list[int]:
        """The groups whose K rewards do not all tie, in order, topped up with the first tied ones to a
        positive multiple of `multiple` (the ranks: each takes an equal share): under a rule whose advantage
        is zero on a tie, the groups left out add nothing to the loss or its gradient."""
        rewards = self.rewards.view(-1, self.group_size)
        tied = (rewards == rewards[:, :1]).all(1).tolist()
        keep = [g for g, t in enumerate(tied) if not t]
        spare = [g for g, t in enumerate(tied) if t]
        short = -len(keep) % multiple or (multiple if not keep else 0)
        return sorted(keep + spare[:short])

    def to(self, device) -> "Batch":
        """The same batch on `device` (itself, tensor by tensor, when it is already there)."""
        return Batch(*(getattr(self, f.name).to(device) for f in fields(self) if f.name != "group_size"),
                     self.group_size)


def batch_for(groups: list, loss_fn) -> Batch:
    """The groups packed for the learner: whole, or as much of each as the rule reads (its `trim_group`:
    online_dpo's chosen and rejected completions)."""
    trim = getattr(loss_fn, "trim_group", None)
    return pack([trim(g) for g in groups] if trim else groups)


def pack(groups: list) -> Batch:
    k = groups[0].completion_ids.shape[0]
    lens = [[int(n) for n in g.completion_lens] for g in groups]
    length = max(len(g.prompt_ids) + sum(n) for g, n in zip(groups, lens))
    steps = max(max(n) for n in lens)
    count = len(groups)
    input_ids = torch.zeros(count, length, dtype=torch.long)
    position_ids = torch.zeros(count, length, dtype=torch.long)
    segments = torch.full((count, length), PAD, dtype=torch.long)
    gather = torch.zeros(count, k, steps, dtype=torch.long)
    targets = torch.zeros(count * k, steps, dtype=torch.long)
    mask = torch.zeros(count * k, steps)
    behav = torch.zeros(count * k, steps)
    versions = torch.zeros(count * k, steps, dtype=torch.long)
    rewards = torch.zeros(count * k)
    turn_ids = torch.zeros(count * k, steps, dtype=torch.long)
    turn_rewards = torch.zeros(count * k, max(g.turn_rewards.shape[1] for g in groups))
    turns = torch.cat([g.turns for g in groups])
    for row, (g, n) in enumerate(zip(groups, lens)):
        p = len(g.prompt_ids)
        input_ids[row, :p] = g.prompt_ids
        position_ids[row, :p] = torch.arange(p)
        segments[row, :p] = 0
        turn_rewards[row * k:(row + 1) * k, :g.turn_rewards.shape[1]] = g.turn_rewards
        offset = p
        for i in range(k):
            c, seq = n[i], row * k + i
            tokens = g.completion_ids[i, :c]
            input_ids[row, offset : offset + c] = tokens
            position_ids[row, offset : offset + c] = torch.arange(p, p + c)
            segments[row, offset : offset + c] = i + 1
            # token 0 is predicted by the prompt's last position, token t by completion token t - 1
            gather[row, i, :c] = torch.cat([torch.tensor([p - 1]), torch.arange(offset, offset + c - 1)])
            targets[seq, :c] = tokens
            sampled = g.loss_mask[i, :c]
            mask[seq, :c] = sampled.float()
            # Whatever the record holds where the policy sampled nothing stays out of every product with the
            # mask.
            behav[seq, :c] = torch.where(sampled, g.logprobs[i, :c], 0.0)
            versions[seq, :c] = torch.where(sampled, g.versions[i, :c], -1)
            rewards[seq] = g.rewards[i]
            turn_ids[seq, :c] = g.turn_ids[i, :c]
            offset += c
    return Batch(input_ids, position_ids, segments, gather.view(count, k * steps), targets, mask, behav,
                 versions, rewards, torch.tensor([n for row in lens for n in row]), turn_ids, turn_rewards,
                 turns, k)


@dataclass(frozen=True)
class SharedPrefix:
    """The first `length` tokens of every row's prompt are the same (a system prompt, an instruction, few-shot
    examples): row `row` keeps them, the other rows start after them and attend to that row's keys instead."""
    length: int
    row: int


def hoist_prefix(input_ids, position_ids, segments, gather):
    """Packed rows [G, L] (and their `gather` [G, K*T]) with the prompts' common prefix kept once: in the
    shortest row, the others shifted left past it (their positions unchanged). Returns (input_ids,
    position_ids, segments, gather, SharedPrefix) for rows of L' < L tokens, or None where that would not
    shorten them (one row, no common prefix, rows of one length). The prompts of the default task share 27 of
    their 45 tokens (SmolLM2's system prompt and "What is "): bench.train_step's 4-group pass drops from
    4 x 132 tokens to 4 x 105."""
    rows, length = segments.shape
    if rows < 2:
        return None
    prompt = segments == 0
    same = (input_ids == input_ids[:1]) & prompt & prompt[:1]
    common = int(same.all(0).int().cumprod(0).sum())
    # every row keeps at least its prompt's last token: its output predicts the completions' first
    common = min(common, int(prompt.sum(1).min()) - 1)
    if common < 1:
        return None
    used = (segments != PAD).sum(1)
    keeper = int(used.argmin())
    shift = torch.full((rows,), common, dtype=torch.long, device=segments.device)
    shift[keeper] = 0
    kept = used - shift
    new_length = int(kept.max())
    if new_length >= length:
        return None
    columns = torch.arange(new_length, device=segments.device)[None]
    pad = columns >= kept[:, None]
    take = (columns + shift[:, None]).clamp(max=length - 1)
    return (input_ids.gather(1, take).masked_fill(pad, 0), position_ids.gather(1, take).masked_fill(pad, 0),
            segments.gather(1, take).masked_fill(pad, PAD), (gather - shift[:, None]).clamp(min=0),
            SharedPrefix(common, keeper))


PASS_TOKENS = {"cpu": 4096, "cuda": 65536}  # train.micro_tokens=-1, by device type (runtime/schema.py)


def pass_tokens(micro_tokens: int, device_type: str) -> int:
    """train.micro_tokens with -1 settled for the device the passes run on."""
    return micro_tokens if micro_tokens >= 0 else PASS_TOKENS.get(device_type, PASS_TOKENS["cpu"])


def micro_batches(row_lens: list[int], ranks: int, max_groups: int,
                  max_tokens: int) -> list[list[tuple[int, int]]]:
    """Each rank's forward/backward passes over its share of the groups, as [start, stop) group ranges.

    Rank r takes groups [r * n, (r + 1) * n) of the batch, n = len(row_lens) // ranks. A pass holds at most
    `max_groups` groups and, with `max_tokens`, at most that many padded tokens (groups x its longest row):
    the activations a pass keeps for its backward grow with that, so long completions go through a few groups
    at a time (AReaL's dynamic micro-batching). A group longer than the budget goes alone. Every rank gets the
    same number of passes, since FSDP2's gathers run once per pass on every rank: a rank with fewer splits its
    biggest passes in two.
    """
    per_rank = len(row_lens) // ranks
    plans = []
    for first in range(0, per_rank * ranks, per_rank):
        passes, start, longest = [], first, 0
        for g in range(first, first + per_rank):
            longest = max(longest, row_lens[g])
            size = g + 1 - start
            if size > 1 and (size > max_groups or (max_tokens and size * longest > max_tokens)):
                passes.append((start, g))
                start, longest = g, row_lens[g]
        passes.append((start, first + per_rank))
        plans.append(passes)
    count = max(map(len, plans))
    for passes in plans:
        while len(passes) < count:
            a, b = max((p for p in passes if p[1] - p[0] > 1),
                       key=lambda p: (p[1] - p[0]) * max(row_lens[p[0]:p[1]]))
            i, middle = passes.index((a, b)), (a + b) // 2
            passes[i:i + 1] = [(a, middle), (middle, b)]
    return plans
