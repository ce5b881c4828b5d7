"""Episodes that agent code drives: a workflow written against the `openai` client talks to the rollout
worker's endpoint (envs/endpoint.py), and the episode's record is exactly what the endpoint served.

    episodes = AgentEpisodes(engine, tokenizer, task, env_cfg, params, budget, seed, count, max_prompt_len)
    episodes.start(key, [], [], example)   # task.agent(client, example) runs in a thread, its client keyed
    ended = episodes.poll()                # requests go to the engine; returned workflows end
    episodes.completed(done)               # a served turn: its answer goes back to the waiting request

The same surface as envs/episode.py's Turns, so the rollout worker and the evaluation drive either.

Token in, token out. The first request's messages are rendered with the chat template (and its `tools`) as the
prompt. A later request whose messages extend what was served (the earlier messages, then the replies exactly
as returned) adds only its new messages, rendered as the template writes them after a reply (`Renderer.
continuation`: mask 0, no logprob, version -1); the reply is sampled on the parked sequence (`Request.resume`)
and appended as sampled (mask 1, its logprobs and versions). A request that does not extend what was served
(an agent that edited or dropped its history) starts a new segment: its messages are rendered whole as a new
prompt and the earlier record is dropped (`agent_segments`, `agent_dropped_tokens`), never re-tokenised into
it.

Sampling follows the run (rollout.temperature, rollout.top_p: the trainer's logprobs assume them); a request
that asks for other values is served with the run's and counted (`agent_sampling_overridden`). `max_tokens` is
honoured below env.max_turn_tokens and the room left in rollout.max_new_tokens; `stop` strings end a reply as
stop tokens do. Hermes tool calls (`<tool_call>{json}</tool_call>`) in a reply to a request with `tools` come
back as `tool_calls`.

An episode ends when its workflow returns: its reward is the value returned, or, with task.reward set, the
verifier's score of the last reply. A workflow that raises, returns something that is not a finite number, or
outlives env.episode_timeout_s ends its episode as `env_error` / `env_timeout` (env.mask keeps those out of
the loss); one that asks past env.max_turns or past the budget ends it as `max_turns` / `context`, and its
request gets a 400 naming the limit.
"""
import inspect
import json
import math
import threading
import time
from dataclasses import dataclass, field, replace

from engines.base import Completion, Request, SamplingParams
from envs.endpoint import MODEL, Call, Endpoint, episode_key
from envs.episode import KEY_MASK, TURN_SHIFT, Episode, vocabulary
from envs.render import Renderer
from rewards.pool import RewardPool


@dataclass
class AgentEpisode(Episode):
    served: list[dict] | None = None  # the conversation as served: the last request's messages and the reply
    call: Call | None = None  # the request being served (its reply is decoding)
    workflow: "Workflow | None" = None
    scoring: object | None = None  # the verifier's handle of the last reply (task.reward set)
    final_text: str = ""  # the last reply's content
    answer: str = ""  # the example's reference, for task.reward's verifier
    segments: int = 1


@dataclass
class Workflow:
    """A workflow's thread: its value or its error once it returned."""
    thread: threading.Thread | None = None
    value: object = None
    error: BaseException | None = None
    done: threading.Event = field(default_factory=threading.Event)


