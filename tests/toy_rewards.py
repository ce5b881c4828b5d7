"""Rewards for tests on a random tiny model, which never answers a task right: these vary with any text."""


def length_parity(completion: str, reference: str) -> float:
    return float(len(completion) % 2)
