"""Verifiable rewards: `get_reward(name)` returns `(completion: str, reference: str) -> float` in [0, 1].

`name` is a registered verifier ("arithmetic", "gsm8k", "math", "code") or the path "package.module:function" of any
module-level callable with that signature (how tests and experiments plug in their own verifier).
Verifiers are imported on first use, so importing `rewards` never pulls in sympy.
For untrusted model output, score through `rewards.pool.RewardPool`: it adds worker processes and timeouts.
"""
import importlib

_REWARDS = {
    "arithmetic": "rewards.arithmetic:last_number_matches",
    "gsm8k": "rewards.gsm8k:gsm8k_reward",
    "math": "rewards.math:math_reward",
    "reward_model": "rewards.reward_model:RewardModel",
    "redteam": "rewards.redteam:RedTeamReward",
    "code": "rewards.code:CodeReward",
}


def get_reward(name: str, **options):
    """The scoring callable. A reward that is a class (a reward model) is built here with `options`."""
    path = _REWARDS.get(name, name)
    module_name, _, attr = path.partition(":")
    if not attr:
        raise ValueError(f"unknown reward '{name}' (choose one of: {', '.join(sorted(_REWARDS))}, "
                         "or give a callable's path as 'package.module:function')")
    try:
        target = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ValueError(f"reward '{name}' could not be loaded ({e}); check the 'module:function' path") from e
    return target(**options) if isinstance(target, type) else target
