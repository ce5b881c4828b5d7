"""Rollout worker: prompts -> K sampled completions each -> rewards -> trajectory ring.

The worker asks the staleness gate before starting a group, keeps the engine's slots full (continuous
batching), and loads new weights between two decode steps: sequences in flight continue, and their later
tokens carry the new policy version. Finished groups are scored by the reward pool (worker processes with a
timeout) while generation goes on. On the GPU plan the worker also generates and scores its shard of the test
split when rank 0 asks (evaluate.EngineEvaluation), next to its rollouts.
"""
import itertools
import random
import time
from collections import deque
from contextlib import nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

import tasks
from buffer.ring import Group
from engines.base import Completion, SamplingParams
from envs.agent import align_group, episodes_for
from envs.episode import Episode
from rewards.pool import RewardPool, ScoreHandle
from runtime.cores import Threads
from runtime.shared import SANDBOX_KILLS, Shared

if TYPE_CHECKING:
    from engines.base import EngineSpec
    from evaluate import Evaluator
    from runtime.schema import Config
    from runtime.setup import RunSetup


@dataclass(frozen=True)
class RolloutArgs:
    """One rollout worker process's arguments: built by the launcher (train.py), picklable, passed whole."""
    worker: int  # this worker's index: group ids interleave the workers
    workers: int  # the plan's rollout workers
    cfg: "Config"  # the run's typed config (runtime/schema.py)
    setup: "RunSetup"  # what the launcher settled: the model's folder, its stop tokens, the prompt width, ...
    engine: "EngineSpec"  # how this worker builds its engine (the plan's)
    evaluator: "Evaluator"  # how the plan evaluates: this worker's part of it, if any
    shared: Shared
    first_group: int = 0  # a resumed or restarted worker starts past the groups delivered before


def run(args: RolloutArgs) -> None:
    """One rollout worker process. A resumed run's worker starts from the checkpoint's weights and version."""
    cfg, setup = args.cfg, args.setup
    tokenizer = tasks.load_tokenizer(setup.model_path, cfg.model.chat_template)
    data = tasks.get(cfg.task.name).build(cfg.task, cfg.seed)
    # A multi-turn task's rewards come from its environment, stepped beside the engine (envs/episode.py).
    scorer = RewardPool(data.reward, cfg.reward.workers, cfg.reward.timeout_s, data.reward_options) \
        if not data.multi_turn else nullcontext(None)
    engine_cm = args.engine.open(setup.resume_path or setup.model_path, cfg.seed * 1000 + args.worker)
    with scorer as pool, engine_cm as engine:
        engine.set_version(setup.resume_step)
        evaluation = args.evaluator.worker_part(args.worker, data, tokenizer, setup.eval_spec, pool)
        worker = RolloutWorker(args, engine, args.shared.weights.follower(engine, args.worker), tokenizer,
                               data, pool, evaluation)
        try:
            worker.run()
        finally:
            worker.turns.close()


def prompt_stream(num_examples: int, worker_id: int, num_workers: int, seed: int):
    """Endless indices of this worker's shard of the train split, reshuffled every epoch."""
    shard = list(range(worker_id, num_examples, num_workers))
    rng = random.Random(seed * 7919 + worker_id)
    for _ in itertools.count():
        rng.shuffle(shard)
        yield from shard


@dataclass
class Scoring:
    """A group whose K episodes have all ended, waiting for its rewards."""
    episodes: list[Episode]
    prompt_index: int
    group_id: int
    rewards: "ScoreHandle | Scored"


@dataclass
class Scored:
    """Rewards known already: a multi-turn group's, summed from its environments' steps."""
    rewards: list[float]

    def done(self) -> bool:
        return True

    def result(self) -> list[float]:
        return self.rewards


