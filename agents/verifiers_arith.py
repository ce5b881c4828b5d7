"""One-digit addition as a `verifiers` environment, written with verifiers' own classes (verifiers 0.4:
`import verifiers.v1 as vf`) and no ringrl import: a Taskset of "What is a + b?" tasks, a Task whose
`@vf.reward` checks the reply's last number, and a Harness that asks the model once.

    python train.py task=verifiers task.env=agents.verifiers_arith

verifiers finds an environment's parts through the module's `__all__`: its Taskset, and here its Harness (the
default harness of a taskset that ships none, `bash`, runs a shell agent under uv in the rollout's runtime).
The harness runs its loop in-process, which verifiers allows as long as every model call goes to the
`endpoint` it is given with the bearer token `secret` (the rollout's interception server, which records the
call and relays it to the model's endpoint).
"""
import random
import re
from typing import Literal

import openai
import verifiers.v1 as vf


class SumData(vf.TaskData):
    answer: str = ""  # a + b


class SumTask(vf.Task[SumData]):
    @vf.reward(weight=1.0)
    async def correct(self, trace: vf.Trace) -> float:
        numbers = re.findall(r"-?\d+", trace.last_reply or "")
        return float(bool(numbers) and numbers[-1] == self.data.answer)


class SumConfig(vf.TasksetConfig):
    split: Literal["train", "test"] = "train"
    max_operand: int = 9
    test_size: int = 20
    seed: int = 0


class SumTaskset(vf.Taskset[SumTask, SumConfig]):
    def load(self):
        c = self.config
        pairs = [(a, b) for a in range(c.max_operand + 1) for b in range(c.max_operand + 1)]
        random.Random(c.seed).shuffle(pairs)
        pairs = pairs[c.test_size:] if c.split == "train" else pairs[:c.test_size]
        for a, b in pairs:
            data = SumData(prompt=f"What is {a} + {b}? Reply with just the number.", answer=str(a + b))
            yield SumTask(data, c.task)


class AskOnce(vf.Harness[vf.HarnessConfig]):
    """The task's prompt as one chat request; the reply ends the rollout."""
    APPENDS_SYSTEM_PROMPT = True
    EXECUTES_CODE = False
    NEEDS_CONTAINER = False

    async def launch(self, ctx, trace, runtime, endpoint, secret, mcp_urls, data) -> vf.ProgramResult:
        system, prompt = self.resolve_text_prompt(data)
        messages = [{"role": "system", "content": system}] if system else []
        messages.append({"role": "user", "content": prompt or ""})
        async with openai.AsyncOpenAI(base_url=endpoint, api_key=secret, max_retries=0) as client:
            reply = await client.chat.completions.create(model=ctx.model, messages=messages)
        return vf.ProgramResult(0, reply.choices[0].message.content or "", "")


__all__ = ["SumTaskset", "AskOnce"]
