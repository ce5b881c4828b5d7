"""Observations as tokens: the chat template's rendering of one more turn, computed from a fixed conversation.

The policy's tokens are appended exactly as sampled and never decoded and encoded again (that shifts tokens
and silently misaligns log-probabilities). What the environment says is rendered once per turn: the template
applied to a fixed two-turn conversation plus the observation, cut after the end of the fixed assistant turn.
The cut falls right after its end-of-turn marker, so what follows (ChatML's `\\n<|im_start|>user\\n...`, the
observation, and the header of the next assistant turn) is exactly what the template puts between an
assistant's end of turn and the next assistant reply, with turn delimiters the policy never sampled.
"""
MARK = "\x00ringrl\x00"  # an assistant reply no template rewrites: the end of turn follows it


class Renderer:
    def __init__(self, tokenizer, role: str = "user", tools: list[dict] | None = None):
        """`role`: the observations' role ("user", or "tool" for models whose template renders tool answers);
        `tools`: JSON schemas given to the template with the first messages (the Hermes format)."""
        self.tokenizer, self.role, self.tools = tokenizer, role, tools
        self.options = dict(getattr(tokenizer, "ringrl_chat_template", {}))
        self.base = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": MARK}]
        text = self._text(self.base)
        start = text.find(MARK)
        if start < 0:
            raise ValueError("the chat template drops an assistant reply; it cannot render "
                             "multi-turn episodes")
        after = text[start + len(MARK):]
        # The end-of-turn marker: what the template writes right after a reply, up to its end-of-sequence
        # text.
        eos = tokenizer.eos_token or ""
        cut = after.find(eos) + len(eos) if eos and eos in after else len(after.rstrip("\n")) if after else 0
        self.cut = start + len(MARK) + cut
        self.base_text = text[:self.cut]
        # what closes a turn that a stop string or its length cut: the template's end of turn
        self.end_of_turn = tokenizer(after[:cut], add_special_tokens=False)["input_ids"]

    def _text(self, messages: list[dict], generation_prompt: bool = False) -> str:
        return self.tokenizer.apply_chat_template(messages, tokenize=False,
                                                  add_generation_prompt=generation_prompt,
                                                  **({"tools": self.tools} if self.tools else {}),
                                                  **self.options)

    def prompt(self, messages: list[dict]) -> list[int]:
        """The first messages, ready for the assistant's reply."""
        return self.tokenizer(self._text(messages, True), add_special_tokens=False)["input_ids"]

    def observation(self, text: str) -> list[int]:
        """Tokens that follow a closed assistant turn: the observation as a `role` turn and the next assistant
        header."""
        return self.continuation([{"role": self.role, "content": text}])

    def continuation(self, messages: list[dict]) -> list[int]:
        """Tokens that follow a closed assistant turn: `messages` (tool answers, user turns, in any roles the
        template renders) and the next assistant header, as the template writes them after a reply."""
        full = self._text(self.base + messages, True)
        if not full.startswith(self.base_text):
            raise ValueError("the chat template is not incremental (adding a turn rewrote earlier ones); "
                             "multi-turn episodes need one that only appends")
        return self.tokenizer(full[self.cut:], add_special_tokens=False)["input_ids"]


def prompt_ids(tokenizer, question: str) -> list[int]:
    """The question as a chat turn, ready for the assistant's reply (with the options tasks.load_tokenizer
    gave)."""
    text = tokenizer.apply_chat_template([{"role": "user", "content": question}], tokenize=False,
                                         add_generation_prompt=True,
                                         **getattr(tokenizer, "ringrl_chat_template", {}))
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def cut_middle(ids: list[int], limit: int, marker: list[int]) -> list[int]:
    """At most `limit` tokens: the head and the tail of `ids` around `marker` (an observation too long)."""
    if len(ids) <= limit:
        return ids
    keep = max(limit - len(marker), 2)
    return ids[:keep - keep // 2] + marker + ids[len(ids) - keep // 2:]