class RolloutWorker:
    """One worker's loop and its state. Group ids interleave the workers (group index * workers + worker), and
    a group's K requests are numbered group id * K + sample, so a finished completion names its group."""

    def __init__(self, args: RolloutArgs, engine, sync, tokenizer, task, pool, evaluation=None):
        """`engine` is open; `sync` its weight path's follower; `task` the task's data; `pool` its reward
        pool; `evaluation` this worker's part of the evaluation (GPU plan), or None."""
        rollout = args.cfg.rollout
        self.worker, self.workers, self.k = args.worker, args.workers, rollout.group_size
        self.sampling = SamplingParams(rollout.temperature, rollout.top_p, rollout.max_new_tokens,
                                       args.setup.stop_ids)
        self.max_prompt_len, self.long_prompts = args.setup.max_prompt_len, rollout.long_prompts
        self.engine, self.sync, self.tokenizer, self.task, self.pool = engine, sync, tokenizer, task, pool
        self.shared, self.counters, self.evaluation = args.shared, args.shared.counters, evaluation
        self.threads = Threads()
        self.heart = args.shared.heart(f"rollout-{self.worker}")
        self.stream = prompt_stream(len(task.train), self.worker, self.workers, args.cfg.seed)
        # a resumed or restarted worker skips the prompts of groups delivered
        for _ in range(args.first_group):
            next(self.stream)
        self.next_group = args.first_group  # this worker's index of the next group it starts
        # The turns of every episode (envs/episode.py); a one-shot completion is an episode of one turn.
        self.turns = episodes_for(engine, tokenizer, task, args.cfg.env, self.sampling,
                                  rollout.max_new_tokens, args.cfg.seed * 1000 + self.worker, self._count,
                                  self.max_prompt_len)
        # group id -> (prompt index, {sample: episode})
        self.open: dict[int, tuple[int, dict[int, Episode]]] = {}
        self.scoring: deque[Scoring] = deque()  # oldest first: groups enter the ring in the order they filled

    def _decoding(self, decoding: bool) -> None:
        """Tell the trainer whether this worker is decoding: a shared step takes its core while it is not
        (runtime/cores.py)."""
        if self.shared.cores is not None:
            self.shared.cores.worker_decoding(self.worker, decoding)

    def _count(self, name: str, n: int = 1) -> None:
        self.counters.add(self.worker, name, n)

    def run(self) -> None:
        heart = self.heart
        while not self.shared.rollouts_over():  # the launcher's stop, or the trainer's last step taken
            heart.beat("load_weights")
            # new weights, if any; an engine that interrupts requests may finish some
            self.collect(self.sync())
            if self.evaluation is not None:
                for request in self.evaluation.poll(self.engine.version):
                    self.engine.add(request)
            while (self.engine.free_slots() - self.engine.num_waiting() >= self.k
                    and self.shared.gate.try_start()):
                self.start_group()
            if not self.deliver_scored():
                return  # rollouts ended while the ring was full
            self.collect_episodes(self.turns.poll())
            if self.engine.num_running() + self.engine.num_waiting() == 0:
                self._decoding(False)
                if self.turns.busy():
                    heart.beat("env_wait")
                    time.sleep(0.002)  # every episode waits for its environment; the gate may open meanwhile
                elif self.scoring:
                    heart.beat("score")
                    time.sleep(0.005)  # nothing to generate; the oldest group is still being scored
                else:
                    heart.beat("wait_gate")
                    if self.shared.gate.wait_start(timeout=0.2):
                        self.start_group()
                continue
            self._decoding(True)
            if self.shared.cores is not None:  # the cores go where the work is (runtime/cores.py)
                self.threads.set(self.shared.cores.worker_threads())
            heart.beat("generate")
            self.collect(self.engine.step())
        self._decoding(False)
        heart.beat("done")

    def start_group(self) -> None:
        """A new group, already counted by the gate: K episodes of the next prompt."""
        index, ids, messages = self.next_prompt()
        group_id = self.next_group * self.workers + self.worker
        self.next_group += 1
        self.counters.add(self.worker, "started")
        self.counters.set(self.worker, "next_group", self.next_group)
        self.open[group_id] = (index, {})
        for i in range(self.k):
            self.turns.start(group_id * self.k + i, ids, messages, self.task.train[index])

    def next_prompt(self) -> tuple[int, list[int], list[dict]]:
        """The next prompt of this worker's shard that fits rollout.max_prompt_len, cut to fit if so
        configured, and its messages."""
        for index in self.stream:
            ids, messages = self.turns.prompt(self.task.train[index])
            budget = self.max_prompt_len
            if not budget or len(ids) <= budget:
                return index, ids, messages
            if self.long_prompts == "truncate":
                self.counters.add(self.worker, "prompts_truncated")
                # cut the middle: the end of a chat prompt is the assistant header the model continues from
                tail = min(8, budget // 2)
                return index, ids[:budget - tail] + ids[-tail:], messages
            self.counters.add(self.worker, "prompts_skipped")

    def collect(self, finished: list[Completion]) -> None:
        """Completions out of the engine: evaluation's to the evaluation, rollouts' to their episodes."""
        ended = []
        for done in finished:
            if self.evaluation is not None and self.evaluation.owns(done):
                self.evaluation.add(done)
                continue
            self.counters.add(self.worker, "tokens", len(done.token_ids))
            episode = self.turns.completed(done)
            if episode is not None:
                ended.append(episode)
        self.collect_episodes(ended)

    def collect_episodes(self, ended: list[Episode]) -> None:
        """Episodes that ended into their groups; a group whose K episodes are in goes to be scored: by the
        reward pool (one-shot), or at once by the rewards its environment gave (multi-turn)."""
        for episode in ended:
            group_id, sample = divmod(episode.key, self.k)
            index, samples = self.open[group_id]
            samples[sample] = episode
            if len(samples) < self.k:
                continue
            del self.open[group_id]
            episodes = [samples[i] for i in range(self.k)]
            if self.task.agent is not None:  # each agent episode's prompt is its own workflow's first request
                align_group(episodes, self.sampling.stop_token_ids[0], self.turns.budget, self._count)
            if not self.task.multi_turn:
                texts = self.tokenizer.batch_decode([e.token_ids for e in episodes], skip_special_tokens=True)
                handle = self.pool.submit(texts, [self.task.train[index].answer] * self.k)
            else:
                handle = Scored([e.reward for e in episodes])
            self.scoring.append(Scoring(episodes, index, group_id, handle))

    def deliver_scored(self) -> bool:
        """Scored groups into the ring, oldest first; False if rollouts ended while the ring was full."""
        while self.scoring and self.scoring[0].rewards.done():
            scored = self.scoring.popleft()
            group = to_group(scored.episodes, scored.rewards.result(), scored.prompt_index, scored.group_id,
                             self.worker)
            while not self.shared.ring.put(group, timeout=0.5):
                self._decoding(False)  # the ring is full: nothing decodes until the trainer takes a group
                self.heart.beat("ring_put")
                if self.shared.rollouts_over():
                    return False
            self.counters.add(self.worker, "groups")
            if self.pool is not None:
                self.counters.set(self.worker, "reward_timeouts", self.pool.timeouts)
                self.counters.set(self.worker, "reward_errors", self.pool.errors)
                for name in SANDBOX_KILLS:
                    self.counters.set(self.worker, name, self.pool.counts[name])
            engine = self.engine
            self.counters.set(self.worker, "resumed_prefills", getattr(engine, "resumed", 0))
            self.counters.set(self.worker, "full_prefills", getattr(engine, "resume_misses", 0))
        return True


def to_group(episodes: list[Episode], rewards: list[float], index: int, group_id: int,
             worker_id: int) -> Group:
    """K episodes of one prompt and their rewards as one ring entry, padded to the longest. An episode's
    tokens after the prompt are its completion; the loss mask marks those the policy sampled, and none of a
    masked episode's (its finish is one of env.mask): no loss term reads it, while its reward still counts in
    its group's baseline. Each turn's reward is its environment step's; an episode without steps (one-shot,
    agent code) holds its reward on its last turn."""
    width = max(len(e.token_ids) for e in episodes)
    k = len(episodes)
    ids, logprobs = torch.zeros(k, width, dtype=torch.long), torch.zeros(k, width)
    versions, turn_ids = torch.zeros(k, width, dtype=torch.long), torch.zeros(k, width, dtype=torch.long)
    mask = torch.zeros(k, width, dtype=torch.bool)
    turn_rewards = torch.zeros(k, max(max(e.turns for e in episodes), 1))
    for i, e in enumerate(episodes):
        n = len(e.token_ids)
        ids[i, :n] = torch.tensor(e.token_ids)
        logprobs[i, :n] = torch.tensor(e.logprobs)
        versions[i, :n] = torch.tensor(e.versions)
        turn_ids[i, :n] = torch.tensor(e.turn_ids)
        if not e.masked:
            mask[i, :n] = torch.tensor(e.mask)
        if e.turn_rewards:
            turn_rewards[i, :len(e.turn_rewards)] = torch.tensor(e.turn_rewards)
        else:
            turn_rewards[i, max(e.turns - 1, 0)] = rewards[i]
    return Group(
        prompt_ids=torch.tensor(episodes[0].prompt_ids),
        completion_ids=ids,
        completion_lens=torch.tensor([len(e.token_ids) for e in episodes]),
        logprobs=logprobs,
        versions=versions,
        rewards=torch.tensor(rewards, dtype=torch.float32),
        truncated=torch.tensor([e.finish == "budget" for e in episodes]),
        prompt_index=index,
        group_id=group_id,
        worker_id=worker_id,
        loss_mask=mask,
        turn_ids=turn_ids,
        turns=torch.tensor([e.turns for e in episodes]),
        finish=torch.tensor([e.finish_code for e in episodes]),
        turn_rewards=turn_rewards,
    )
