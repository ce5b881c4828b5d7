"""The run configuration as Hydra composes it, parsed into the schema (runtime/schema.py).

Hydra composes `conf/config.yaml`: the schema first (`register` stores it as `schema`, each learning rule's
and task's own `Config` as `schema/algo/<name>` and `schema/task/<name>`), then one preset per group
(`algo=`, `task=`, `model=`, `cluster=`: `conf/<group>/<name>.yaml`, each in Hydra's `_global_` package, so a
preset may also set keys of other sections), then the command line. Presets set only what differs from the
schema; `tests/test_config.py` refuses a preset that repeats a default.

`parse` turns the composed config into the schema's dataclasses and checks every value; `check_overrides` runs
before Hydra so that a mistyped command line gets one line (naming the key) instead of Hydra's multi-line
report.
"""
import difflib
import os
from typing import get_type_hints

from omegaconf import OmegaConf
from omegaconf.errors import ConfigAttributeError, ConfigKeyError, OmegaConfBaseException, ValidationError

from registry import unknown
from runtime.schema import Config

CONF_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "conf")
GROUPS = ("algo", "task", "model", "cluster")


def register() -> None:
    """Hand the schema to Hydra's ConfigStore (before composing): `schema`, and every rule's and task's
    Config."""
    from hydra.core.config_store import ConfigStore

    import algos
    import tasks

    store = ConfigStore.instance()
    store.store(name="schema", node=Config)
    for group, registry in (("algo", algos), ("task", tasks)):
        for name in registry.names():
            store.store(group=f"schema/{group}", name=name, node=registry.get(name).Config)
            # a part with no preset of its own: `algo=<name>` selects its schema
            if not _has_preset(group, name):
                store.store(group=group, name=name, node={"defaults": [{f"/schema/{group}@{group}": name}]},
                            package="_global_")


def compose(overrides: list[str]):
    """What Hydra composes for these overrides, outside a run (tests, tools): the untyped DictConfig."""
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir

    register()
    with initialize_config_dir(config_dir=CONF_DIR, version_base=None):
        return hydra_compose("config", overrides=list(overrides))


def parse(raw) -> Config:
    """The typed, checked config from a composed one (or a run's saved config.yaml): `cfg.algo` and `cfg.task`
    are the chosen rule's and task's own Config. Unknown keys, wrong types and out-of-range values raise a
    one-line ValueError naming the key."""
    data = raw if isinstance(raw, dict) else OmegaConf.to_container(raw, resolve=True)
    typed = _schema(data.get("algo", {}).get("name", ""), data.get("task", {}).get("name", ""))
    try:
        cfg = OmegaConf.to_object(OmegaConf.merge(typed, data))
    except OmegaConfBaseException as e:
        raise ValueError(_one_line(e, typed)) from None
    cfg.check()
    _check_sampler(cfg)
    return cfg


def _check_sampler(cfg: Config) -> None:
    """buffer.sampler=tba trains on groups older than max_staleness, replayed by reward: only a rule whose
    objective holds for data from any policy (its Loss says `any_policy`: tb, online_dpo) is written for that;
    a policy-gradient rule would train past its own staleness bound."""
    import algos

    loss = algos.get(cfg.algo.name).Loss
    if cfg.buffer.sampler == "tba" and not getattr(loss, "any_policy", False):
        able = ", ".join(n for n in algos.names() if getattr(algos.get(n).Loss, "any_policy", False))
        raise ValueError(f"buffer.sampler=tba replays groups older than max_staleness, which algo="
                         f"{cfg.algo.name} is not written for (its ratio or advantage assumes data within "
                         f"the bound); use buffer.sampler=auto or fifo, or "
                         f"algo={able.replace(', ', ' or algo=')}")


def _schema(algo: str, task: str):
    """The schema as an OmegaConf node, with that rule's and that task's Config in their sections."""
    import algos
    import tasks

    typed = OmegaConf.structured(Config)
    typed.algo = OmegaConf.structured(algos.get(algo).Config)
    typed.task = OmegaConf.structured(tasks.get(task).Config)
    return typed


