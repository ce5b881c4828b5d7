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
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch

import tasks
from buffer.ring import Group
from engines.base import Completion, Request, SamplingParams
from launch.cores import Threads
from launch.shared import SANDBOX_KILLS, Shared
from rewards.pool import RewardPool, ScoreHandle

if TYPE_CHECKING:
    from engines.base import EngineSpec
    from evaluate import Evaluator
    from launch.schema import Config
    from launch.setup import RunSetup


@dataclass(frozen=True)
class RolloutArgs:
    """One rollout worker process's arguments: built by the launcher (train.py), picklable, passed whole."""
    worker: int  # this worker's index: group ids interleave the workers
    workers: int  # the plan's rollout workers
    cfg: "Config"  # the run's typed config (launch/schema.py)
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
    with (RewardPool(data.reward, cfg.reward.workers, cfg.reward.timeout_s, data.reward_options) as pool,
          args.engine.open(setup.resume_path or setup.model_path, cfg.seed * 1000 + args.worker) as engine):
        engine.set_version(setup.resume_step)
        evaluation = args.evaluator.worker_part(args.worker, data, tokenizer, setup.eval_spec, pool)
        RolloutWorker(args, engine, args.shared.weights.follower(engine, args.worker), tokenizer, data, pool,
                      evaluation).run()


def prompt_stream(num_examples: int, worker_id: int, num_workers: int, seed: int):
    """Endless indices of this worker's shard of the train split, reshuffled every epoch."""
    shard = list(range(worker_id, num_examples, num_workers))
    rng = random.Random(seed * 7919 + worker_id)
    for _ in itertools.count():
        rng.shuffle(shard)
        yield from shard


@dataclass
class Scoring:
    """A group whose K completions are all in, waiting for its rewards."""
    completions: list[Completion]
    prompt_index: int
    group_id: int
    rewards: ScoreHandle


