"""SGLangEngine with a fake SGLang: requests interrupted by a weight update resume as prompt + tokens so far,
with the remaining budget and the version of every token."""
import time

import pytest

from engines.base import Request, SamplingParams
from engines.buckets import BucketMessage
from engines.sglang import Partial, SGLangEngine, sampling_params
from engines.weight_sync import receive_version
from tests.gpu_fakes import FakeBackend, FakeChannel


def _run_until(engine, predicate, limit=500):
    done = []
    for _ in range(limit):
        done += engine.step()
        if predicate(done):
            return done
    raise AssertionError("the engine did not get there")


def test_partial_merge_and_resume_input():
    partial = Partial(Request(7, [1, 2], SamplingParams(max_new_tokens=5, stop_token_ids=(99,))))
    aborted = {"meta_info": {"output_token_logprobs": [(-0.5, 10, None), (-0.25, 11, None)],
                             "finish_reason": {"type": "abort"}}}
    assert partial.merge(aborted, version=3) is None
    assert partial.resume_input() == [1, 2, 10, 11] and partial.remaining() == 3
    assert sampling_params(partial.request.params, partial.remaining())["max_new_tokens"] == 3
    stop = {"meta_info": {"output_token_logprobs": [(-1.0, 99, None)], "finish_reason": {"type": "stop"}}}
    assert partial.merge(stop, version=4) == "stop"
    done = partial.completion("stop")
    assert (done.token_ids, done.logprobs, done.versions) == ([10, 11, 99], [-0.5, -0.25, -1.0], [3, 3, 4])
    empty = Partial(Request(8, [1], SamplingParams(max_new_tokens=2)))
    assert empty.merge({"meta_info": {"finish_reason": {"type": "abort"}}}, 0) is None \
        and empty.remaining() == 2


def test_interrupted_requests_resume_with_remaining_budget_and_new_versions():
    prompt, budget = [5, 6, 7], 10
    reference = SGLangEngine(FakeBackend(chunk=100), max_batch=256)
    expected = reference.generate([Request(0, prompt, SamplingParams(max_new_tokens=budget))])[0]

    fake = FakeBackend(chunk=4)
    engine = SGLangEngine(fake, max_batch=8, poll_s=0.001)
    engine.add(Request(0, prompt, SamplingParams(max_new_tokens=budget)))
    # fits in one chunk: finishes before the update
    engine.add(Request(1, [9], SamplingParams(max_new_tokens=3)))
    short = _run_until(engine, lambda d: len(d) == 1)
    assert short[0].request_id == 1 and short[0].finish_reason == "length" and short[0].versions == [0, 0, 0]
    time.sleep(0.01)
    engine.step()  # request 0 has its first chunk and waits

    channel = FakeChannel(BucketMessage(1, 0, True, [], [1]))
    assert receive_version(engine, channel, 0) == []
    assert engine.version == 1 and channel.acks == [(0, 1, 0)]
    assert fake.log == ["pause", "begin", "load flush=True", "end", "resume"]
    assert engine.num_waiting() == 1 and engine.num_running() == 0

    engine.step()  # resubmitted: prompt + 4 tokens, 6 to go
    time.sleep(0.01)
    engine.step()
    two_buckets = FakeChannel(BucketMessage(2, 0, False, [], [2]), BucketMessage(2, 1, True, [], [2]))
    receive_version(engine, two_buckets, 0)
    assert two_buckets.acks == [(0, 2, 0), (0, 2, 1)] and engine.version == 2
    assert fake.log[-5:] == ["begin", "load flush=False", "load flush=True", "end", "resume"]
    done = _run_until(engine, lambda d: len(d) == 1)[0]

    resubmitted = [(ids, budget) for ids, budget in fake.calls if ids[:3] == prompt]
    assert resubmitted == [(prompt, 10), (prompt + done.token_ids[:4], 6), (prompt + done.token_ids[:8], 2)]
    assert done.token_ids == expected.token_ids and done.finish_reason == "length"
    assert done.versions == [0] * 4 + [1] * 4 + [2] * 2
    assert done.logprobs == pytest.approx([-0.01 * t - v for t, v in zip(done.token_ids, done.versions)])
    engine.shutdown()
    reference.shutdown()


def test_stop_token_ends_a_request_across_an_interruption():
    prompt = [4, 4]
    whole = SGLangEngine(FakeBackend(chunk=100), max_batch=256)
    full = whole.generate([Request(0, prompt, SamplingParams(max_new_tokens=12))])[0]
    stop = full.token_ids[5]
    first = full.token_ids.index(stop)
    assert 3 <= first <= 5  # in the second chunk of three
    engine = SGLangEngine(FakeBackend(chunk=3), max_batch=256, poll_s=0.001)
    engine.add(Request(0, prompt, SamplingParams(max_new_tokens=12, stop_token_ids=(stop,))))
    finished = []
    # the stop token comes in the second chunk: the request ends before the next update
    for version in (1, 2):
        time.sleep(0.005)
        finished += engine.step()
        finished += receive_version(engine, FakeChannel(BucketMessage(version, 0, True, [], [version])), 0)
    (done,) = finished
    assert done.finish_reason == "stop" and done.token_ids == full.token_ids[:first + 1]
    assert done.versions == [0] * 3 + [1] * (first - 2)
    engine.shutdown()
    whole.shutdown()


def test_a_turn_ends_at_its_stop_string_without_decoding_to_the_limit():
    """SGLang is given the request's stop strings and stops on them itself (SGLangSpec.stop_strings): a tool
    call's turn ends at its closing tag, not at the turn's token limit, and keeps the token that completes
    it."""
    from engines.sglang import SGLangSpec

    prompt = [4, 4]
    probe = SGLangEngine(FakeBackend(chunk=100), max_batch=8)
    tokens = probe.generate([Request(0, prompt, SamplingParams(max_new_tokens=40))])[0].token_ids
    probe.shutdown()
    assert len(set(tokens[:4])) == 4  # distinct tokens, so the texts below belong to one position each
    vocabulary = [f"<{i}>" for i in range(64)]
    vocabulary[tokens[2]], vocabulary[tokens[3]] = "ab</ca", "lc>zz"  # the stop string ends inside token 3
    fake = FakeBackend(chunk=100, vocabulary=vocabulary)
    engine = SGLangEngine(fake, max_batch=8)
    engine.use_vocabulary(vocabulary)
    stops = SamplingParams(max_new_tokens=40, stop_strings=("</calc>",))
    done = engine.generate([Request(1, prompt, stops)])[0]
    assert done.finish_reason == "stop" and done.token_ids == tokens[:4] and len(done.logprobs) == 4
    assert fake.decoded == 4  # nothing decoded past the stop string
    assert sampling_params(SamplingParams(stop_strings=("</calc>",)), 8)["stop"] == ["</calc>"]
    assert SGLangSpec.stop_strings
    engine.shutdown()
