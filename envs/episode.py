"""One episode's record, and the turns of a rollout worker's episodes over its engine.

    turns = Turns(engine, tokenizer, task, cfg.env, params, budget=rollout.max_new_tokens, seed=...)
    turns.start(key, example)            # K times per group: the first turn goes to the engine
    episode = turns.completed(done)      # a finished engine request: the episode if it ended
    ended = turns.poll()                 # environment answers: the next turn goes to the engine, or it ends

Token in, token out: sampled tokens are appended as sampled (mask 1, their logprob and version); the tokens
between two turns (the end of an assistant turn a stop string cut, the observation as a chat turn, the next
assistant header) come from `Renderer.observation` (mask 0, logprob 0, version -1). The next turn continues
the parked sequence (`Request.resume`): the engine prefills only the new tokens. Request ids are the episode's
key plus `turn << TURN_SHIFT`, so turn 0 samples exactly what a one-shot request of that key samples.
"""
import math
import numbers
import random
import time
from dataclasses import dataclass, field, replace

from buffer.ring import FINISH_REASONS
from engines.base import Completion, Request, SamplingParams
from envs import COUNTED, Step
from envs.pool import Pending, StepPool
from envs.render import Renderer, cut_middle, prompt_ids

TURN_SHIFT = 40  # request id = key + (turn << TURN_SHIFT)
KEY_MASK = (1 << TURN_SHIFT) - 1
CUT_MARK = " [...] "  # where an observation too long was cut


@dataclass
class Episode:
    key: int  # group id * K + sample
    prompt_ids: list[int]
    env: object | None  # envs.Env; None: one-shot
    started: float  # time.monotonic()
    messages: list[dict]  # the conversation as text: reset's messages, then each turn and observation
    token_ids: list[int] = field(default_factory=list)  # everything after the prompt
    logprobs: list[float] = field(default_factory=list)  # 0 where the policy sampled nothing
    versions: list[int] = field(default_factory=list)  # -1 where the policy sampled nothing
    mask: list[bool] = field(default_factory=list)  # True on sampled tokens
    # the turn each token belongs to (an observation: its turn's)
    turn_ids: list[int] = field(default_factory=list)
    turns: int = 0  # policy turns taken
    reward: float = 0.0  # the sum of the environment's step rewards
    turn_rewards: list[float] = field(default_factory=list)  # the step reward after each policy turn
    finish: str = ""  # one of FINISH_REASONS once ended
    masked: bool = False  # its finish is one of env.mask: kept out of the loss (rollout.to_group)
    # its environment could not be built or reset: it ends env_error after a first turn of one token
    env_failed: bool = False
    success: bool = False  # the environment's last step said so (info["success"])
    last_request: int = -1
    # the last turn ended on a stop token: nothing needs closing before an observation
    last_stopped: bool = True
    pending: Pending | None = None
    turn_started: float = 0.0
    model_s: float = 0.0  # waiting for the engine
    env_s: float = 0.0  # waiting for the environment

    def append(self, ids: list[int], logprobs: list[float] | None = None,
               versions: list[int] | None = None) -> None:
        sampled = logprobs is not None
        self.token_ids += ids
        self.logprobs += logprobs if sampled else [0.0] * len(ids)
        self.versions += versions if sampled else [-1] * len(ids)
        self.mask += [sampled] * len(ids)
        self.turn_ids += [max(self.turns - 1, 0)] * len(ids)

    @property
    def finish_code(self) -> int:
        return FINISH_REASONS.index(self.finish)