class AgentEpisodes:
    def __init__(self, engine, tokenizer, task, env_cfg, params: SamplingParams, budget: int, seed: int,
                 count=lambda name, n=1: None, max_prompt_len: int = 0, endpoint: Endpoint | None = None):
        """`task.agent`: the workflow, workflow(client, example) -> reward | None (a coroutine function gets
        an AsyncOpenAI client); `params`: the run's sampling (its stop tokens); `budget`: tokens after the
        prompt, the record's width (rollout.max_new_tokens); `max_prompt_len`: the longest first prompt
        (0: no bound)."""
        self.engine, self.tokenizer, self.task, self.cfg = engine, tokenizer, task, env_cfg
        self.params, self.budget, self.count, self.max_prompt_len = params, budget, count, max_prompt_len
        self.stop_ids = set(params.stop_token_ids)
        self.endpoint = endpoint or Endpoint(answer_timeout_s=env_cfg.episode_timeout_s)
        self.episodes: dict[int, AgentEpisode] = {}
        self.ended: list[AgentEpisode] = []  # ended while serving a request (a limit, a bad request): poll's
        self.renderers: dict[str, Renderer] = {}
        self.said: set[str] = set()  # kinds of failure already printed (_say)
        self.http, self.http_lock = None, threading.Lock()  # the sync workflows' shared connection pool
        self.scorer = RewardPool(task.reward, 1, 10.0) if task.reward else None
        engine.use_vocabulary(vocabulary(tokenizer))  # for the requests' stop strings

    # ---- the surface the rollout worker and the evaluation drive (as envs/episode.py's Turns) ----

    def prompt(self, example) -> tuple[list[int], list[dict]]:
        """Nothing yet: an agent episode's prompt is its workflow's first request."""
        return [], []

    def start(self, key: int, prompt_ids: list[int], messages: list[dict], example) -> AgentEpisode:
        episode = AgentEpisode(key, [], None, time.monotonic(), [], answer=example.answer)
        episode.workflow = self._launch(key, example)
        self.episodes[key] = episode
        return episode

    def owns(self, completion: Completion) -> bool:
        return (completion.request_id & KEY_MASK) in self.episodes

    def busy(self) -> int:
        """Episodes waiting for their workflow (no reply decoding)."""
        return sum(e.call is None for e in self.episodes.values())

    def completed(self, done: Completion) -> None:
        """A reply finished decoding: recorded as sampled, and sent back to its request. The episode goes on
        until its workflow returns (poll)."""
        episode = self.episodes[done.request_id & KEY_MASK]
        call, episode.call = episode.call, None
        episode.model_s += time.monotonic() - episode.turn_started
        episode.turns += 1
        episode.append(done.token_ids, done.logprobs, done.versions)
        stopped = bool(done.token_ids) and done.token_ids[-1] in self.stop_ids
        episode.last_stopped = stopped
        reply = done.token_ids[:-1] if stopped else done.token_ids
        text = self.tokenizer.decode(reply, skip_special_tokens=True)
        episode.final_text = text
        self.count("agent_tokens", len(done.token_ids))
        if call.route == "chat":
            message = _assistant(text, call.body.get("tools"), done.request_id)
            episode.served = _messages(call.body) + [message]
            call.answer(200, _chat_completion(done, message, call.body, episode.prompt_ids))
        else:
            call.answer(200, _text_completion(done, text, call.body))
        return None

    def poll(self) -> list[AgentEpisode]:
        """Serve the requests that arrived; end the episodes whose workflow returned (or ran out of time)."""
        for call in self.endpoint.calls():
            self._serve(call)
        ended, self.ended = self.ended, []
        now = time.monotonic()
        for episode in list(self.episodes.values()):
            if episode.call is not None:
                continue  # a reply is decoding: the episode ends after it, whatever its workflow does
            if episode.scoring is not None:
                if episode.scoring.done():
                    episode.reward = float(episode.scoring.result()[0])
                    ended.append(self._end(episode, "done"))
                continue
            if episode.workflow.done.is_set():
                ended += self._returned(episode)
            elif now - episode.started > self.cfg.episode_timeout_s:
                self.count("env_timeouts")
                ended.append(self._end(episode, "env_timeout"))
        return ended

    def _http(self):
        """The connection pool the sync workflows' clients share (made once, by whichever needs it first)."""
        with self.http_lock:
            if self.http is None:
                import httpx

                pool = httpx.Limits(max_connections=None, max_keepalive_connections=256)
                self.http = httpx.Client(limits=pool, timeout=self.cfg.episode_timeout_s)
            return self.http

    def close(self) -> None:
        self.endpoint.close()
        if self.http is not None:
            self.http.close()
        if self.scorer is not None:
            self.scorer.close()

    # ---- serving one request ----

    def _serve(self, call: Call) -> None:
        episode = self.episodes.get(call.key) if call.key is not None else None
        if episode is None:
            return call.fail(410 if call.key is not None else 401,
                             "no episode with this key is running (it ended, or never started): an episode's "
                             "client is the one its workflow was given", "no_episode")
        if episode.call is not None:
            return call.fail(409, "this episode already has a request being served: one at a time",
                             "concurrent_request")
        self.count("agent_calls")
        if episode.turns >= self.cfg.max_turns:
            self.ended.append(self._end(episode, "max_turns"))
            return call.fail(400, f"the episode's turns are used up (env.max_turns={self.cfg.max_turns})",
                             "max_turns")
        try:
            new = self._new_tokens(episode, call)
        except ValueError as error:  # a conversation the template cannot render, or no messages at all
            self.count("env_errors")
            self.ended.append(self._end(episode, "env_error"))
            return call.fail(400, str(error).splitlines()[0], "invalid_messages")
        if new is None:
            return  # the episode ended at a limit; the call has its answer
        room = self.budget - len(episode.token_ids) - len(new)
        if room < 1:
            self.ended.append(self._end(episode, "context"))
            return call.fail(400, f"the episode's context is full (rollout.max_new_tokens={self.budget} "
                                  "tokens after the first prompt)", "context_length_exceeded")
        episode.append(new)
        wanted = call.body.get("max_completion_tokens") or call.body.get("max_tokens") or room
        limit = max(1, min(int(wanted), self.cfg.max_turn_tokens, room))
        stops = call.body.get("stop") or ()
        stops = (stops,) if isinstance(stops, str) else tuple(str(s) for s in stops)
        for name, value in (("temperature", self.params.temperature), ("top_p", self.params.top_p)):
            if call.body.get(name) is not None and float(call.body[name]) != value:
                self.count("agent_sampling_overridden")
                break
        params = replace(self.params, max_new_tokens=limit, stop_strings=stops)
        request_id = episode.key + (episode.turns << TURN_SHIFT)
        resume = episode.last_request if episode.last_request >= 0 else None  # -1: a new segment, prefilled
        self.engine.add(Request(request_id, episode.prompt_ids + episode.token_ids, params, park=True,
                                resume=resume))
        episode.last_request, episode.turn_started, episode.call = request_id, time.monotonic(), call

    def _new_tokens(self, episode: AgentEpisode, call: Call) -> list[int] | None:
        """The tokens this request adds to the record (mask 0); the record restarts when it does not extend
        what was served. None: the episode ended at a limit, and the call is answered."""
        if call.route == "completions":
            return self._new_prompt_tokens(episode, call)
        messages = _messages(call.body)
        renderer = self._renderer(call.body.get("tools"))
        if episode.served is not None and _extends(episode.served, messages):
            closing = [] if episode.last_stopped else renderer.end_of_turn
            return closing + renderer.continuation(messages[len(episode.served):])
        return self._restart(episode, call, renderer.prompt(messages))

    def _new_prompt_tokens(self, episode: AgentEpisode, call: Call) -> list[int] | None:
        prompt = call.body.get("prompt")
        if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], (str, list)):
            prompt = prompt[0]  # the OpenAI API's batch of one
        if isinstance(prompt, str):
            ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
        elif isinstance(prompt, list) and prompt and all(isinstance(i, int) for i in prompt):
            ids = prompt
        else:
            raise ValueError("prompt must be a string or a list of token ids")
        record = episode.prompt_ids + episode.token_ids
        if episode.prompt_ids and len(ids) > len(record) and ids[:len(record)] == record:
            return ids[len(record):]
        return self._restart(episode, call, ids)

    def _restart(self, episode: AgentEpisode, call: Call, prompt: list[int]) -> list[int] | None:
        """A first request, or one that does not extend what was served: a new segment with this prompt."""
        if self.max_prompt_len and len(prompt) > self.max_prompt_len:
            self.count("env_errors")
            self.ended.append(self._end(episode, "env_error"))
            call.fail(400, f"the first request's prompt is {len(prompt)} tokens, over the ring's prompt "
                           f"width of {self.max_prompt_len}: set rollout.max_prompt_len",
                      "context_length_exceeded")
            return None
        if episode.prompt_ids:
            self.count("agent_segments")
            self.count("agent_dropped_tokens", len(episode.token_ids))
            episode.segments += 1
        episode.prompt_ids = list(prompt)
        for record in ("token_ids", "logprobs", "versions", "mask", "turn_ids"):
            setattr(episode, record, [])
        episode.last_request, episode.last_stopped = -1, True
        return []

    def _renderer(self, tools) -> Renderer:
        name = json.dumps(tools, sort_keys=True) if tools else ""
        if name not in self.renderers:
            self.renderers[name] = Renderer(self.tokenizer, "user", tools or None)
        return self.renderers[name]

    # ---- workflows ----

    def _launch(self, key: int, example) -> Workflow:
        workflow = Workflow()
        fn = self.task.agent

        def run() -> None:
            try:
                import openai

                common = dict(base_url=self.endpoint.url, api_key=episode_key(key), max_retries=0,
                              timeout=self.cfg.episode_timeout_s)
                if inspect.iscoroutinefunction(fn):
                    import asyncio

                    async def main():
                        async with openai.AsyncOpenAI(**common) as client:
                            return await fn(client, example)
                    workflow.value = asyncio.run(main())
                else:  # every episode's client on one connection pool: no TLS set-up and pool per episode
                    workflow.value = fn(openai.OpenAI(**common, http_client=self._http()), example)
            except BaseException as error:  # noqa: B902 — user code: whatever it raises ends its episode
                workflow.error = error
            finally:
                workflow.done.set()

        # a daemon: a workflow that never returns cannot hold the process at exit (its episode times out)
        workflow.thread = threading.Thread(target=run, name=f"agent-{key}", daemon=True)
        workflow.thread.start()
        return workflow

    def _returned(self, episode: AgentEpisode) -> list[AgentEpisode]:
        workflow = episode.workflow
        if workflow.error is not None:
            self.count("env_errors")
            self._say(f"a workflow raised {type(workflow.error).__name__}: {workflow.error}")
            return [self._end(episode, "env_error")]
        if not episode.turns:  # returned without asking for anything: nothing to train on
            self.count("env_errors")
            return [self._end(episode, "env_error")]
        if self.scorer is not None:  # task.reward: the verifier scores the last reply
            episode.scoring = self.scorer.submit([episode.final_text], [episode.answer])
            return []
        try:
            reward = float(workflow.value)
        except (TypeError, ValueError):
            reward = math.nan
        if not math.isfinite(reward):
            self.count("env_errors")
            return [self._end(episode, "env_error")]
        episode.reward = reward
        return [self._end(episode, "done")]

    def _say(self, line: str) -> None:
        """One line the first time a kind of failure happens in this process: the user's code failed, and the
        counters alone would not say why."""
        first = line.splitlines()[0][:300] if line else ""
        kind = first.split(":")[0]
        if kind not in self.said:
            self.said.add(kind)
            print(f"agent: {first} (episodes that fail so end as env_error; further ones are counted only)",
                  flush=True)

    def _end(self, episode: AgentEpisode, reason: str) -> AgentEpisode:
        """The episode's record is complete: it leaves, with its finish reason (poll returns it)."""
        episode.finish = reason
        episode.masked = reason in self.cfg.mask  # kept out of the loss (rollout.to_group)
        self.episodes.pop(episode.key, None)
        self.count("episodes")
        self.count("model_ms", int(1000 * episode.model_s))
        return episode


