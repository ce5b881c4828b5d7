"""Accuracy on a task's test split: greedy pass@1 and sampled pass@k.

Used by the learner every `eval.every` steps and at the end, and by `python train.py eval.only=true`. On the
CPU plan rank 0 generates with a CPU engine of its own (`Evaluator`); on the GPU plan, where that would take
hours for a big model, each rollout worker generates its shard of the test split on its SGLang engine
(`EvalShard`) and rank 0 merges the scores (`EvalChannel`).
"""
import queue
import time
from dataclasses import dataclass

import torch

import tasks
from engines.cpu import CPUEngine, Request, SamplingParams
from rewards.pool import RewardPool


@dataclass
class EvalSpec:
    """What an evaluation needs (built by train.py from the config)."""
    k: int  # samples per prompt for pass@k
    temperature: float  # sampling temperature of the pass@k samples
    max_new_tokens: int
    max_examples: int  # 0: the whole test split
    stop_ids: tuple
    seed: int
    reward_workers: int
    reward_timeout_s: float
    dtype: str = "float32"  # the engine's weights, as in rollout.dtype


def test_examples(task, spec: EvalSpec) -> list:
    return task.test[: spec.max_examples] if spec.max_examples else task.test


def longest_request(task, tokenizer, spec: EvalSpec) -> int:
    """Prompt + completion tokens of the longest evaluation request: a CPU engine's max_len."""
    prompts = (len(tasks.prompt_ids(tokenizer, ex.question)) for ex in test_examples(task, spec))
    return max(prompts, default=0) + spec.max_new_tokens


def eval_requests(prompts: dict[int, list[int]], spec: EvalSpec) -> list[Request]:
    """Per test example i: one greedy request and `spec.k` sampled ones, with ids -1 - (i * (k + 1) + m),
    m = 0 for the greedy one: negative, so they never meet a rollout's (group * K + sample) in one engine."""
    greedy = SamplingParams(0.0, 1.0, spec.max_new_tokens, spec.stop_ids)
    sampled = SamplingParams(spec.temperature, 1.0, spec.max_new_tokens, spec.stop_ids)
    return [Request(-1 - (i * (spec.k + 1) + m), ids, greedy if m == 0 else sampled)
            for i, ids in prompts.items() for m in range(spec.k + 1)]


def eval_slot(request_id: int, k: int) -> tuple[int, int]:
    """(test example, m) of an evaluation request id; m = 0 is the greedy sample."""
    return divmod(-1 - request_id, k + 1)


def eval_metrics(scores: dict[int, list[float]]) -> dict:
    """From each test example's scores (greedy first, then the k samples) to the logged metrics."""
    if not scores:
        return {}
    n, k = len(scores), len(next(iter(scores.values()))) - 1
    return {
        "eval_pass@1": sum(s[0] for s in scores.values()) / n,  # greedy
        f"eval_pass@{k}": sum(max(s[1:]) for s in scores.values()) / n,
        "eval_sample_reward": sum(sum(s[1:]) for s in scores.values()) / (n * k),
        "eval_examples": n,
    }


def evaluate(engine, tokenizer, task, spec: EvalSpec) -> dict:
    """The whole test split (up to max_examples) on one engine, a CPUEngine or an SGLangEngine."""
    examples = test_examples(task, spec)
    shard = EvalShard(0, range(len(examples)), examples, tokenizer, spec)
    for completion in engine.generate(shard.requests):
        shard.add(completion)
    with RewardPool(task.reward, spec.reward_workers, spec.reward_timeout_s, task.reward_options) as pool:
        shard.score(tokenizer, pool)
        return eval_metrics(shard.scores())