class Turns:
    def __init__(self, engine, tokenizer, task, env_cfg, params: SamplingParams, budget: int, seed: int,
                 count=lambda name, n=1: None):
        """`params`: sampling of a turn (the stop tokens; the task's stop strings are added); `budget`: tokens
        after the prompt, the record's width (rollout.max_new_tokens); `count(name, n)`: the worker's
        counters."""
        self.engine, self.tokenizer, self.task, self.cfg = engine, tokenizer, task, env_cfg
        self.multi = task.env is not None
        self.params, self.budget, self.count = params, budget, count
        self.stop_ids = set(params.stop_token_ids)
        self.renderer = Renderer(tokenizer, task.observation_role, task.tools) if self.multi else None
        self.episodes: dict[int, Episode] = {}
        self.waiting: list[Episode] = []  # for their environment
        self.pool = StepPool(env_cfg.threads, env_cfg.step_timeout_s) if self.multi else None
        self.rng = random.Random(seed)
        self.finished = 0
        if self.multi and task.stop_strings:
            self.params = replace(params, stop_strings=tuple(task.stop_strings))
            engine.use_vocabulary(vocabulary(tokenizer))
        specials = set(tokenizer.all_special_tokens) | set(tokenizer.get_added_vocab())
        self.specials = sorted((s for s in specials if len(s) > 1), key=len, reverse=True)
        self.cut_ids = tokenizer(CUT_MARK, add_special_tokens=False)["input_ids"]

    def prompt(self, example) -> tuple[list[int], list[dict]]:
        """The first prompt of `example` and its messages (the task's, rendered like every observation)."""
        messages = self.task.messages(example)
        if not self.multi:
            return prompt_ids(self.tokenizer, example.question), messages
        return self.renderer.prompt(messages), messages

    def start(self, key: int, prompt_ids: list[int], messages: list[dict], example) -> Episode:
        """Episode `key` of `example`, whose first prompt (`prompt`) the caller computed once for its
        group."""
        env, failed = None, False
        if self.multi:
            try:
                env = self.task.env()
                env.reset(example)  # deterministic per example, so it gives `messages` again
            except Exception:  # noqa: BLE001 — a broken environment ends its own episode, never the worker
                self.count("env_errors")
                failed = True
        episode = Episode(key, prompt_ids, env, time.monotonic(),
                          [dict(m) for m in messages] if self.multi else [], env_failed=failed)
        self.episodes[key] = episode
        self._request(episode, prompt_ids)
        return episode

    def _request(self, episode: Episode, prompt: list[int]) -> None:
        room = self.budget - len(episode.token_ids)
        limit = min(self.cfg.max_turn_tokens, room) if self.multi else room
        if episode.env_failed:
            limit = 1  # the record needs a sampled token; nothing more is worth decoding
        last_turn = not self.multi or episode.turns + 1 >= self.cfg.max_turns
        params = (self.params if limit == self.params.max_new_tokens
                  else replace(self.params, max_new_tokens=limit))
        request_id = episode.key + (episode.turns << TURN_SHIFT)
        resume = episode.last_request if episode.turns else None
        self.engine.add(Request(request_id, prompt, params, park=not last_turn, resume=resume))
        episode.last_request, episode.turn_started = request_id, time.monotonic()

    def owns(self, completion: Completion) -> bool:
        return (completion.request_id & KEY_MASK) in self.episodes

    def completed(self, done: Completion) -> Episode | None:
        """A policy turn finished: the episode if it ended, else None (its environment step is under way)."""
        episode = self.episodes[done.request_id & KEY_MASK]
        episode.model_s += time.monotonic() - episode.turn_started
        episode.turns += 1
        episode.append(done.token_ids, done.logprobs, done.versions)
        stopped = bool(done.token_ids) and done.token_ids[-1] in self.stop_ids
        if not self.multi:
            return self._end(episode, "done" if done.finish_reason == "stop" else "budget")
        if episode.env_failed:
            return self._end(episode, "env_error")
        if done.finish_reason == "length" and len(episode.token_ids) >= self.budget:
            return self._end(episode, "budget")
        if time.monotonic() - episode.started > self.cfg.episode_timeout_s:
            return self._end(episode, "env_timeout")
        episode.last_stopped = stopped
        turn = done.token_ids[:-1] if stopped else done.token_ids
        text = self.tokenizer.decode(turn, skip_special_tokens=True)
        episode.messages.append({"role": "assistant", "content": self.tokenizer.decode(turn)})
        delay = self._latency()
        episode.pending = self.pool.submit(_step, episode.env, text, delay)
        self.waiting.append(episode)
        return None

    def _latency(self) -> float:
        """A remote tool's stand-in: log-normal with mean env.latency_s (0: none)."""
        mean, sigma = self.cfg.latency_s, self.cfg.latency_sigma
        if mean <= 0:
            return 0.0
        return self.rng.lognormvariate(math.log(mean) - sigma * sigma / 2, sigma)

    def busy(self) -> int:
        """Environment steps under way."""
        return len(self.waiting)

    def poll(self) -> list[Episode]:
        """Environment steps that answered (or ran out of time): continue their episodes or end them."""
        ended, still = [], []
        for episode in self.waiting:
            job = episode.pending
            if not job.done():
                if time.monotonic() - episode.started > self.cfg.episode_timeout_s:
                    self.count("env_timeouts")
                    ended.append(self._end(episode, "env_timeout"))
                else:
                    still.append(episode)
                continue
            episode.env_s += (job.finished or time.monotonic()) - job.submitted
            if job.timed_out:
                self.count("env_timeouts")
                ended.append(self._end(episode, "env_timeout"))
                continue
            episode.pending = None
            try:
                answer = self._answer(episode, job.result())
            except Exception:  # noqa: BLE001
                # whatever a broken environment raises or returns ends its episode, counted
                self.count("env_errors")
                answer = "env_error"
            if isinstance(answer, str):
                ended.append(self._end(episode, answer))
                continue
            episode.append(answer)
            self._request(episode, episode.prompt_ids + episode.token_ids)
        self.waiting = still
        return ended

    def _answer(self, episode: Episode, step: Step) -> str | list[int]:
        """What the environment's step makes of the episode: the reason it ends, or the tokens of the
        observation that goes before its next turn. Raises on anything an environment should not return."""
        if not isinstance(step, Step):
            raise TypeError(f"env.step returned {type(step).__name__}, not envs.Step")
        reward = float(step.reward)
        if not math.isfinite(reward):
            raise ValueError(f"env.step gave the reward {reward}")  # one NaN would skip a whole batch
        episode.reward += reward
        episode.turn_rewards.append(reward)  # one step per turn: the last turn may end with none
        info = self._counted(step.info)
        episode.success = bool(info.get("success", False))
        if step.done or step.observation is None:
            return "done"
        if episode.turns >= self.cfg.max_turns:
            return "max_turns"
        text = self._clean(str(step.observation))
        episode.messages.append({"role": self.task.observation_role, "content": text})
        closing = [] if episode.last_stopped else self.renderer.end_of_turn
        ids = closing + self.renderer.observation(text)
        if len(episode.token_ids) + len(ids) + 1 > self.budget:
            return "context"
        return ids

    def _counted(self, info) -> dict:
        """A step's counts (COUNTED) into the worker's counters: a count that is not a whole number of
        events (a string, NaN, negative, huge), or an info that is not a dict, is ignored and counted
        (episode/info_ignored). Returns the info, or {} in place of one that is not a dict."""
        if not isinstance(info, dict):
            self.count("info_ignored")
            return {}
        for name in COUNTED:
            value = info.get(name)
            if value is None:
                continue
            if isinstance(value, numbers.Real) and math.isfinite(value) and 0 <= value < 2 ** 31:
                if value:
                    self.count(name, int(value))
            else:
                self.count("info_ignored")
        return info

    def _clean(self, text: str) -> str:
        """An observation as the policy will read it: no text that would render as a special token (a turn
        delimiter faked by a tool), and at most env.max_observation_tokens tokens, cut in the middle."""
        limit = self.cfg.max_observation_tokens
        if len(text) > 16 * limit:  # a 10 MB answer is cut before it is tokenized
            text = text[:8 * limit] + CUT_MARK + text[-8 * limit:]
        for special in self.specials:
            if special in text:
                self.count("observations_sanitized")
                text = text.replace(special, special[0] + "\u200b" + special[1:])
        ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        if len(ids) > limit:
            self.count("observations_cut")
            text = self.tokenizer.decode(cut_middle(ids, limit, self.cut_ids))
        return text

    def _end(self, episode: Episode, reason: str) -> Episode:
        episode.finish = reason
        episode.masked = reason in self.cfg.mask
        del self.episodes[episode.key]
        if not self.multi:
            return episode
        self._close(episode)
        self.count("model_ms", int(1000 * episode.model_s))
        self.count("env_ms", int(1000 * episode.env_s))
        self.count("episodes")
        self.count("successes", int(episode.success))
        self.finished += 1
        if self.cfg.check_every and self.finished % self.cfg.check_every == 1 % self.cfg.check_every:
            self.count("template_checks")
            self.count("template_mismatches", int(not self.matches_rendering(episode)))
        return episode

    def _close(self, episode: Episode) -> None:
        """Close the episode's environment, never while a step of it still runs: a step past its deadline is
        written off, and its thread closes the environment once the step returns."""
        job, episode.pending = episode.pending, None
        if episode.env is None:
            return
        if job is not None and self.pool.write_off(job, then=episode.env.close):
            self.count("stuck_threads")
            return
        try:
            episode.env.close()
        except Exception:  # noqa: BLE001 — a broken close ends nothing more
            self.count("env_errors")

    def matches_rendering(self, episode: Episode) -> bool:
        """The record against the whole conversation rendered at once by the chat template (with each turn's
        text as decoded): the token-in, token-out record must be a prefix of it. A mismatch can also come from
        the policy sampling a non-canonical tokenization of its text, which the record keeps as sampled."""
        messages = episode.messages
        ends_with_reply = messages[-1]["role"] == "assistant"
        text = self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=not ends_with_reply,
                                                  **({"tools": self.task.tools} if self.task.tools else {}),
                                                  **self.renderer.options)
        rendered = self.tokenizer(text, add_special_tokens=False)["input_ids"]
        record = episode.prompt_ids + episode.token_ids
        if ends_with_reply and not episode.last_stopped:
            rendered = rendered[:len(record)]  # a reply cut short has no end of turn in the record
        return rendered[:len(record)] == record

    def close(self) -> None:
        if self.pool is not None:
            self.pool.close()


def _step(env, text: str, delay: float) -> Step:
    if delay:
        time.sleep(delay)
    return env.step(text)


def vocabulary(tokenizer) -> list[str]:
    """The text of every token id (decoded alone), computed once per tokenizer: stop strings are matched on
    it."""
    texts = getattr(tokenizer, "ringrl_vocabulary", None)
    if texts is None:
        texts = tokenizer.ringrl_vocabulary = tokenizer.batch_decode([[i] for i in range(len(tokenizer))])
    return texts
