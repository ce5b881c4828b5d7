"""Stand-ins for SGLang and CUDA IPC in the GPU path's CPU tests, and a tiny Llama to feed them."""
import asyncio
import json
import os
import pickle
from collections import deque

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from engines.buckets import unpack


def tiny_lm(tied=True, vocab=1024):
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=32, intermediate_size=64,
                                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                        tie_word_embeddings=tied))


def next_token(context):
    return (7 * sum(context) + len(context)) % 50 + 3


class FakeBackend:
    """Stands in for SGLangBackend. Tokens follow from the context alone; each call emits up to `chunk`
    tokens, then (if unfinished) waits for an abort, like a request still decoding when weights arrive. With a
    `vocabulary` (token id -> text, SGLang's tokenizer) it stops on the sampling's `stop` strings as SGLang
    does: on the text of the tokens this call generated, keeping the token that completes one."""

    def __init__(self, chunk=4, vocabulary=None):
        self.loop = asyncio.new_event_loop()
        self.chunk, self.weights, self.vocabulary = chunk, 0, vocabulary
        self.calls, self.loaded, self.log = [], [], []
        self.aborting = False
        self.decoded = 0  # tokens generated over every call

    async def _generate(self, ids, sampling):
        self.calls.append((list(ids), sampling["max_new_tokens"]))
        out, context, text = [], list(ids), ""
        stops = sampling.get("stop") or []
        assert not stops or self.vocabulary is not None, "SGLang needs its tokenizer to match stop strings"
        for _ in range(min(self.chunk, sampling["max_new_tokens"])):
            token = next_token(context)
            context.append(token)
            self.decoded += 1
            out.append((-0.01 * token - self.weights, token, None))
            text += self.vocabulary[token] if stops else ""
            if token in sampling["stop_token_ids"] or any(stop in text for stop in stops):
                return {"meta_info": {"output_token_logprobs": out, "finish_reason": {"type": "stop"}}}
        if len(out) == sampling["max_new_tokens"]:
            return {"meta_info": {"output_token_logprobs": out, "finish_reason": {"type": "length"}}}
        while not self.aborting:
            await asyncio.sleep(0.001)
        return {"meta_info": {"output_token_logprobs": out, "finish_reason": {"type": "abort"}}}

    def generate(self, ids, sampling):
        return self._generate(ids, sampling)

    def pause(self):
        self.aborting = True
        self.log.append("pause")

    def resume(self):
        self.aborting = False
        self.log.append("resume")

    def begin_update(self):
        self.log.append("begin")

    def end_update(self):
        self.log.append("end")

    def load_ipc(self, payloads, flush_cache):
        data, slots = pickle.loads(payloads[0]) if isinstance(payloads[0], bytes) else (None, payloads[0])
        if data is None:
            self.weights = slots  # the engine tests send just a version number
        else:
            flat = torch.frombuffer(bytearray(data), dtype=torch.uint8)
            self.loaded.append(({n: t.clone() for n, t in unpack(flat, slots)}, len(payloads), flush_cache))
        self.log.append(f"load flush={flush_cache}")

    def load_nccl(self, slots, group_name, flush_cache):
        raise AssertionError("not used on the CPU")

    def shutdown(self):
        self.loop.close()


class FakeChannel:
    def __init__(self, *messages):
        self.messages, self.acks = deque(messages), []

    def receive(self, engine, timeout=0.0):
        return self.messages.popleft() if self.messages else None

    def ack(self, engine, version, index):
        self.acks.append((engine, version, index))


def bytes_payloads(flat, slots, tp_size):
    """The CPU tests' stand-in for CUDA IPC handles: the bucket's bytes, one copy per TP rank."""
    return [pickle.dumps((flat.numpy().tobytes(), slots))] * tp_size


class FakeSGLang(FakeBackend):
    """SGLangBackend's constructor and calls, for a rollout process of a real run: decodes a token per 0.2 s,
    far slower than the tiny model learns, so weight updates catch requests in flight; each request gets its
    own tokens (samples of one prompt differ). Writes what every update loaded to
    `<log_dir>/engine-<gpu>-loads.jsonl` (one line per version), its weights to `...-weights.pt`, and how many
    versions it had loaded when each greedy (evaluation) request came to `...-greedy.jsonl`."""

    def __init__(self, log_dir, model_path, tp_size, base_gpu_id, mem_fraction_static, seed, dtype):
        super().__init__()
        self.prefix = os.path.join(log_dir, f"engine-{base_gpu_id}")
        self.submitted = self.interrupted = self.versions = 0

    async def _generate(self, ids, sampling):
        out, context = [], list(ids) + [self.submitted]
        self.submitted += 1
        if sampling["temperature"] == 0:
            with open(self.prefix + "-greedy.jsonl", "a") as f:
                f.write(json.dumps({"versions_loaded": self.versions, "prompt": list(ids)}) + "\n")
        while len(out) < sampling["max_new_tokens"]:
            if self.aborting:
                self.interrupted += 1
                return {"meta_info": {"output_token_logprobs": out, "finish_reason": {"type": "abort"}}}
            await asyncio.sleep(0.2)
            token = next_token(context)
            context.append(token)
            out.append((-0.01 * token, token, None))
        return {"meta_info": {"output_token_logprobs": out, "finish_reason": {"type": "length"}}}

    def end_update(self):
        super().end_update()
        self.versions += 1
        torch.save({name: t for names, _, _ in self.loaded for name, t in names.items()},
                   self.prefix + "-weights.pt")
        with open(self.prefix + "-loads.jsonl", "a") as f:
            f.write(json.dumps({"flush": [flush for *_, flush in self.loaded],
                                "interrupted": self.interrupted}) + "\n")
        self.loaded = []
