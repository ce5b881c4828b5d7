"""What the launcher settles once, before the first process starts, and hands to every process beside the
typed config: the facts no config key states (read from the model, the data and the run folder).

    setup = RunSetup(model_path, run_dir, stop_ids, max_prompt_len, eval_spec, config)   # train.py
    RolloutArgs(worker=0, workers=1, cfg=cfg, setup=setup, ...)                          # one per process
"""
from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from runtime.schema import EnvConfig, EvalConfig, RewardConfig


@dataclass(frozen=True)
class EvalSpec:
    """An evaluation's settings: the config's eval and reward sections, and what the launcher resolved."""
    eval: "EvalConfig"  # k, temperature, max_examples
    reward: "RewardConfig"  # the verifier pool's workers and timeout
    max_new_tokens: int  # the rollouts' completion budget
    stop_ids: tuple  # the model's end-of-sequence tokens
    seed: int
    dtype: str = "float32"  # a CPU evaluation engine's weights, as in rollout.dtype
    chat_template: tuple = ()  # model.chat_template as (key, value) pairs (a frozen dataclass holds no dict)
    env: "EnvConfig | None" = None  # a multi-turn task's limits: its test examples are evaluated as episodes


@dataclass(frozen=True)
class RunSetup:
    model_path: str  # model.path resolved: an embedded model's converted folder, a local folder or a hub id
    run_dir: str  # the run's folder (Hydra's): metrics, checkpoints, stacks
    stop_ids: tuple  # every token id that ends a completion (models/facts.py)
    max_prompt_len: int  # the ring's prompt width: the longest training prompt, or rollout.max_prompt_len
    eval_spec: EvalSpec  # how the test split is evaluated (evaluate.py)
    config: dict  # the resolved config as config.yaml holds it: what the metrics logger records
    resume_path: str = ""  # the checkpoint a resumed run starts from ("" for a new run)
    resume_step: int = 0  # its step: the policy version the run continues from
    multi_turn: bool = False  # the task's episodes have an environment (envs/): episode/ metrics are logged
