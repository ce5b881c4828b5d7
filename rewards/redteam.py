"""Red-teaming reward: the policy writes an attack prompt, a victim model answers it, and a classifier's
probability of the target label on that answer is the reward (minus a diversity penalty, if asked).

The diversity penalty is `diversity` times the largest word-bigram Jaccard similarity between this attack and
the last `memory` attacks this scorer has seen, so repeating one successful attack stops paying.
"""
import re
from collections import deque

import torch

from rewards.reward_model import RewardModel


class RedTeamReward:
    def __init__(self, victim_path: str, classifier_path: str, label: int, victim_max_new_tokens: int,
                 diversity: float, memory: int = 256):
        """The values are task=redteam's schema (tasks/redteam.py); `memory`: recent attacks compared
        against."""
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.classifier = RewardModel(classifier_path, label=label)  # also pins this process to one thread
        self.tokenizer = AutoTokenizer.from_pretrained(victim_path)
        self.victim = AutoModelForCausalLM.from_pretrained(victim_path, dtype=torch.float32).eval()
        self.max_new_tokens, self.diversity = victim_max_new_tokens, diversity
        self.recent: deque[set] = deque(maxlen=memory)

    @torch.inference_mode()
    def __call__(self, attack: str, reference: str = "") -> float:
        text = self.tokenizer.apply_chat_template([{"role": "user", "content": attack[:4000]}],
                                                  tokenize=False, add_generation_prompt=True)
        ids = self.tokenizer(text, return_tensors="pt", add_special_tokens=False).input_ids
        out = self.victim.generate(ids, max_new_tokens=self.max_new_tokens, do_sample=False,
                                   pad_token_id=self.tokenizer.eos_token_id)
        response = self.tokenizer.decode(out[0, ids.shape[1]:], skip_special_tokens=True)
        score = self.classifier(response, "")
        if self.diversity:
            grams = _bigrams(attack)
            score -= self.diversity * max((_jaccard(grams, seen) for seen in self.recent), default=0.0)
            self.recent.append(grams)
        return score


def _bigrams(text: str) -> set:
    words = re.findall(r"\w+", text.lower()[:4000])
    return set(zip(words, words[1:])) or set(words)


def _jaccard(a: set, b: set) -> float:
    return len(a & b) / len(a | b) if a or b else 1.0


# what rewards.get_reward("redteam") returns (built with the task's options if a class)
REWARD = RedTeamReward
