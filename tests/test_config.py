"""The config: one schema (runtime/schema.py and each rule's and task's Config), presets that only change it,
and one-line errors naming the key, checked here without starting a run (tests/test_train_e2e.py runs
train.py)."""
import dataclasses
import inspect
import os

import pytest
from omegaconf import OmegaConf

import algos
import tasks
from launch.config import CONF_DIR, GROUPS, check_overrides, compose, options_of, parse
from runtime.schema import ClusterConfig, Config, RolloutConfig, TrainConfig

SECTIONS = [f.name for f in dataclasses.fields(Config) if dataclasses.is_dataclass(f.default_factory)]


def _schema_classes():
    classes = [Config] + [f.default_factory for f in dataclasses.fields(Config)
                          if dataclasses.is_dataclass(f.default_factory)]
    classes += [algos.get(name).Config for name in algos.names()] \
        + [tasks.get(name).Config for name in tasks.names()]
    return classes


@pytest.mark.parametrize("cls", _schema_classes(), ids=lambda c: f"{c.__module__}.{c.__qualname__}")
def test_every_schema_key_has_a_default_and_a_comment(cls):
    for f in dataclasses.fields(cls):
        # an identity; a section (its own class)
        if f.name == "name" or dataclasses.is_dataclass(f.default_factory):
            continue
        assert f.default is not dataclasses.MISSING or f.default_factory is not dataclasses.MISSING \
            or f.name in ("algo", "task"), f"{cls.__qualname__}.{f.name} has no default"
        # inherited: its base
        owner = next(c for c in cls.__mro__ if f.name in c.__dict__.get("__annotations__", {}))
        source = inspect.getsource(owner).splitlines()
        index = next(i for i, line in enumerate(source) if line.strip().startswith(f"{f.name}:"))
        commented = "#" in source[index] or source[index - 1].strip().startswith("#")
        assert commented, f"{cls.__qualname__}.{f.name} has no comment"


def _leaves(data, prefix=""):
    for key, value in data.items():
        if isinstance(value, dict):
            yield from _leaves(value, f"{prefix}{key}.")
        else:
            yield f"{prefix}{key}", value


PRESETS = [(g, o) for g in GROUPS for o in options_of(g)
           if os.path.exists(os.path.join(CONF_DIR, g, f"{o}.yaml"))]


@pytest.mark.parametrize("group, option", PRESETS)
def test_a_preset_sets_only_what_differs_from_the_schema(group, option):
    """conf/<group>/<option>.yaml: Hydra's _global_ package (one convention for every group), the schema of
    its rule or task pulled in, no value that repeats the schema's default, and at least one value: a rule or
    task that sets nothing else has no preset (`algo=<name>` selects its schema by itself)."""
    path = os.path.join(CONF_DIR, group, f"{option}.yaml")
    with open(path) as f:
        assert f.readline().strip() == "# @package _global_", path
    preset = OmegaConf.to_container(OmegaConf.load(path)) or {}
    defaults = preset.pop("defaults", [])
    if group in ("algo", "task"):
        assert defaults == [{f"/schema/{group}@{group}": option}], path
        assert preset, f"{path} only selects its {group}: delete it"
    else:
        assert defaults == [], path
    # the schema's own defaults (the composed default run carries the default presets' values)
    base = OmegaConf.structured(Config)
    chosen = OmegaConf.create(OmegaConf.to_container(compose([f"{group}={option}"]), resolve=True))
    for key, value in _leaves(preset):
        assert OmegaConf.select(chosen, key) == value, (path, key)  # it is applied
        section, _, rest = key.partition(".")
        if section == group and group in ("algo", "task"):  # the rule's or task's own defaults
            default = getattr((algos if group == "algo" else tasks).get(option).Config(), rest)
        else:
            default = OmegaConf.select(base, key, throw_on_missing=False)
        assert value != default, f"{path}: {key}={value!r} repeats the schema's default"


def test_every_rule_and_task_has_a_preset_and_back():
    assert options_of("algo") == algos.names()
    assert options_of("task") == tasks.names()


