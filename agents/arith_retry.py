"""Arithmetic with retries, as agent code: ask, check the answer, say "wrong, try again" up to three times; a
right answer at attempt n scores 0.5 ** (n - 1). The same episodes as task=arith_retry, driven from outside.

    python train.py task=agent task.workflow=agents.arith_retry:run
"""
import re

ATTEMPTS, DISCOUNT = 3, 0.5


def run(client, example) -> float:
    messages = [{"role": "user", "content": example.question}]
    for attempt in range(ATTEMPTS):
        reply = client.chat.completions.create(model="policy", messages=messages)
        text = reply.choices[0].message.content or ""
        numbers = re.findall(r"-?\d+", text)
        if numbers and numbers[-1] == example.answer:
            return DISCOUNT ** attempt
        messages += [{"role": "assistant", "content": text},
                     {"role": "user", "content": "Wrong, try again. Reply with just the number."}]
    return 0.0
