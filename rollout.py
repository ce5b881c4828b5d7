"""Rollout worker: prompts -> K sampled completions each -> rewards -> trajectory ring.

The worker asks the staleness gate before starting a group, keeps the engine's slots full (continuous
batching), and loads new weights between two decode steps: sequences in flight continue, and their later
tokens carry the new policy version. Finished groups are scored by the reward pool (worker processes with a
timeout) while generation goes on. On the GPU plan the worker also generates and scores its shard of the test
split when rank 0 asks (evaluate.EvalChannel), next to its rollouts.
"""
import itertools
import random
import time
from dataclasses import dataclass

import torch

import tasks
from buffer.ring import Group
from engines.cpu import Request, SamplingParams
from rewards.pool import RewardPool

# Columns of the shared per-worker counters, read by the learner for its metrics and by the launcher when a
# worker dies: groups started / delivered / next index tell it what was lost and where a replacement starts.
STAT_COLUMNS = ("tokens", "groups", "reward_timeouts", "reward_errors", "started", "next_group", "restarts",
                "lost_groups", "prompts_truncated", "prompts_skipped")
(TOKENS, GROUPS, REWARD_TIMEOUTS, REWARD_ERRORS, STARTED, NEXT_GROUP, RESTARTS, LOST_GROUPS, PROMPTS_TRUNCATED,
 PROMPTS_SKIPPED) = range(len(STAT_COLUMNS))


@dataclass
class WorkerSpec:
    """The values one rollout worker needs (built by train.py from the config)."""
    worker_id: int
    num_workers: int
    seed: int
    model_path: str
    task: str
    task_cfg: object
    group_size: int
    engine: object  # how to build the engine: engines.cpu.CPUEngineSpec or engines.sglang.SGLangSpec
    sampling: SamplingParams
    reward_workers: int = 1  # verifier processes (0: score in this process, no timeout)
    reward_timeout_s: float = 5.0  # a verifier slower than this scores 0 and is counted
    init_path: str = ""  # starting weights (a checkpoint when resuming); "" = model_path
    start_version: int = 0  # policy version of those weights
    first_group: int = 0  # groups of this worker already delivered (resuming): skip their prompts
    max_prompt_len: int = 0  # longer prompts are cut or skipped (0: no limit)
    long_prompts: str = "skip"  # skip | truncate (cut from the middle, keeping the last 8 tokens)
    evals: object = None  # evaluate.EvalChannel: rank 0's requests to evaluate on this engine (GPU plan)
    eval: object = None  # evaluate.EvalSpec for them


def prompt_stream(num_examples: int, worker_id: int, num_workers: int, seed: int):
    """Endless indices of this worker's shard of the train split, reshuffled every epoch."""
    shard = list(range(worker_id, num_examples, num_workers))
    rng = random.Random(seed * 7919 + worker_id)
    for _ in itertools.count():
        rng.shuffle(shard)
        yield from shard


