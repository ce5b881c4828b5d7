"""Agent code as a user writes it: plain `openai` client calls, no ringrl import (tests/test_agent.py drives
them through a rollout worker's endpoint)."""
import json

TOOLS = [{"type": "function", "function": {"name": name, "description": what, "parameters": {
    "type": "object", "properties": {arg: {"type": "string"}}, "required": [arg]}}}
    for name, what, arg in (("calc", "Evaluate arithmetic.", "expression"),
                            ("capital", "The capital city of a country.", "country"))]
ANSWERS = {"calc": "42", "capital": "Paris"}


def two_tools(client, example) -> float:
    """Ask, answer every tool call the model makes (whatever the tool) with its canned result, up to three
    turns; reward 1 if the last reply names the answer."""
    messages = [{"role": "system", "content": "Use the tools."},
                {"role": "user", "content": example.question}]
    for _ in range(3):
        reply = client.chat.completions.create(model="policy", messages=messages, tools=TOOLS)
        message = reply.choices[0].message
        messages.append(message.model_dump(exclude_none=True))  # the reply as returned, tool calls and all
        if not message.tool_calls:
            break
        for call in message.tool_calls:
            json.loads(call.function.arguments)  # arguments arrive as a JSON string, as from any provider
            messages.append({"role": "tool", "tool_call_id": call.id, "content": ANSWERS[call.function.name]})
    return float(example.answer in (messages[-1].get("content") or ""))


def edits_its_history(client, example) -> float:
    """Two turns, then a third request that rewrites the first user turn: not a continuation of what was
    served."""
    messages = [{"role": "user", "content": example.question}]
    first = client.chat.completions.create(model="policy", messages=messages).choices[0].message.content
    messages += [{"role": "assistant", "content": first}, {"role": "user", "content": "Again."}]
    client.chat.completions.create(model="policy", messages=messages)
    rewritten = [{"role": "user", "content": "A shorter question?"}]
    client.chat.completions.create(model="policy", messages=rewritten)
    return 0.5


def raises(client, example) -> float:
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": example.question}])
    raise RuntimeError("the agent broke")


def returns_nan(client, example) -> float:
    client.chat.completions.create(model="policy", messages=[{"role": "user", "content": example.question}])
    return float("nan")


async def asks_async(client, example) -> float:
    reply = await client.chat.completions.create(model="policy",
                                                 messages=[{"role": "user", "content": example.question}])
    return float(bool(reply.choices[0].message.content))
