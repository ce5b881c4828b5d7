"""Accuracy on a task's test split: greedy pass@1 and sampled pass@k, generated with the CPU engine.

Used by the learner every `eval.every` steps and at the end, and by `python train.py eval.only=true`.
"""
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


def evaluate(model, tokenizer, task, spec: EvalSpec) -> dict:
    return Evaluator(model, tokenizer, task, spec)()


class Evaluator:
    """An engine kept for repeated evaluations: the learner loads each new policy into `weight_tensors()`
    and calls it, without holding a second Hugging Face model."""

    def __init__(self, model, tokenizer, task, spec: EvalSpec):
        self.tokenizer, self.task, self.spec = tokenizer, task, spec
        self.examples = task.test[: spec.max_examples] if spec.max_examples else task.test
        self.prompts = [tasks.prompt_ids(tokenizer, ex.question) for ex in self.examples]
        longest = max(map(len, self.prompts), default=0)
        self.engine = CPUEngine(model, max_batch=64, max_len=longest + spec.max_new_tokens, seed=spec.seed,
                                dtype=getattr(torch, spec.dtype))

    def weight_tensors(self) -> dict:
        return self.engine.weight_tensors()

    def __call__(self) -> dict:
        if not self.examples:
            return {}
        return _score(self.engine, self.tokenizer, self.task, self.spec, self.examples, self.prompts)


def _score(engine, tokenizer, task, spec, examples, prompts) -> dict:
    greedy = SamplingParams(0.0, 1.0, spec.max_new_tokens, spec.stop_ids)
    sampled = SamplingParams(spec.temperature, 1.0, spec.max_new_tokens, spec.stop_ids)
    requests = [Request(i, p, greedy) for i, p in enumerate(prompts)]
    requests += [Request(len(prompts) + i * spec.k + j, p, sampled) for i, p in enumerate(prompts) for j in range(spec.k)]
    completions = engine.generate(requests)
    texts = tokenizer.batch_decode([c.token_ids for c in completions], skip_special_tokens=True)
    references = [ex.answer for ex in examples] + [ex.answer for ex in examples for _ in range(spec.k)]
    with RewardPool(task.reward, spec.reward_workers, spec.reward_timeout_s, task.reward_options) as pool:
        scores = pool.score(texts, references)
    n = len(examples)
    solved = [max(scores[n + i * spec.k : n + (i + 1) * spec.k]) for i in range(n)]
    return {
        "eval_pass@1": sum(scores[:n]) / n,  # greedy
        f"eval_pass@{spec.k}": sum(solved) / n,
        "eval_sample_reward": sum(scores[n:]) / (n * spec.k),
        "eval_examples": n,
    }