def align_group(episodes: list[AgentEpisode], filler: int, budget: int, count=lambda name, n=1: None) -> None:
    """K agent episodes made one group's records, in place. The ring holds one prompt per group: each
    episode's first prompt beyond the K prompts' common prefix moves into its completion (mask 0; a
    deterministic workflow's are all the same); an episode that ended before any reply gets one `filler` token
    (mask 0: nothing to train); a record past the budget is cut there (`agent_cut_records`)."""
    prompts = [e.prompt_ids for e in episodes if e.prompt_ids]
    common = list(prompts[0]) if prompts else [filler]
    for prompt in prompts[1:]:
        n = next((i for i, (a, b) in enumerate(zip(common, prompt)) if a != b), min(len(common), len(prompt)))
        common = common[:n]
    common = common or [filler]  # no token in common: the group's prompt is the filler, every prompt moves
    for e in episodes:
        extra = e.prompt_ids[len(common):] if e.prompt_ids[:len(common)] == common else e.prompt_ids
        if not e.prompt_ids:
            extra = [filler]
        e.token_ids, e.mask = extra + e.token_ids, [False] * len(extra) + e.mask
        e.logprobs, e.versions = [0.0] * len(extra) + e.logprobs, [-1] * len(extra) + e.versions
        e.turn_ids = [0] * len(extra) + e.turn_ids
        e.prompt_ids = common
        if len(e.token_ids) > budget:
            count("agent_cut_records")
            for name in ("token_ids", "mask", "logprobs", "versions", "turn_ids"):
                setattr(e, name, getattr(e, name)[:budget])


