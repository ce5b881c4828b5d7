"""Agent code written against the `openai` client, served by a rollout worker's endpoint (envs/endpoint.py,
envs/agent.py): what the trainer gets is exactly what was sampled, mask 0 on the rest; edits of the past start
a new segment; a broken workflow ends its episode as an error; the endpoint refuses what it cannot serve in
one line."""
import json
import time
import urllib.error
import urllib.request

import pytest
from transformers import AutoTokenizer

from engines.base import SamplingParams
from envs.agent import AgentEpisodes
from envs.endpoint import episode_key
from envs.render import Renderer
from rollout import to_group
from runtime.schema import EnvConfig
from tasks import Example, Task
from tests import agent_workflows
from tests.test_episodes import ScriptEngine


@pytest.fixture(scope="module")
def tokenizer(tokenizer_dir):
    return AutoTokenizer.from_pretrained(tokenizer_dir)


def agent_episodes(tokenizer, engine, workflow, counts, reward="", **limits):
    cfg = EnvConfig(**{"max_turns": 4, "max_turn_tokens": 64, "episode_timeout_s": 30.0, **limits})
    task = Task(reward, [], [], agent=workflow)
    return AgentEpisodes(engine, tokenizer, task, cfg, SamplingParams(1.0, 1.0, 512, (2,)), 512, seed=0,
                         count=lambda name, n=1: counts.__setitem__(name, counts.get(name, 0) + n))


def run_episodes(episodes, engine, n=1, example=Example("What is the capital of France?", "Paris"),
                 timeout=30.0):
    """Start n episodes of one example and drive them (endpoint requests, engine steps) until they end."""
    for key in range(n):
        episodes.start(key, [], [], example)
    ended, deadline = [], time.monotonic() + timeout
    try:
        while episodes.episodes:
            assert time.monotonic() < deadline, "episodes did not end"
            ended += episodes.poll()
            for done in engine.step():
                episodes.completed(done)
            time.sleep(0.001)
    finally:
        episodes.close()
    return sorted(ended, key=lambda e: e.key)


CALC = '<tool_call>{"name": "calc", "arguments": {"expression": "6*7"}}</tool_call>'
CAPITAL = '<tool_call>{"name": "capital", "arguments": "{\\"country\\": \\"France\\"}"}</tool_call>'


def test_a_two_tool_episode_from_a_plain_openai_client_trains_exactly_what_was_sampled(tokenizer):
    # turn 1 ends on the end-of-turn token; turn 2 as a stop string cuts it (the template's end of turn is
    # then the endpoint's, mask 0); turn 3 answers
    replies = [(CALC, True), (CAPITAL, False), ("The capital is Paris.", True)]
    engine = ScriptEngine(tokenizer, lambda key, turn: replies[turn])
    counts = {}
    episode, = run_episodes(agent_episodes(tokenizer, engine, agent_workflows.two_tools, counts), engine)
    assert (episode.finish, episode.reward, episode.turns) == ("done", 1.0, 3)
    turns = [tokenizer(text, add_special_tokens=False)["input_ids"] + ([2] if stopped else [])
             for text, stopped in replies]
    assert [t for t, m in zip(episode.token_ids, episode.mask) if m] == [t for turn in turns for t in turn]
    # what is not sampled is the endpoint's: each tool answer as the template renders it after a reply
    renderer = Renderer(tokenizer, "user", agent_workflows.TOOLS)
    first_tool = renderer.continuation([{"role": "tool", "content": "42", "tool_call_id": "call_0_0"}])
    second_tool = renderer.end_of_turn + renderer.continuation(
        [{"role": "tool", "content": "Paris", "tool_call_id": "x"}])
    assert episode.token_ids == turns[0] + first_tool + turns[1] + second_tool + turns[2]
    assert all(v == -1 and lp == 0.0 for v, lp, m in zip(episode.versions, episode.logprobs, episode.mask)
               if not m)
    # the prompt is the first request's messages, rendered once; the trainer's record reads the same mask
    system = [{"role": "system", "content": "Use the tools."},
              {"role": "user", "content": "What is the capital of France?"}]
    assert episode.prompt_ids == renderer.prompt(system)
    group = to_group([episode], [episode.reward], 0, 0, 0)
    assert group.loss_mask[0, :len(episode.mask)].tolist() == episode.mask
    assert group.completion_ids[0, :len(episode.token_ids)].tolist() == episode.token_ids
    assert counts["agent_calls"] == 3 and "agent_segments" not in counts