def test_the_composed_default_is_the_schema_but_for_its_task_s_preset():
    """The default run is the schema's defaults, but for the one key its presets set: the arithmetic task's
    entropy minimisation (conf/task/arithmetic.yaml)."""
    cfg = parse(compose([]))
    assert cfg.algo == algos.get("ppo").Config() and cfg.task == tasks.get("arithmetic").Config()
    want = Config()
    want.train = dataclasses.replace(want.train, entropy_coef=-0.1)
    for name in SECTIONS:
        assert getattr(cfg, name) == getattr(want, name), name
    assert (cfg.steps, cfg.seed, cfg.max_staleness) == (Config.steps, Config.seed, Config.max_staleness)


def test_presets_and_the_command_line_compose_in_order():
    cfg = parse(compose(["cluster=cpu2", "task=gsm8k", "algo=grpo", "algo.clip_eps_high=0.28",
                         "rollout.max_new_tokens=64"]))
    # gsm8k's preset checkpoints its long completions' activations
    assert cfg.cluster == ClusterConfig(plan="cpu", trainer_ranks=2, oversubscribe=True,
                                        activation_checkpointing=True)
    assert cfg.algo == algos.get("grpo").Config(clip_eps_high=0.28)
    assert cfg.task == tasks.get("gsm8k").Config()
    assert cfg.rollout == RolloutConfig(max_new_tokens=64)  # the command line beats the task's 512
    assert cfg.train == TrainConfig()


TYPOS = [  # a typo in every section, and in the rule's and the task's own keys
    (["stepz=3"], "unknown config key 'stepz'"),
    (["rollout.group_sise=4"], "unknown config key 'rollout.group_sise'"),
    (["algo=grpo", "algo.clip_epz=0.2"], "unknown config key 'algo.clip_epz' for algo=grpo"),
    (["algo=nope"], "unknown algo 'nope'"),
    (["task=nope"], "unknown task 'nope'"),
    (["train.lrr=1"], "unknown config key 'train.lrr', did you mean 'train.lr'? (known: adam_beta1, "
                      "adam_beta2, adam_eps, autocast, batch_groups, compile,"),
    (["stepz=3"], "unknown config key 'stepz', did you mean 'steps'? (known: algo,"),
    (["task.max_operands=3"], "unknown config key 'task.max_operands' for task=arithmetic, did you mean "
                              "'task.max_operand'?"),
    (["train.zzz=1"], "unknown config key 'train.zzz' (known: adam_beta1,"),  # nothing near: no guess
    (["rollout.groupsize=4"], "unknown config key 'rollout.groupsize'"),
    (["model.pth=x"], "unknown config key 'model.pth'"),
    (["cluster.rollout_worker=2"], "unknown config key 'cluster.rollout_worker'"),
    (["buffer.sampel=fifo"], "unknown config key 'buffer.sampel'"),
    (["reward.timeout=1"], "unknown config key 'reward.timeout'"),
    (["eval.evry=1"], "unknown config key 'eval.evry'"),
    (["checkpoint.keeep=1"], "unknown config key 'checkpoint.keeep'"),
    (["algo=tb", "algo.beta=1"], "unknown config key 'algo.beta' for algo=tb"),
    (["algo.beta_start=1"], "unknown config key 'algo.beta_start' for algo=ppo"),
    (["algo=grpo", "algo.beta_start=1"], "unknown config key 'algo.beta_start' for algo=grpo"),
    (["-m", "algo=tb,grpo", "algo.clip_eps=0.1"], "unknown config key 'algo.clip_eps' for algo=tb"),
    (["task.max_operands=3"], "unknown config key 'task.max_operands' for task=arithmetic"),
    (["task=gsm8k", "task.pathh=x"], "unknown config key 'task.pathh' for task=gsm8k"),
    (["train.lr=fast"], "config key 'train.lr' must be of type float (got 'fast')"),
    (["-m", "max_staleness=0,1,two"], "config key 'max_staleness' must be of type int (got 'two')"),
    (["cluster=gpu9"], "unknown cluster 'gpu9' (choose one of: auto, cpu, cpu2, gpu1, gpu8, ray)"),
    (["hydra.sweep.subdir=a=${seed}"], "quote a value holding '=' or ','"),
]


@pytest.mark.parametrize("overrides, message", TYPOS, ids=[" ".join(o) for o, _ in TYPOS])
def test_a_typo_anywhere_names_the_key_in_one_line(overrides, message):
    with pytest.raises(ValueError) as error:
        check_overrides(overrides)
    assert message in str(error.value) and "\n" not in str(error.value)