def episodes_for(engine, tokenizer, task, env_cfg, params: SamplingParams, budget: int, seed: int,
                 count=lambda name, n=1: None, max_prompt_len: int = 0):
    """What drives a task's episodes: AgentEpisodes for agent code (task.agent), else envs/episode.py's
    Turns."""
    if task.agent is not None:
        return AgentEpisodes(engine, tokenizer, task, env_cfg, params, budget, seed, count, max_prompt_len)
    from envs.episode import Turns

    return Turns(engine, tokenizer, task, env_cfg, params, budget, seed, count)


# ---- OpenAI shapes ----

def _messages(body: dict) -> list[dict]:
    """The request's messages as the template takes them: role and text content (content parts joined),
    tool calls and tool ids kept."""
    messages = body.get("messages")
    if not isinstance(messages, list) or not messages:
        raise ValueError("messages must be a non-empty list of {role, content} objects")
    out = []
    for m in messages:
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise ValueError("every message needs a role")
        content = m.get("content")
        if isinstance(content, list):  # content parts: the text ones, in order
            content = "".join(p.get("text", "") for p in content if isinstance(p, dict))
        message = {"role": m["role"], "content": content or ""}
        if m.get("tool_calls"):
            message["tool_calls"] = [_plain_call(c) for c in m["tool_calls"]]
        for extra in ("tool_call_id", "name"):
            if m.get(extra) is not None:
                message[extra] = m[extra]
        out.append(message)
    return out


