"""Reward of the synthetic arithmetic task: 1 when the reply's last number is the reference, else 0."""
import re

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def last_number_matches(completion: str, reference: str) -> float:
    numbers = _NUMBER.findall(completion[-10_000:])  # model output is untrusted: bound the work
    if not numbers:
        return 0.0
    try:
        return float(float(numbers[-1]) == float(reference))
    except ValueError:
        return 0.0


# what rewards.get_reward("arithmetic") returns (built with the task's options if a class)
REWARD = last_number_matches