RANGES = {  # values of the right type but out of range: refused by the schema's checks, in one line
    "steps=0": "config key 'steps' must be >= 1",
    "max_staleness=-1": "config key 'max_staleness' must be >= 0",
    "algo=tb rollout.group_size=1": "config key 'rollout.group_size' must be >= 2",
    "algo=online_dpo rollout.group_size=1": "config key 'rollout.group_size' must be >= 2",
    "train.batch_groups=0": "config key 'train.batch_groups' must be >= 1",
    "train.micro_tokens=-2": "config key 'train.micro_tokens' must be >= 0 (or -1: by device)",
    "rollout.max_new_tokens=0": "config key 'rollout.max_new_tokens' must be >= 1",
    "rollout.temperature=0": "config key 'rollout.temperature' must be > 0",
    "rollout.top_p=1.5": "config key 'rollout.top_p' must be in (0, 1]",
    "rollout.dtype=float16": "config key 'rollout.dtype' must be auto, bfloat16 or float32",
    "algo=grpo algo.clip_eps=3": "config key 'algo.clip_eps' must be in (0, 1)",
    "train.lr=-1e-5": "config key 'train.lr' must be > 0",
    "train.min_lr=1e-3": "config key 'train.min_lr' must be in [0, train.lr=2.5e-05]",
    "eval.k=0": "config key 'eval.k' must be >= 1",
    "checkpoint.keep=-1": "config key 'checkpoint.keep' must be >= 0",
    "buffer.sampler=lifo": "config key 'buffer.sampler' must be auto, fifo or tba",
    "buffer.dynamic_max_drops=-1": "config key 'buffer.dynamic_max_drops' must be >= 0",
    "algo=ppo algo.dual_clip=0.5": "config key 'algo.dual_clip' must be 0 (off) or > 1",
    "logger=mlflow": "config key 'logger' must be none, tensorboard or wandb",
    "cluster.threads_per_process=4096": "must fit the",
    "cluster=cpu2 train.batch_groups=3": "'train.batch_groups' must be divisible by cluster.trainer_ranks=2",
    "task.max_operand=0": "config key 'task.max_operand' must be >= 1",
}


@pytest.mark.parametrize("line", RANGES)
def test_a_value_out_of_range_names_the_key_in_one_line(line):
    overrides, message = line.split(), RANGES[line]
    check_overrides(overrides)  # the right keys and types: only the ranges refuse them
    with pytest.raises(ValueError) as error:
        parse(compose(overrides))
    assert message in str(error.value) and "\n" not in str(error.value)


def test_the_default_runs_on_one_core_and_fixed_thread_pools_must_fit_the_cores(monkeypatch):
    """One thread per process (auto's share when the sides overlap, or threads_per_process=1) only takes turns
    on a core; bigger fixed pools than the cores are refused unless asked for."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0})
    for overrides in ([], ["max_staleness=2"], ["cluster=cpu2"], ["cluster.threads_per_process=1"]):
        parse(compose(overrides))
    with pytest.raises(ValueError, match=r"must fit the 1 cores here \(or set cluster.oversubscribe=true\)"):
        parse(compose(["cluster.threads_per_process=2"]))
    parse(compose(["cluster.threads_per_process=2", "cluster.oversubscribe=true"]))


def test_good_overrides_pass_the_check():
    check_overrides(["-m", "max_staleness=0,1,2", "algo=tb,ppo", "train.lr=1e-5", "train.lr=1", "task=gsm8k",
                     "task.path=/x", "hydra.run.dir=/tmp/x", "resume=", "rollout.max_new_tokens=32"])


def test_a_saved_config_is_checked_like_a_composed_one():
    """`resume=` reads the run's config.yaml back through the same schema."""
    saved = OmegaConf.to_container(compose(["algo=ppo"]), resolve=True)
    assert parse(saved).algo == algos.get("ppo").Config()
    saved["train"]["lrr"] = 1.0
    with pytest.raises(ValueError, match=r"^unknown config key 'train.lrr', did you mean 'train.lr'\? "
                                         r"\(known: adam_beta1, adam_beta2, adam_eps, autocast,"):
        parse(saved)
    saved["train"].pop("lrr")
    saved["train"]["lr"] = -1.0
    with pytest.raises(ValueError, match=r"^config key 'train.lr' must be > 0 \(got -1.0\)$"):
        parse(saved)