def _plain_call(call: dict) -> dict:
    function = call.get("function") or {}
    arguments = function.get("arguments")
    if isinstance(arguments, str):
        try:
            arguments = json.loads(arguments)
        except ValueError:
            pass
    return {"type": "function", "function": {"name": function.get("name", ""), "arguments": arguments}}


def _extends(served: list[dict], messages: list[dict]) -> bool:
    """`messages` start with the conversation served so far (its replies as returned) and add to it."""
    if len(messages) <= len(served):
        return False
    for old, new in zip(served, messages):
        if (old["role"], old["content"] or "") != (new["role"], new["content"] or ""):
            return False
        calls = [[c["function"] for c in m.get("tool_calls", [])] for m in (old, new)]
        if calls[0] != calls[1]:
            return False
    return True


def _assistant(text: str, tools, request_id: int) -> dict:
    """The reply as a chat message: Hermes tool calls in it become `tool_calls` when the request gave
    tools."""
    calls = _hermes_calls(text) if tools else []
    if not calls:
        return {"role": "assistant", "content": text}
    content = text[:text.find("<tool_call>")].strip()
    return {"role": "assistant", "content": content,
            "tool_calls": [{"id": f"call_{request_id}_{i}", "type": "function",
                            "function": {"name": name, "arguments": arguments}}
                           for i, (name, arguments) in enumerate(calls)]}


def _hermes_calls(text: str) -> list[tuple[str, dict]]:
    """Every well-formed `<tool_call>{"name": ..., "arguments": ...}</tool_call>` in the text, in order."""
    calls, start = [], 0
    while (open_at := text.find("<tool_call>", start)) >= 0:
        close_at = text.find("</tool_call>", open_at)
        if close_at < 0:
            break
        start = close_at + len("</tool_call>")
        try:
            call = json.loads(text[open_at + len("<tool_call>"):close_at])
        except ValueError:
            continue
        if isinstance(call, dict) and isinstance(call.get("name"), str):
            arguments = call.get("arguments", {})
            if isinstance(arguments, str):
                try:
                    arguments = json.loads(arguments)
                except ValueError:
                    continue
            if isinstance(arguments, dict):
                calls.append((call["name"], arguments))
    return calls


def _finish(done: Completion, tool_calls: bool) -> str:
    return "tool_calls" if tool_calls else "length" if done.finish_reason == "length" else "stop"


def _chat_completion(done: Completion, message: dict, body: dict, prompt_ids: list[int]) -> dict:
    reply = dict(message)
    if "tool_calls" in reply:  # on the wire, arguments are a JSON string
        reply["tool_calls"] = [dict(c, function={"name": c["function"]["name"],
                                                 "arguments": json.dumps(c["function"]["arguments"])})
                               for c in reply["tool_calls"]]
    choice = {"index": 0, "message": reply, "finish_reason": _finish(done, "tool_calls" in reply),
              "token_ids": done.token_ids}  # the tokens as sampled (vLLM's return_token_ids shape)
    if body.get("logprobs"):
        choice["logprobs"] = {"content": [{"token": str(t), "logprob": lp, "bytes": None, "top_logprobs": []}
                                          for t, lp in zip(done.token_ids, done.logprobs)]}
    return {"id": f"chatcmpl-{done.request_id}", "object": "chat.completion", "created": int(time.time()),
            "model": MODEL, "choices": [choice], "prompt_token_ids": prompt_ids,
            "usage": {"prompt_tokens": len(done.prompt_ids), "completion_tokens": len(done.token_ids),
                      "total_tokens": len(done.prompt_ids) + len(done.token_ids)}}


def _text_completion(done: Completion, text: str, body: dict) -> dict:
    choice = {"index": 0, "text": text, "finish_reason": _finish(done, False), "token_ids": done.token_ids,
              "logprobs": {"tokens": [str(t) for t in done.token_ids], "token_logprobs": done.logprobs}
              if body.get("logprobs") is not None else None}
    return {"id": f"cmpl-{done.request_id}", "object": "text_completion", "created": int(time.time()),
            "model": MODEL, "choices": [choice],
            "usage": {"prompt_tokens": len(done.prompt_ids), "completion_tokens": len(done.token_ids),
                      "total_tokens": len(done.prompt_ids) + len(done.token_ids)}}
