"""`verifiers` environments as a task: each episode is one rollout of a verifiers (0.4) environment, its
model calls served by the rollout worker's endpoint (envs/agent.py), its reward the rubric's (the task's
`@vf.reward` functions, summed by weight).

    python train.py task=verifiers task.env=agents.verifiers_arith

`task.env` names the environment as verifiers does, a taskset id (an installed environment package such as
`gsm8k-v1`, or one of verifiers' own), or a module path of this repository exporting a `vf.Taskset` (and
optionally its `vf.Harness` or `vf.Env`) in `__all__`. `task.args` are the taskset's own knobs
(`--env.taskset.*` on verifiers' command line); the train and test splits are the taskset loaded with its
`split` knob, verifiers' convention, set to `task.train_split` and `task.test_split`. Every agent runs on
verifiers' local `subprocess` runtime, since the endpoint listens on loopback.

An episode is `Env.run_episode` on the example's task, with the worker's endpoint as the model client (its API
key read from an environment variable of the episode's own, as verifiers reads keys). Whatever the harness
sends goes through verifiers' interception server to the endpoint, which records what it served; the episode
ends when the rollout is scored. A rollout verifiers reports as failed ends the episode as `env_error`
(masked by default, env.mask). Needs `pip install -r requirements-agents.txt` (setup.sh installs it).
"""
import importlib
import itertools
import os
import sys
from dataclasses import dataclass, field

from envs.endpoint import MODEL
from registry import require
from tasks import Example, Task

_KEYS = itertools.count()  # one environment variable an episode for its endpoint key


@dataclass
class Config:
    name: str = "verifiers"
    env: str = "agents.verifiers_arith"  # a verifiers taskset id, or a module path exporting a vf.Taskset
    # the taskset's knobs (its TasksetConfig fields, --env.taskset.* on verifiers' command line)
    args: dict = field(default_factory=dict)
    train_split: str = "train"  # the taskset's `split` knob for training ("": a taskset without one)
    test_split: str = "test"  # the taskset's `split` knob for evaluation ("": evaluate on the training tasks)
    harness: str = ""  # every agent's harness id ("": the taskset's own, else verifiers' default, bash)
    limit: int = 0  # at most this many tasks a split (0: all of them; an infinite taskset needs one)

    def check(self):
        require(bool(self.env.strip()), "task.env", "must name a verifiers environment (e.g. "
                "agents.verifiers_arith)", self.env)
        require(self.limit >= 0, "task.limit", "must be >= 0", self.limit)


@dataclass(frozen=True)
class Row(Example):
    """An example that carries the verifiers task it was made from (the rollout's seed)."""
    task: object = field(default=None, compare=False)


def build(cfg: Config, seed: int) -> Task:
    vf = _verifiers()
    env_config = _env_config(vf, cfg, cfg.train_split)
    train = _rows(vf, cfg, "train", env_config)
    test = _rows(vf, cfg, "test", _env_config(vf, cfg, cfg.test_split)) if cfg.test_split else train
    return Task(reward="", train=train, test=test, agent=workflow(env_config))


def workflow(env_config):
    """A Row's episode: a rollout of its task against the endpoint `client` names; the rubric's reward."""
    async def rollout(client, example: Row) -> float:
        vf = _verifiers()
        env = vf.load_environment(env_config)  # one a rollout: an Env holds its serving resources
        key_var = f"RINGRL_VERIFIERS_KEY_{next(_KEYS)}"  # verifiers reads a client's key from the environment
        os.environ[key_var] = client.api_key
        try:
            ctx = vf.ModelContext(model=MODEL, client=vf.EvalClientConfig(base_url=str(client.base_url),
                                                                          api_key_var=key_var))
            async with env.serving():
                episode = await env.run_episode(example.task, ctx)
        finally:
            os.environ.pop(key_var, None)
        errors = episode.errors + [e for trace in episode.traces for e in trace.errors]
        if not episode.ok or errors:
            error = errors[0] if errors else None
            raise RuntimeError(f"verifiers rollout failed: {error.type}: {error.message}" if error else
                               "verifiers rollout failed")
        return sum(trace.reward for trace in episode.traces) / len(episode.traces)
    return rollout


def _rows(vf, cfg: Config, split: str, env_config) -> list[Row]:
    taskset = vf.load_taskset(env_config.taskset)
    if cfg.limit:
        taskset = taskset.take(cfg.limit)
    elif not taskset.bounded:
        raise ValueError(f"task.env={cfg.env}: its taskset is infinite; bound it with task.limit=<tasks>")
    rows = [Row(task.data.prompt_text, str(getattr(task.data, "answer", "") or ""), task) for task in taskset]
    if not rows:
        raise ValueError(f"task.env={cfg.env}: its taskset has no tasks for the {split} split (knobs "
                         f"{env_config.taskset.model_dump(exclude={'id', 'task'})}); check task.args and "
                         f"task.{split}_split")
    return rows


def _env_config(vf, cfg: Config, split: str):
    """The environment's config: its taskset with task.args and `split`, every agent on the local runtime
    (and task.harness)."""
    from pydantic import ValidationError

    args = {**cfg.args, **({"split": split} if split else {})}
    raw = {"taskset": {**args, "id": _taskset_id(cfg.env)}}
    try:
        config = vf.resolve_env_config(raw)
        seat = {"runtime": {"type": "subprocess"}} | ({"harness": {"id": cfg.harness}} if cfg.harness else {})
        raw |= {name: seat for name, spec in config if isinstance(spec, vf.AgentConfig)}
        return vf.resolve_env_config(raw)
    except ValidationError as error:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in error.errors())
        raise ValueError(f"task.env={cfg.env}: {problems} (task.args={dict(args)})") from None
    except (ImportError, AttributeError, TypeError, ValueError) as error:
        first = str(error).splitlines()[0] if str(error) else type(error).__name__
        raise ValueError(f"task.env={cfg.env}: {first}") from None


def _taskset_id(env: str) -> str:
    """The id verifiers loads the environment by. Its loader imports a top-level module (an installed
    environment's package); a module path such as agents.verifiers_arith is imported here and registered
    under a top-level name of its own."""
    name = env.rsplit("/", 1)[-1].split("@", 1)[0]  # hub ids: owner/name@version
    if "." not in name:
        return env
    alias = "ringrl_env__" + name.replace(".", "__")
    if alias not in sys.modules:
        try:
            sys.modules[alias] = importlib.import_module(name)
        except ImportError as error:
            raise ValueError(f"task.env={env}: {error}; name an importable module or a verifiers "
                             "environment id") from None
    return alias


def _verifiers():
    try:
        import verifiers.v1 as vf
    except ImportError as error:
        raise ValueError(f"task=verifiers needs the verifiers package ({error}): pip install -r "
                         "requirements-agents.txt") from None
    return vf