def run(spec: WorkerSpec, ring, gate, weights, gen_stats, stop) -> None:
    """One rollout worker. `weights` is the plan's weight path: a WeightStore (CPU) or a GPUWeights."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(spec.model_path)
    task = tasks.get(spec.task).build(spec.task_cfg, spec.seed)
    seed = spec.seed * 1000 + spec.worker_id
    with (RewardPool(task.reward, spec.reward_workers, spec.reward_timeout_s, task.reward_options) as pool,
          spec.engine.open(spec.init_path or spec.model_path, seed) as engine):
        engine.set_version(spec.start_version)
        sync = weights.follower(engine, spec.worker_id)
        _generate(spec, ring, gate, engine, sync, gen_stats, stop, tokenizer, task, pool)


def _generate(spec, ring, gate, engine, sync, gen_stats, stop, tokenizer, task, pool):
    stream = prompt_stream(len(task.train), spec.worker_id, spec.num_workers, spec.seed)
    for _ in range(spec.first_group):
        next(stream)
    k = spec.group_size
    open_groups: dict[int, tuple[int, dict]] = {}  # group id -> (prompt index, {sample: Completion})
    scoring: list[tuple] = []  # (completions, prompt index, group id, reward handle), oldest first
    next_group = spec.first_group

    def start_group():
        nonlocal next_group
        index, ids = next_prompt()
        group_id = next_group * spec.num_workers + spec.worker_id
        next_group += 1
        stats[STARTED] += 1
        stats[NEXT_GROUP] = next_group
        open_groups[group_id] = (index, {})
        for i in range(k):
            engine.add(Request(group_id * k + i, ids, spec.sampling))

    def next_prompt():
        for index in stream:
            ids = tasks.prompt_ids(tokenizer, task.train[index].question)
            if not spec.max_prompt_len or len(ids) <= spec.max_prompt_len:
                return index, ids
            if spec.long_prompts == "truncate":
                stats[PROMPTS_TRUNCATED] += 1
                # cut the middle: the end of a chat prompt is the assistant header the model continues from
                tail = min(8, spec.max_prompt_len // 2)
                return index, ids[:spec.max_prompt_len - tail] + ids[-tail:]
            stats[PROMPTS_SKIPPED] += 1

    evaluation = None  # an evaluate.EvalShard under way: rank 0 asked for this engine's share of the test split

    def start_evaluation(version):
        while engine.version < version and not stop.is_set():  # the CPU store may not be loaded yet
            for done in sync():
                finish(done)
            time.sleep(0.01)
        shard = spec.evals.shard(spec.worker_id, version, task, tokenizer, spec.eval)
        for request in shard.requests:
            engine.add(request)
        return shard

    def finish(done):
        if done.request_id < 0:  # an evaluation request (evaluate.eval_requests)
            evaluation.add(done)
            if evaluation.generated():
                evaluation.score(tokenizer, pool)
            return
        stats[TOKENS] += len(done.token_ids)
        group_id, sample = divmod(done.request_id, k)
        index, samples = open_groups[group_id]
        samples[sample] = done
        if len(samples) == k:
            del open_groups[group_id]
            completions = [samples[i] for i in range(k)]
            texts = tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
            handle = pool.submit(texts, [task.train[index].answer] * k)
            scoring.append((completions, index, group_id, handle))

    stats = gen_stats[spec.worker_id]
    while not stop.is_set():
        for done in sync():  # new weights, if any; an engine that interrupts requests to load them may finish some
            finish(done)
        if spec.evals is not None and evaluation is None and (version := spec.evals.job(spec.worker_id)) is not None:
            evaluation = start_evaluation(version)
        if evaluation is not None and evaluation.done():
            spec.evals.reply(spec.worker_id, evaluation)
            evaluation = None
        while engine.free_slots() - engine.num_waiting() >= k and gate.try_start():
            start_group()
        while scoring and scoring[0][3].done():
            completions, index, group_id, handle = scoring.pop(0)
            group = _to_group(completions, handle.result(), index, group_id, spec.worker_id)
            while not ring.put(group, timeout=0.5):
                if stop.is_set():
                    return
            stats[GROUPS] += 1
            stats[REWARD_TIMEOUTS], stats[REWARD_ERRORS] = pool.timeouts, pool.errors
        if engine.num_running() + engine.num_waiting() == 0:
            if scoring:
                time.sleep(0.005)  # nothing to generate; the oldest group is still being scored
            elif gate.wait_start(timeout=0.2):
                start_group()
            continue
        for done in engine.step():
            finish(done)


def _to_group(completions: list, rewards: list[float], index: int, group_id: int, worker_id: int) -> Group:
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


def reclaim_worker(ring, gate, gen_stats, w: int) -> int:
    """After worker w died: its half-written ring slot is freed, the groups it started but never delivered are
    dropped and their staleness budget handed back. Groups it had put in the ring stay (none lost, none twice)."""
    ring.reclaim(w)
    gate.recover()
    stats = gen_stats[w]
    lost = int(stats[STARTED] - stats[GROUPS])
    if lost > 0:
        gate.cancel(lost)
    stats[STARTED] = stats[GROUPS]
    stats[LOST_GROUPS] += lost
    stats[RESTARTS] += 1
    return lost