def _one_line(e: OmegaConfBaseException, typed) -> str:
    """OmegaConf's multi-line error as ours: the key, what was wrong, and what is known there."""
    key = e.full_key or str(e.key)
    if isinstance(e, (ConfigKeyError, ConfigAttributeError)):
        parent, _, name = key.rpartition(".")
        node = OmegaConf.select(typed, parent) if parent else typed
        known = sorted(node.keys()) if OmegaConf.is_dict(node) else []
        group = f" for {parent}={typed[parent].name}" if parent in ("algo", "task") else ""
        near = difflib.get_close_matches(name, known, n=1, cutoff=0.75)
        guess = f", did you mean '{parent + '.' if parent else ''}{near[0]}'?" if near else ""
        return f"unknown config key '{key}'{group}{guess} (known: {', '.join(known)})"
    if isinstance(e, ValidationError) and e.object_type is not None \
            and e.key in get_type_hints(e.object_type):
        kind = get_type_hints(e.object_type)[e.key]
        return f"config key '{key}' must be of type {getattr(kind, '__name__', kind)} (got {e.value!r})"
    return f"config key '{key}': {e.msg.splitlines()[0]}"


def check_overrides(args: list[str]) -> None:
    """Refuse, before Hydra sees them, command-line overrides naming an unknown group option or key, or giving
    a value of the wrong type: each is checked against the schema of every option the command line selects."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    overrides = [a for a in args if "=" in a and not a.startswith("-")]
    parser, parsed = OverridesParser.create(), []
    for a in overrides:
        try:
            parsed += [o for o in parser.parse_overrides([a])
                       if not o.key_or_group.startswith("hydra") and not o.is_delete()]
        except OverrideParseException as e:
            raise ValueError(f"cannot parse {a!r} ({str(e).splitlines()[0]}): quote a value holding "
                             "'=' or ',' (key='a=b'; "
                             "https://hydra.cc/docs/advanced/override_grammar/basic)") from None
    choices = {group: [option] for group, option in default_choices().items()}
    for o in parsed:
        if o.key_or_group in GROUPS:
            options = [str(v) for v in _values(o)]
            for option in options:
                if option not in options_of(o.key_or_group):
                    raise unknown(o.key_or_group, option, options_of(o.key_or_group))
            choices[o.key_or_group] = options
    keys = [o for o in parsed if o.key_or_group not in GROUPS]
    for algo in choices["algo"]:
        for task in choices["task"]:
            typed = _schema(preset_name("algo", algo), preset_name("task", task))
            for o in keys:
                for value in _values(o):
                    try:
                        OmegaConf.update(typed, o.key_or_group, value, merge=True)
                    except OmegaConfBaseException as e:
                        raise ValueError(_one_line(e, typed)) from None


def options_of(group: str) -> list[str]:
    """The options of a config group: its presets, conf/<group>/*.yaml, and for `algo` and `task` every rule
    or task module (a part needs a preset only to set other keys)."""
    presets = {f[:-5] for f in os.listdir(os.path.join(CONF_DIR, group)) if f.endswith(".yaml")}
    if group in ("algo", "task"):
        import algos
        import tasks

        presets |= set((algos if group == "algo" else tasks).names())
    return sorted(presets)


def _has_preset(group: str, option: str) -> bool:
    return os.path.exists(os.path.join(CONF_DIR, group, f"{option}.yaml"))


def default_choices() -> dict:
    """The default run's option of each group (conf/config.yaml's defaults list), in that list's order."""
    choices = {}
    for item in OmegaConf.load(os.path.join(CONF_DIR, "config.yaml")).defaults:
        if OmegaConf.is_dict(item):
            choices.update(dict(item))
    return choices


def preset_name(group: str, option: str) -> str:
    """The rule or task a preset of `group` selects: the option of the schema it pulls in (defaults list); a
    part without a preset is its own."""
    if not _has_preset(group, option):
        return option
    preset = OmegaConf.load(os.path.join(CONF_DIR, group, f"{option}.yaml"))
    for item in preset.get("defaults", []):
        if OmegaConf.is_dict(item):
            (key, value), = item.items()
            if key == f"/schema/{group}@{group}":
                return value
    raise ValueError(f"conf/{group}/{option}.yaml must pull its schema: "
                     f"defaults: [/schema/{group}@{group}: <name>]")


def _values(o) -> list:
    """An override's value, or each value of a sweep (`a=1,2`); a sweep Hydra expands otherwise is not
    checked."""
    if not o.is_sweep_override():
        return [o.value()]
    try:
        return list(o.sweep_iterator())
    except Exception:
        return []
