"""Accuracy on a task's test split: greedy pass@1 and sampled pass@k.

Used by the learner every `eval.every` steps and at the end, and by `python train.py eval.only=true`. Rank 0
asks an `Evaluator` for the metrics of the version it just published. On the CPU plan that is
`EngineEvaluator`, a built-in engine of rank 0's own; on the GPU plan, where that would take hours for a big
model, it is `EvalChannel`: each rollout worker generates its shard of the test split on its engine
(`EngineEvaluation`, polled by the worker's loop) and rank 0 merges the scores.
"""
import queue
import time
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import TYPE_CHECKING, Callable, Protocol, runtime_checkable

import tasks
from engines.base import Completion, Request, SamplingParams
from heap import release_free_heap
from rewards.pool import RewardPool
from runtime.setup import EvalSpec

if TYPE_CHECKING:
    from engines.base import EngineSpec


@runtime_checkable
class Evaluator(Protocol):
    """How rank 0 evaluates the weights it has just published: `EngineEvaluator` on an engine of its own (CPU
    plan) or `EvalChannel` on the rollout workers' engines (GPU plan). The launcher builds it from the plan
    before the first spawn and hands it to rank 0 and to every rollout worker."""

    def open(self, model_path: str, weights, task,
             spec: EvalSpec) -> AbstractContextManager[Callable[..., dict]]:
        """Rank 0's end, for the whole run: `evaluate(version, stop=None)` gives the `eval_*` metrics of the
        version just published through `weights` (the plan's WeightPath); {} if `stop` is set meanwhile."""
        ...

    def worker_part(self, worker: int, task, tokenizer, spec: EvalSpec, pool) -> "EngineEvaluation | None":
        """A rollout worker's end: what its loop polls (None: the worker takes no part)."""
        ...


def test_examples(task, spec: EvalSpec) -> list:
    n = spec.eval.max_examples
    return task.test[:n] if n else task.test


def longest_request(task, tokenizer, spec: EvalSpec) -> int:
    """Prompt + completion tokens of the longest evaluation request: a built-in engine's max_len."""
    prompts = map(len, tasks.first_prompts(tokenizer, task, test_examples(task, spec)))
    return max(prompts, default=0) + spec.max_new_tokens


def eval_requests(prompts: dict[int, list[int]], spec: EvalSpec) -> list[Request]:
    """Per test example i: one greedy request and `spec.k` sampled ones, with ids -1 - (i * (k + 1) + m),
    m = 0 for the greedy one: negative, so they never meet a rollout's (group * K + sample) in one engine."""
    k = spec.eval.k
    greedy = SamplingParams(0.0, 1.0, spec.max_new_tokens, spec.stop_ids)
    sampled = SamplingParams(spec.eval.temperature, 1.0, spec.max_new_tokens, spec.stop_ids)
    return [Request(-1 - (i * (k + 1) + m), ids, greedy if m == 0 else sampled)
            for i, ids in prompts.items() for m in range(k + 1)]


def is_eval_request(request_id: int) -> bool:
    """Evaluation requests have negative ids; a rollout's are group * K + sample >= 0."""
    return request_id < 0


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
    """The whole test split (up to max_examples) on one engine (any engines.base.Engine)."""
    if task.multi_turn:
        return evaluate_episodes(engine, tokenizer, task, spec)
    examples = test_examples(task, spec)
    shard = EvalShard(0, range(len(examples)), examples, tokenizer, spec)
    for completion in engine.generate(shard.requests):
        shard.add(completion)
    with RewardPool(task.reward, spec.reward.workers, spec.reward.timeout_s, task.reward_options) as pool:
        shard.score(tokenizer, pool)
        return eval_metrics(shard.scores())


def evaluate_episodes(engine, tokenizer, task, spec: EvalSpec) -> dict:
    """A multi-turn task's test split: per example one greedy episode and `k` sampled ones, scored by the
    rewards their environments give (envs/episode.py drives them as a rollout worker does)."""
    from envs.agent import episodes_for

    k, budget = spec.eval.k, spec.max_new_tokens
    greedy = episodes_for(engine, tokenizer, task, spec.env, SamplingParams(0.0, 1.0, budget, spec.stop_ids),
                          budget, spec.seed)
    sampled = episodes_for(engine, tokenizer, task, spec.env,
                           SamplingParams(spec.eval.temperature, 1.0, budget, spec.stop_ids), budget,
                           spec.seed)
    examples = test_examples(task, spec)
    scores = {i: [0.0] * (k + 1) for i in range(len(examples))}
    try:
        for i, example in enumerate(examples):
            ids, messages = greedy.prompt(example)
            for m in range(k + 1):
                (sampled if m else greedy).start(i * (k + 1) + m, ids, messages, example)
        while greedy.episodes or sampled.episodes:
            ended = greedy.poll() + sampled.poll()
            for done in engine.step():
                episode = (greedy if greedy.owns(done) else sampled).completed(done)
                ended += [episode] if episode is not None else []
            for episode in ended:
                i, m = divmod(episode.key, k + 1)
                scores[i][m] = episode.reward
            if not engine.num_running() + engine.num_waiting():
                time.sleep(0.002)  # every episode waits for its environment
    finally:
        greedy.close()
        sampled.close()
    return eval_metrics(scores)