class RolloutWorker:
    """One worker's loop and its state. Group ids interleave the workers (group index * workers + worker), and a
    group's K requests are numbered group id * K + sample, so a finished completion names its group."""

    def __init__(self, args: RolloutArgs, engine, sync, tokenizer, task, pool, evaluation=None):
        """`engine` is open; `sync` its weight path's follower; `task` the task's data; `pool` its reward pool;
        `evaluation` this worker's part of the evaluation (GPU plan), or None."""
        rollout = args.cfg.rollout
        self.worker, self.workers, self.k = args.worker, args.workers, rollout.group_size
        self.sampling = SamplingParams(rollout.temperature, rollout.top_p, rollout.max_new_tokens, args.setup.stop_ids)
        self.max_prompt_len, self.long_prompts = args.setup.max_prompt_len, rollout.long_prompts
        self.engine, self.sync, self.tokenizer, self.task, self.pool = engine, sync, tokenizer, task, pool
        self.shared, self.counters, self.evaluation = args.shared, args.shared.counters, evaluation
        self.threads = Threads()
        self.heart = args.shared.heart(f"rollout-{self.worker}")
        self.stream = prompt_stream(len(task.train), self.worker, self.workers, args.cfg.seed)
        for _ in range(args.first_group):  # a resumed or restarted worker skips the prompts of groups delivered
            next(self.stream)
        self.next_group = args.first_group  # this worker's index of the next group it starts
        self.open: dict[int, tuple[int, dict[int, Completion]]] = {}  # group id -> (prompt index, {sample: completion})
        self.scoring: deque[Scoring] = deque()  # oldest first: groups enter the ring in the order they filled

    def run(self) -> None:
        heart = self.heart
        while not self.shared.rollouts_over():  # the launcher's stop, or the trainer's last step taken
            heart.beat("load_weights")
            self.collect(self.sync())  # new weights, if any; an engine that interrupts requests may finish some
            if self.evaluation is not None:
                for request in self.evaluation.poll(self.engine.version):
                    self.engine.add(request)
            while self.engine.free_slots() - self.engine.num_waiting() >= self.k and self.shared.gate.try_start():
                self.start_group()
            if not self.deliver_scored():
                return  # rollouts ended while the ring was full
            if self.engine.num_running() + self.engine.num_waiting() == 0:
                if self.scoring:
                    heart.beat("score")
                    time.sleep(0.005)  # nothing to generate; the oldest group is still being scored
                else:
                    heart.beat("wait_gate")
                    if self.shared.gate.wait_start(timeout=0.2):
                        self.start_group()
                continue
            if self.shared.cores is not None:  # the cores go where the work is (launch/cores.py)
                self.threads.set(self.shared.cores.worker_threads())
            heart.beat("generate")
            self.collect(self.engine.step())
        heart.beat("done")

    def start_group(self) -> None:
        """A new group, already counted by the gate: K requests of the next prompt."""
        index, ids = self.next_prompt()
        group_id = self.next_group * self.workers + self.worker
        self.next_group += 1
        self.counters.add(self.worker, "started")
        self.counters.set(self.worker, "next_group", self.next_group)
        self.open[group_id] = (index, {})
        for i in range(self.k):
            self.engine.add(Request(group_id * self.k + i, ids, self.sampling))

    def next_prompt(self) -> tuple[int, list[int]]:
        """The next prompt of this worker's shard that fits rollout.max_prompt_len, cut to fit if so configured."""
        for index in self.stream:
            ids = tasks.prompt_ids(self.tokenizer, self.task.train[index].question)
            budget = self.max_prompt_len
            if not budget or len(ids) <= budget:
                return index, ids
            if self.long_prompts == "truncate":
                self.counters.add(self.worker, "prompts_truncated")
                # cut the middle: the end of a chat prompt is the assistant header the model continues from
                tail = min(8, budget // 2)
                return index, ids[:budget - tail] + ids[-tail:]
            self.counters.add(self.worker, "prompts_skipped")

    def collect(self, finished: list[Completion]) -> None:
        """Completions out of the engine: evaluation's to the evaluation, rollouts' into their groups; a group
        whose K samples are in goes to the reward pool."""
        for done in finished:
            if self.evaluation is not None and self.evaluation.owns(done):
                self.evaluation.add(done)
                continue
            self.counters.add(self.worker, "tokens", len(done.token_ids))
            group_id, sample = divmod(done.request_id, self.k)
            index, samples = self.open[group_id]
            samples[sample] = done
            if len(samples) == self.k:
                del self.open[group_id]
                completions = [samples[i] for i in range(self.k)]
                texts = self.tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
                handle = self.pool.submit(texts, [self.task.train[index].answer] * self.k)
                self.scoring.append(Scoring(completions, index, group_id, handle))

    def deliver_scored(self) -> bool:
        """Scored groups into the ring, oldest first; False if rollouts ended while the ring was full."""
        while self.scoring and self.scoring[0].rewards.done():
            scored = self.scoring.popleft()
            group = to_group(scored.completions, scored.rewards.result(), scored.prompt_index, scored.group_id,
                             self.worker)
            while not self.shared.ring.put(group, timeout=0.5):
                self.heart.beat("ring_put")
                if self.shared.rollouts_over():
                    return False
            self.counters.add(self.worker, "groups")
            self.counters.set(self.worker, "reward_timeouts", self.pool.timeouts)
            self.counters.set(self.worker, "reward_errors", self.pool.errors)
            for name in SANDBOX_KILLS:
                self.counters.set(self.worker, name, self.pool.counts[name])
        return True


def to_group(completions: list[Completion], rewards: list[float], index: int, group_id: int,
             worker_id: int) -> Group:
    """K completions of one prompt and their rewards as one ring entry, padded to the longest."""
    width = max(len(c.token_ids) for c in completions)
    k = len(completions)
    ids, logprobs = torch.zeros(k, width, dtype=torch.long), torch.zeros(k, width)
    versions = torch.zeros(k, width, dtype=torch.long)
    for i, c in enumerate(completions):
        n = len(c.token_ids)
        ids[i, :n] = torch.tensor(c.token_ids)
        logprobs[i, :n] = torch.tensor(c.logprobs)
        versions[i, :n] = torch.tensor(c.versions)
    return Group(
        prompt_ids=torch.tensor(completions[0].prompt_ids),
        completion_ids=ids,
        completion_lens=torch.tensor([len(c.token_ids) for c in completions]),
        logprobs=logprobs,
        versions=versions,
        rewards=torch.tensor(rewards, dtype=torch.float32),
        truncated=torch.tensor([c.finish_reason == "length" for c in completions]),
        prompt_index=index,
        group_id=group_id,
        worker_id=worker_id,
    )