def test_the_reply_carries_tool_calls_token_ids_and_logprobs(tokenizer):
    engine = ScriptEngine(tokenizer, lambda key, turn: (CALC if turn == 0 else "Done.", True))
    seen = {}

    def workflow(client, example):
        reply = client.chat.completions.create(model="x", messages=[{"role": "user", "content": "Hi"}],
                                               tools=agent_workflows.TOOLS, logprobs=True)
        seen["reply"] = reply
        return 1.0

    run_episodes(agent_episodes(tokenizer, engine, workflow, {}), engine)
    choice = seen["reply"].choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content == ""
    call, = choice.message.tool_calls
    assert call.function.name == "calc" and json.loads(call.function.arguments) == {"expression": "6*7"}
    ids = tokenizer(CALC, add_special_tokens=False)["input_ids"] + [2]
    assert choice.model_extra["token_ids"] == ids
    assert [t.logprob for t in choice.logprobs.content] == [-0.5] * len(ids)


def test_a_request_that_edits_the_past_starts_a_new_segment_and_keeps_only_it(tokenizer):
    engine = ScriptEngine(tokenizer, lambda key, turn: (f"Reply {turn}.", True))
    counts = {}
    episodes = agent_episodes(tokenizer, engine, agent_workflows.edits_its_history, counts)
    episode, = run_episodes(episodes, engine)
    assert episode.finish == "done" and episode.reward == 0.5 and episode.segments == 2
    renderer = Renderer(tokenizer, "user")
    assert episode.prompt_ids == renderer.prompt([{"role": "user", "content": "A shorter question?"}])
    last = tokenizer("Reply 2.", add_special_tokens=False)["input_ids"] + [2]
    assert episode.token_ids == last and all(episode.mask)
    assert counts["agent_segments"] == 1 and counts["agent_dropped_tokens"] > 0


@pytest.mark.parametrize("workflow, finish", [(agent_workflows.raises, "env_error"),
                                              (agent_workflows.returns_nan, "env_error"),
                                              (agent_workflows.asks_async, "done")])
def test_a_workflow_that_raises_or_returns_no_number_ends_as_an_error(tokenizer, workflow, finish):
    engine = ScriptEngine(tokenizer, lambda key, turn: ("Paris.", True))
    counts = {}
    episodes = run_episodes(agent_episodes(tokenizer, engine, workflow, counts), engine, n=2)
    assert [e.finish for e in episodes] == [finish, finish]
    assert counts.get("env_errors", 0) == (2 if finish == "env_error" else 0)


def test_the_turn_limit_and_the_budget_end_the_episode_and_answer_400(tokenizer):
    engine = ScriptEngine(tokenizer, lambda key, turn: ("No.", True))
    statuses = []

    def insists(client, example):
        import openai

        messages = [{"role": "user", "content": "Hi"}]
        for _ in range(5):
            try:
                reply = client.chat.completions.create(model="x", messages=messages)
            except openai.BadRequestError as error:
                statuses.append(error.body["code"])
                return 0.0
            messages += [{"role": "assistant", "content": reply.choices[0].message.content},
                         {"role": "user", "content": "Again."}]
        return 1.0

    episode, = run_episodes(agent_episodes(tokenizer, engine, insists, {}, max_turns=2), engine)
    assert episode.finish == "max_turns" and episode.turns == 2 and statuses == ["max_turns"]


