"""Test-split evaluation: request ids, metrics, and the GPU plan's evaluation sharded over the rollout
workers' engines (evaluate.EvalChannel), which must give what one engine gives."""
import multiprocessing as mp
import threading
import time

import pytest
from transformers import AutoTokenizer

import tasks
from engines.base import Completion
from evaluate import EvalChannel, eval_metrics, eval_requests, eval_slot, evaluate
from rewards.pool import RewardPool
from runtime.schema import EvalConfig, RewardConfig
from runtime.setup import EvalSpec

SPEC = EvalSpec(EvalConfig(k=3, temperature=1.0), RewardConfig(workers=0), max_new_tokens=4,
                stop_ids=(2,), seed=0)
K = SPEC.eval.k


class AnswerEngine:
    """Answers from a fixed table, by request id: the greedy request of example i answers right when
    i % 3 == 0, sample m when (i + m) % 4 == 0. The answer does not depend on which engine or batch generates
    it."""

    def __init__(self, tokenizer, test):
        self.tokenizer, self.test = tokenizer, test
        self.seen = []

    def generate(self, requests):
        self.seen += [r.request_id for r in requests]
        out = []
        for r in requests:
            i, m = eval_slot(r.request_id, K)
            right = i % 3 == 0 if m == 0 else (i + m) % 4 == 0
            text = self.test[i].answer if right else "no idea"
            ids = self.tokenizer.encode(text, add_special_tokens=False)
            out.append(Completion(r.request_id, r.prompt_ids, ids, [0.0] * len(ids), [0] * len(ids), "stop"))
        return out


@pytest.fixture(scope="module")
def arithmetic():
    return tasks.get("arithmetic").build(tasks.get("arithmetic").Config(test_size=11), 0)


def test_eval_request_ids_are_negative_and_name_their_example_and_sample():
    requests = eval_requests({0: [5, 6], 4: [7]}, SPEC)
    assert len(requests) == 2 * (K + 1) and all(r.request_id < 0 for r in requests)
    slots = [eval_slot(r.request_id, K) for r in requests]
    assert slots == [(0, 0), (0, 1), (0, 2), (0, 3), (4, 0), (4, 1), (4, 2), (4, 3)]
    assert [r.params.temperature for r in requests[:4]] == [0.0, 1.0, 1.0, 1.0]  # greedy first
    assert requests[4].prompt_ids == [7] and requests[4].params.max_new_tokens == SPEC.max_new_tokens


def test_eval_metrics_count_greedy_pass_at_1_and_pass_at_k():
    metrics = eval_metrics({0: [1.0, 0.0, 1.0, 0.0], 1: [0.0, 0.0, 0.0, 0.0], 2: [0.0, 1.0, 1.0, 1.0]})
    assert metrics == {"eval_pass@1": 1 / 3, "eval_pass@3": 2 / 3, "eval_sample_reward": 4 / 9,
                       "eval_examples": 3}
    assert eval_metrics({}) == {}


def test_evaluation_sharded_over_workers_equals_one_engine(tokenizer_dir, arithmetic):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    whole = evaluate(AnswerEngine(tokenizer, arithmetic.test), tokenizer, arithmetic, SPEC)
    assert 0 < whole["eval_pass@1"] < whole["eval_pass@3"] < 1 and whole["eval_examples"] == 11

    channel, stop, engines = EvalChannel(3, mp.get_context("spawn")), threading.Event(), []

    def worker(w):  # what a rollout worker's EngineEvaluation does with a job, on its own engine
        while (version := channel.job(w)) is None:
            time.sleep(0.01)
        shard = channel.shard(w, version, arithmetic, tokenizer, SPEC)
        engines.append(AnswerEngine(tokenizer, arithmetic.test))
        for completion in engines[-1].generate(shard.requests):
            shard.add(completion)
        assert shard.generated()
        with RewardPool(arithmetic.reward, 0, 5.0) as pool:
            shard.score(tokenizer, pool)
            channel.reply(w, shard)

    threads = [threading.Thread(target=worker, args=(w,)) for w in range(3)]
    for t in threads:
        t.start()
    assert channel(7, stop, timeout_s=60) == whole
    for t in threads:
        t.join()
    # Each example went to exactly one worker, all k + 1 of its requests with it.
    examples = [sorted({eval_slot(i, K)[0] for i in engine.seen}) for engine in engines]
    assert sorted(i for shard in examples for i in shard) == list(range(11))
    channel.close()


def test_channel_ignores_other_versions_and_gives_up_when_stopped(tokenizer_dir, arithmetic):
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_dir)
    channel, stop = EvalChannel(1, mp.get_context("spawn")), threading.Event()
    stale = channel.shard(0, 3, arithmetic, tokenizer, SPEC)
    for completion in AnswerEngine(tokenizer, arithmetic.test).generate(stale.requests):
        stale.add(completion)
    with RewardPool(arithmetic.reward, 0, 5.0) as pool:
        stale.score(tokenizer, pool)
    channel.reply(0, stale)  # a late answer for version 3 is not version 4's
    threading.Timer(1.0, stop.set).start()
    start = time.time()
    assert channel(4, stop) == {}
    assert time.time() - start < 10
    assert channel.job(0) == 4  # the worker was asked
    channel.close()
