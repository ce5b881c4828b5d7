"""The OpenAI-compatible endpoint's overhead: the same episodes driven in-process and through the endpoint.

    python -m bench.endpoint [--model smollm2-135m] [--groups 4] [--group-size 8] [--repeats 3] [--dtype auto]

One engine (the built-in engine, 64 slots), one task: arithmetic with retries. In-process, envs/episode.py's
Turns steps tasks/arith_retry.py's environment; through the endpoint, envs/agent.py serves
agents/arith_retry.py, plain `openai` client code in a thread per episode, over HTTP on loopback. The two ask
the same questions with the same words and the same feedback, and a request's tokens are drawn from (seed,
request id, position) (engines/sampler.py), so both sample the same tokens: what differs is the plumbing
(HTTP, JSON, threads, re-rendering the messages of each request). The runs alternate, `--repeats` times each;
prints each run's seconds and model tokens, checks the two sampled the same tokens, and ends with
`endpoint_vs_inprocess=<median seconds through the endpoint / median in-process>` and the added milliseconds
per request.
"""
import argparse
import statistics
import time

import torch

from bench.common import load
from engines.base import SamplingParams
from engines.builtin import BuiltinEngine
from envs.agent import AgentEpisodes
from envs.episode import Turns
from runtime.schema import EnvConfig
from tasks import Task, arith_retry

ENV = EnvConfig(max_turns=3, max_turn_tokens=16, episode_timeout_s=600.0)  # conf/task/arith_retry.yaml's
BUDGET = 96


def drive(episodes, engine, examples: list, group_size: int) -> tuple[float, list]:
    """Every example's group of episodes to its end; (seconds, [(key, sampled tokens)])."""
    start = time.perf_counter()
    for g, example in enumerate(examples):
        ids, messages = episodes.prompt(example)
        for i in range(group_size):
            episodes.start(g * group_size + i, ids, messages, example)
    ended = []
    while episodes.episodes:
        ended += episodes.poll()
        for done in engine.step():
            episode = episodes.completed(done)
            ended += [episode] if episode is not None else []
        if not engine.num_running() + engine.num_waiting():
            time.sleep(0.0005)  # waiting for environments or workflows
    seconds = time.perf_counter() - start
    finishes = sorted({e.finish for e in ended if e.finish != "done"})
    if finishes:
        print(f"  (episodes that did not end done: {finishes})", flush=True)
    return seconds, sorted((e.key, [t for t, m in zip(e.token_ids, e.mask) if m]) for e in ended)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--group-size", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16"))
    args = parser.parse_args()
    torch.set_num_threads(2)
    model, tokenizer = load(args.model)
    native_bf16 = torch.backends.cpu.get_cpu_capability().startswith("AVX512")
    dtype = getattr(torch, args.dtype) if args.dtype != "auto" else \
        torch.bfloat16 if native_bf16 else torch.float32
    engine = BuiltinEngine(model, max_batch=64, max_len=512, seed=0, dtype=dtype)
    data = arith_retry.build(arith_retry.Config(), seed=0)
    examples = data.train[:args.groups]
    params = SamplingParams(1.0, 1.0, BUDGET, (tokenizer.eos_token_id,))
    agent = Task("", [], [], agent=_workflow())
    runs = {"inprocess": [], "endpoint": []}
    tokens, sampled = {}, {}
    calls = {}
    for _ in range(args.repeats):
        for way in runs:
            if way == "inprocess":
                episodes = Turns(engine, tokenizer, data, ENV, params, BUDGET, seed=0)
            else:
                count = {}

                def counted(name, n=1):
                    count[name] = count.get(name, 0) + n
                episodes = AgentEpisodes(engine, tokenizer, agent, ENV, params, BUDGET, seed=0, count=counted)
            try:
                seconds, record = drive(episodes, engine, examples, args.group_size)
            finally:
                episodes.close()
            runs[way].append(seconds)
            sampled[way] = record
            tokens[way] = sum(len(t) for _, t in record)
            if way == "endpoint":
                calls = count
            print(f"{way:10s} {seconds:7.2f} s, {tokens[way]} sampled tokens", flush=True)
    same = sampled["inprocess"] == sampled["endpoint"]
    inproc, through = statistics.median(runs["inprocess"]), statistics.median(runs["endpoint"])
    requests = calls.get("agent_calls", 0)
    print(f"{args.groups} groups x {args.group_size} episodes, {dtype}: the same tokens sampled both ways in "
          f"the last pair: {same} (bf16 numerics may part them: a shared prompt's cache is copied in one, "
          f"prefilled in the other); {requests} requests through the endpoint, "
          f"{1000 * (through - inproc) / max(requests, 1):.2f} ms added a request")
    print(f"endpoint_vs_inprocess={through / inproc:.3f}")


def _workflow():
    from agents.arith_retry import run

    return run


if __name__ == "__main__":
    main()