class Evaluator:
    """The CPU plan's: an engine kept for repeated evaluations; the learner loads each new policy into
    `targets` (the engine's weight tensors) and calls it, without holding a second Hugging Face model."""

    def __init__(self, model, tokenizer, task, spec: EvalSpec):
        self.tokenizer, self.task, self.spec = tokenizer, task, spec
        self.engine = CPUEngine(model, max_batch=64, max_len=longest_request(task, tokenizer, spec), seed=spec.seed,
                                dtype=getattr(torch, spec.dtype))
        self.targets = self.engine.weight_tensors()

    def __call__(self, version: int, stop=None) -> dict:
        return evaluate(self.engine, self.tokenizer, self.task, self.spec)


class EvalShard:
    """The test examples `indices` under the weights of `version`: their requests, the completions as they
    finish (`add`), then their scores (`score`, asynchronous in the reward pool)."""

    def __init__(self, version: int, indices, examples: list, tokenizer, spec: EvalSpec):
        self.version, self.k, self.references = version, spec.k, {i: examples[i].answer for i in indices}
        self.requests = eval_requests({i: tasks.prompt_ids(tokenizer, examples[i].question) for i in indices}, spec)
        self.completions: dict[int, object] = {}
        self.handle = None

    def add(self, completion) -> None:
        self.completions[completion.request_id] = completion

    def generated(self) -> bool:
        return len(self.completions) == len(self.requests)

    def score(self, tokenizer, pool) -> None:
        ids = [r.request_id for r in self.requests]
        texts = tokenizer.batch_decode([self.completions[i].token_ids for i in ids], skip_special_tokens=True)
        self.handle = pool.submit(texts, [self.references[eval_slot(i, self.k)[0]] for i in ids])

    def done(self) -> bool:
        if not self.requests:  # a worker with no test examples (more workers than examples)
            return True
        return self.handle is not None and self.handle.done()

    def scores(self) -> dict[int, list[float]]:
        """Test example -> [greedy score, k sampled scores]."""
        out = {i: [0.0] * (self.k + 1) for i in self.references}
        for request, score in zip(self.requests, self.handle.result() if self.requests else []):
            i, m = eval_slot(request.request_id, self.k)
            out[i][m] = score
        return out


class EvalChannel:
    """Evaluation on the rollout workers' engines: rank 0 asks every worker to score its shard of the test
    split (example i goes to worker i % workers) under the weights it just published, and waits for them.
    Built by the launcher before spawning (multiprocessing queues), handed to rank 0 and every worker."""

    targets = None  # the learner copies no weights for it: the engines already have them

    def __init__(self, num_workers: int, ctx):
        self.inboxes = [ctx.Queue() for _ in range(num_workers)]
        self.results = ctx.Queue()

    # rank 0
    def __call__(self, version: int, stop=None, timeout_s: float = 24 * 3600.0) -> dict:
        """Every worker's scores of `version` merged into the metrics; {} if `stop` is set meanwhile."""
        for inbox in self.inboxes:
            inbox.put(version)
        scores, replied, deadline = {}, set(), time.time() + timeout_s
        while len(replied) < len(self.inboxes):
            if (stop is not None and stop.is_set()) or time.time() > deadline:
                return {}
            try:
                worker, v, shard = self.results.get(timeout=0.5)
            except queue.Empty:
                continue
            if v == version:
                replied.add(worker)
                scores.update(shard)
        return eval_metrics(scores)

    # a rollout worker
    def job(self, worker: int) -> int | None:
        """The version rank 0 wants evaluated, if it asked."""
        try:
            return self.inboxes[worker].get_nowait()
        except queue.Empty:
            return None

    def shard(self, worker: int, version: int, task, tokenizer, spec: EvalSpec) -> EvalShard:
        examples = test_examples(task, spec)
        return EvalShard(version, range(worker, len(examples), len(self.inboxes)), examples, tokenizer, spec)

    def reply(self, worker: int, shard: EvalShard) -> None:
        self.results.put((worker, shard.version, shard.scores()))

    def close(self) -> None:
        for q in (*self.inboxes, self.results):
            q.close()
            q.join_thread()
