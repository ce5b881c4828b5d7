"""Verifiable rewards: `get_reward(name)` returns `(completion: str, reference: str) -> float` in [0, 1].

`name` is a reward module of this package (`REWARDS.names()`: arithmetic, code, gsm8k, math, redteam,
reward_model; each exposes `REWARD`) or the path "package.module:function" of any
module-level callable with that signature (how tests and experiments plug in their own verifier).
Verifiers are imported on first use, so importing `rewards` never pulls in sympy.
For untrusted model output, score through `rewards.pool.RewardPool`: it adds worker processes and timeouts.
"""
import importlib
import os

from registry import Registry, unknown

# A reward is a module of this package exposing REWARD (a function, or a class built with the task's options);
# the rest of the package is its machinery.
REWARDS = Registry("reward", __name__, os.path.dirname(__file__),
                   helpers=("pool", "sandbox", "sandbox_runner"))


def get_reward(name: str, **options):
    """The scoring callable. A reward that is a class (a reward model) is built here with `options`."""
    if name in REWARDS.names():
        target = REWARDS.get(name).REWARD
    else:
        module_name, _, attr = name.partition(":")
        if not attr:
            raise unknown("reward", name, REWARDS.names(),
                          ", or give a callable's path as 'package.module:function'")
        try:
            target = getattr(importlib.import_module(module_name), attr)
        except (ImportError, AttributeError) as e:
            raise ValueError(f"reward '{name}' could not be loaded ({e}); check the "
                             "'module:function' path") from e
    return target(**options) if isinstance(target, type) else target