@dataclass(frozen=True)
class EngineEvaluator:
    """The CPU plan's: an engine of rank 0's own for each evaluation, that loads the version just published
    from the weight path as a rollout worker's engine does. Kept between evaluations it would hold its
    weights, their blocked copies and its KV cache in rank 0 all run; made again it costs a model load an
    evaluation."""
    engine: "EngineSpec"  # its max_len holds the longest evaluation request (longest_request)

    @contextmanager
    def open(self, model_path: str, weights, task, spec: EvalSpec):
        tokenizer = tasks.load_tokenizer(model_path, dict(spec.chat_template))

        def evaluate_version(version: int, stop=None) -> dict:
            with self.engine.open(model_path, spec.seed) as engine:
                sync = weights.follower(engine, 0)
                while engine.version < version:
                    if stop is not None and stop.is_set():
                        return {}
                    sync()
                results = evaluate(engine, tokenizer, task, spec)
            release_free_heap()  # the engine's pages, which glibc would keep for the next evaluation
            return results

        yield evaluate_version

    def worker_part(self, worker: int, task, tokenizer, spec: EvalSpec, pool) -> None:
        return None


class EvalShard:
    """The test examples `indices` under the weights of `version`: their requests, the completions as they
    finish (`add`), then their scores (`score`, asynchronous in the reward pool)."""

    def __init__(self, version: int, indices, examples: list, tokenizer, spec: EvalSpec):
        self.version, self.k, self.references = version, spec.eval.k, {i: examples[i].answer for i in indices}
        self.requests = eval_requests({i: tasks.prompt_ids(tokenizer, examples[i].question)
                                       for i in indices}, spec)
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

    def __init__(self, num_workers: int, ctx):
        self.inboxes = [ctx.Queue() for _ in range(num_workers)]
        self.results = ctx.Queue()

    @contextmanager
    def open(self, model_path: str, weights, task, spec: EvalSpec):
        if task.multi_turn:
            print("note: the GPU plan does not evaluate multi-turn tasks yet; the episode/ metrics of the "
                  "rollouts show their progress", flush=True)
            yield lambda version, stop=None: {}
            return
        yield self  # the engines already hold each version once it is published

    def worker_part(self, worker: int, task, tokenizer, spec: EvalSpec, pool) -> "EngineEvaluation | None":
        if task.multi_turn:
            return None  # not yet for multi-turn tasks: open() says so
        return EngineEvaluation(self, worker, task, tokenizer, spec, pool)

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


class EngineEvaluation:
    """A rollout worker's part of an evaluation on the engines (GPU plan). The worker's loop calls `poll`
    between two engine steps: it answers rank 0 once this worker's shard of the test split is scored, and
    takes rank 0's next request once the engine holds the version asked for, returning the requests to add to
    the engine. The loop hands over the completions it `owns` with `add`; they are scored in the worker's
    reward pool."""

    def __init__(self, channel: EvalChannel, worker: int, task, tokenizer, spec: EvalSpec, pool):
        self.channel, self.worker, self.task, self.tokenizer, self.spec, self.pool = (
            channel, worker, task, tokenizer, spec, pool)
        self.wanted: int | None = None  # the version rank 0 asked for, not started yet
        self.shard: EvalShard | None = None  # the evaluation under way

    def poll(self, engine_version: int) -> list[Request]:
        if self.shard is not None and self.shard.done():
            self.channel.reply(self.worker, self.shard)
            self.shard = None
        if self.shard is None and self.wanted is None:
            self.wanted = self.channel.job(self.worker)
        if self.wanted is None or engine_version < self.wanted:  # the weights may not be loaded yet
            return []
        self.shard = self.channel.shard(self.worker, self.wanted, self.task, self.tokenizer, self.spec)
        self.wanted = None
        return self.shard.requests

    def owns(self, completion: Completion) -> bool:
        return is_eval_request(completion.request_id)

    def add(self, completion: Completion) -> None:
        self.shard.add(completion)
        if self.shard.generated():
            self.shard.score(self.tokenizer, self.pool)