def test_the_endpoint_refuses_in_one_line_what_it_cannot_serve(tokenizer):
    engine = ScriptEngine(tokenizer, lambda key, turn: ("Yes.", True))
    episodes = agent_episodes(tokenizer, engine, lambda client, example: time.sleep(5) or 1.0, {})
    episodes.start(7, [], [], Example("q", "a"))
    url = episodes.endpoint.url

    def post(path, body, key=7, raw=None):
        data = raw if raw is not None else json.dumps(body).encode()
        request = urllib.request.Request(url + path, data=data, method="POST",
                                         headers={"Authorization": f"Bearer {episode_key(key)}",
                                                  "Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=10) as response:
                return response.status, json.loads(response.read())
        except urllib.error.HTTPError as error:
            return error.code, json.loads(error.read())

    import threading

    results = {}

    def ask(name, *args, **kw):
        results[name] = post(*args, **kw)

    chat = {"messages": [{"role": "user", "content": "Hi"}]}
    threads = [threading.Thread(target=ask, args=args, kwargs=kw) for args, kw in [
        (("unknown", "/chat/completions", chat), {"key": 99}),
        (("bad_json", "/chat/completions", None), {"raw": b"{not json"}),
        (("stream", "/chat/completions", dict(chat, stream=True)), {}),
        (("no_messages", "/chat/completions", {"messages": []}), {}),
        (("route", "/embeddings", chat), {})]]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 10
    while any(t.is_alive() for t in threads) and time.monotonic() < deadline:
        episodes.poll()
        time.sleep(0.005)
    episodes.close()
    codes = {name: (status, body["error"]["code"]) for name, (status, body) in results.items()}
    assert codes == {"unknown": (410, "no_episode"), "bad_json": (400, "invalid_json"),
                     "stream": (400, "unsupported"), "no_messages": (400, "invalid_messages"),
                     "route": (404, "not_found")}
    assert all("\n" not in body["error"]["message"] for _, body in results.values())


def test_a_verifier_scores_the_last_reply_when_the_task_names_one(tokenizer):
    engine = ScriptEngine(tokenizer, lambda key, turn: ("It is 7.", True))

    def asks(client, example):
        client.chat.completions.create(model="x", messages=[{"role": "user", "content": example.question}])
        return None  # the task's verifier decides

    episode, = run_episodes(agent_episodes(tokenizer, engine, asks, {}, reward="arithmetic"), engine,
                            example=Example("What is 3 + 4?", "7"))
    assert episode.finish == "done" and episode.reward == 1.0


def test_train_py_trains_an_agent_workflow_end_to_end(tiny_model_dir, tmp_path):
    """task=agent: the shipped example (agents/arith_retry.py, plain openai calls) drives every episode
    through each rollout worker's endpoint, asynchronously; every step logged with its episode metrics, the
    test split evaluated through an endpoint of the evaluation's own."""
    from tests.helpers import TINY, run_train

    overrides = [o for o in TINY if not o.startswith("rollout.max_new_tokens")]
    result = run_train(tmp_path, f"model.path={tiny_model_dir}", "task=agent", "steps=3", "max_staleness=1",
                       "env.max_turn_tokens=6", "rollout.max_new_tokens=64", "eval.k=1",
                       "eval.max_examples=4", "checkpoint.at_end=false", *overrides)
    assert result.returncode == 0, result.stderr[-3000:]
    rows = [json.loads(line) for line in open(tmp_path / "metrics.jsonl")]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for row in rows:
        assert row["staleness_max"] <= 1 and 1 <= row["episode/turns_mean"] <= 3
        assert row["episode/policy_tokens"] > 0 and row["episode/env_tokens"] > 0  # the retries' feedback
    assert "eval_pass@1" in rows[-1] and rows[-1]["eval_examples"] == 4


def test_a_group_of_agent_episodes_shares_one_prompt_and_keeps_every_sampled_token():
    """Workflows whose first requests differ, and one that ended before any reply, still make one ring group:
    the common prefix is the prompt, the rest of each prompt is context (mask 0) before the sampled tokens."""
    from envs.agent import AgentEpisode, align_group

    def episode(prompt, sampled):
        e = AgentEpisode(0, list(prompt), None, 0.0, [])
        e.append(list(sampled), [-0.1] * len(sampled), [3] * len(sampled))
        e.finish = "done"
        return e

    same, other, empty = episode([1, 5, 6, 7], [20, 21]), episode([1, 5, 9], [30]), episode([], [])
    align_group([same, other, empty], filler=2, budget=4)
    assert same.prompt_ids == other.prompt_ids == empty.prompt_ids == [1, 5]
    assert (same.token_ids, same.mask) == ([6, 7, 20, 21], [False, False, True, True])
    assert (other.token_ids, other.mask, other.versions) == ([9, 30], [False, True], [-1, 3])
    assert (empty.token_ids, empty.mask) == ([2], [False])
    group = to_group([same, other, empty], [1.0, 0.0, 0.0], 0, 0, 0)
    assert group.prompt_ids.tolist() == [1, 5] and group.loss_mask.sum().item() == 3


def test_a_failed_workflow_s_episode_is_kept_out_of_the_loss_by_env_mask(tokenizer):
    engine = ScriptEngine(tokenizer, lambda key, turn: ("Paris.", True))
    episode, = run_episodes(agent_episodes(tokenizer, engine, agent_workflows.raises, {}), engine)
    assert episode.finish == "env_error" and episode.masked
    group = to_group([episode], [0.0], 0, 0, 0)
    assert not group.loss_mask.any()


def test_bench_endpoint_compares_the_same_episodes_in_process_and_through_the_endpoint(tiny_model_dir):
    import subprocess
    import sys

    from tests.helpers import ROOT

    command = [sys.executable, "-m", "bench.endpoint", "--model", tiny_model_dir, "--groups", "1",
               "--group-size", "2", "--repeats", "1", "--dtype", "float32"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    last = result.stdout.strip().splitlines()[-1]
    assert last.startswith("endpoint_vs_inprocess=") and float(last.split("=")[1]) > 0
    assert "requests through the endpoint" in result.stdout
