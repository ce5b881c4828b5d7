"""ringrl: asynchronous RL post-training of language models on one machine.

    python train.py                               # decoupled PPO, arithmetic task, SmolLM2-135M, on the CPU
    python train.py max_staleness=2               # asynchronous: data up to 2 policy versions old
    python train.py -m max_staleness=0,1,2,4      # a sweep, one run after another
    python train.py model.path=<HF dir or hub id> steps=100 train.lr=1e-5
    python train.py resume=outputs/<date>/<time>  # continue a run from its latest checkpoint
    python train.py algo=tb task=gsm8k cluster=gpu8 model.path=Qwen/Qwen2.5-1.5B-Instruct
                                                  # 8 GPUs (docs/gpu.md)
    python plot.py multirun/<date>/<time>         # a sweep side by side: sweep.png and a table
    python train.py --help [train.lr]             # every key (or those named): default, meaning, range

Rollout workers generate while trainer ranks learn; trajectories cross through a shared-memory ring,
weights come back once per batch (a batch is train.minibatches x train.epochs optimizer steps), and
`max_staleness` bounds how old the data may be, in batches.
Outputs go to the Hydra run directory: config.yaml, metrics.jsonl, samples.jsonl, curves.png,
checkpoints/step_N/, summary.json.
"""
import json
import os
import sys
import time

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from launch.config import check_overrides, parse, register
from models import facts

# One-line notices of choices made for this machine (auto precision, auto engine), printed once set-up has
# passed: a set-up error stays the only line on stderr.
NOTICES: list[str] = []


def _print_notices() -> None:
    while NOTICES:
        print(NOTICES.pop(0), file=sys.stderr)


def main(raw) -> None:
    if raw.resume:
        from launch.resume import resumed_config

        raw = _or_exit(resumed_config, raw, HydraConfig.get().overrides.task)
    cfg = _or_exit(parse, raw)
    run_dir = HydraConfig.get().runtime.output_dir
    from trainer.logger import check_backend

    _or_exit(check_backend, cfg.logger)
    from launch.resume import resume_point

    resume = _or_exit(resume_point, run_dir) if cfg.resume else None
    config = OmegaConf.to_container(raw, resolve=True)
    with open(os.path.join(run_dir, "config.yaml"), "w") as f:
        f.write(OmegaConf.to_yaml(config))

    import torch

    from launch.plan import compute_device, device_plan, quiet_libraries

    plan_name = _or_exit(device_plan, cfg.cluster.plan, torch.cuda.device_count(), cfg.cluster.device)
    if cfg.cluster.ray.enabled:  # this machine is the trainer node: its own plan is the node's entry
        cfg = _or_exit(_trainer_node, cfg, plan_name)
    device = compute_device(plan_name, cfg.cluster.device)
    cfg = _precision(cfg, device)
    quiet_libraries()
    from launch.forkserver import context

    # the processes' imports start now, beside the set-up below
    ctx = None if cfg.eval.only else context(device)
    torch.set_num_threads(max(cfg.cluster.threads_per_process, 1))  # the launcher itself computes little
    import tasks
    from models.loader import resolve

    # a missing file or sandbox: before the model
    task = _or_exit(tasks.get(cfg.task.name).build, cfg.task, cfg.seed)
    model_path = _or_exit(resolve, cfg.model.path)
    model_config = _or_exit(facts.checked_config, model_path)
    plan = _or_exit(_plan, plan_name, cfg, model_path, model_config)
    if cfg.eval.only:
        return _evaluate_only(cfg, plan, model_path, run_dir, task)
    error = run(cfg, plan, model_path, run_dir, resume, config, task, ctx)
    if error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(130 if error == "interrupted" else 1)
    print(f"done: {run_dir}{_reached(run_dir)}")


def run(cfg, plan, model_path: str, run_dir: str, resume: dict | None, config: dict, task=None,
        ctx=None) -> str | None:
    """Rollout workers and trainer ranks as `plan` says, until the last step; the error that ended it, or
    None. `task`: the task's data, as built from cfg.task (built here when not given); `ctx`: how the
    processes start (launch/forkserver.py; `spawn` when not given)."""

    import tasks
    from buffer.ring import TrajectoryRing
    from buffer.staleness import StalenessGate, engine_slots, lane_slots
    from engines.arch import engine_path
    from evaluate import longest_request
    from launch.forkserver import wait_for_imports
    from launch.plan import cores_for, free_port, pin_threads
    from launch.summary import draw_curves, write_summary
    from launch.supervisor import Supervisor
    from rollout import RolloutArgs
    from rollout import run as run_worker
    from runtime.heartbeat import Allowance, Heartbeats
    from runtime.setup import RunSetup
    from runtime.shared import NodeCounters, Shared, WorkerCounters
    from trainer.freeze import check_freeze_layers
    from trainer.learner import Rank
    from trainer.loop import TrainerArgs
    from trainer.loop import run as run_learner
    from trainer.peak import learner_peak

    task = task if task is not None else _or_exit(tasks.get(cfg.task.name).build, cfg.task, cfg.seed)
    tokenizer = _or_exit(tasks.load_tokenizer, model_path, cfg.model.chat_template)
    max_prompt_len = _max_prompt_len(tokenizer, task, cfg.rollout.max_prompt_len, cfg.rollout.long_prompts)
    # windows
    _or_exit(engine_path, facts.checked_config(model_path), max_prompt_len + cfg.rollout.max_new_tokens)
    _or_exit(check_freeze_layers, cfg.train.freeze_layers, facts.checked_config(model_path).num_hidden_layers)
    if task.multi_turn:  # the chat template must render an episode turn by turn
        from envs.render import Renderer

        _or_exit(lambda: Renderer(tokenizer, task.observation_role, task.tools).observation("ok"))
    stop_ids = facts.stop_ids(model_path)
    eval_spec = _eval_spec(cfg, stop_ids)
    rollout, workers = cfg.rollout, plan.rollout_workers
    nodes = None
    if cfg.cluster.ray.enabled:  # generator nodes' workers take the ids (and ring lanes) after this node's
        from launch.ray_nodes import RayNodes

        nodes = RayNodes(cfg.cluster.ray, first_worker=workers)
    lanes = nodes.workers if nodes else workers  # every rollout worker, on any node
    cores = cores_for(cfg.cluster, plan, cfg.max_staleness)
    pin_threads(max(cores.most("worker"), cores.most("trainer")))  # each OpenMP pool is sized for its most

    # Every shared object exists before the first spawn; children receive them as arguments.
    # Each worker owns a lane of slots; one lane can hold every group the staleness bound lets it start.
    hearts = Heartbeats([f"rollout-{w}" for w in range(workers)]
                        + [f"trainer-{r}" for r in range(plan.trainer_ranks)])
    c = cfg.cluster
    sup = Supervisor(os.path.join(run_dir, "stacks"), hearts,
                     Allowance(c.hang_timeout_s, c.slow_timeout_s, c.start_timeout_s), ctx)
    shared = Shared(
        ring=TrajectoryRing(lanes * lane_slots(cfg.max_staleness, cfg.train.batch_groups), rollout.group_size,
                            max_prompt_len, rollout.max_new_tokens, num_producers=lanes),
        gate=StalenessGate(cfg.train.batch_groups, cfg.max_staleness,
                           version=resume["step"] if resume else 0),
        weights=plan.weights(facts.meta_model(model_path), rollout.dtype),
        counters=WorkerCounters(lanes),
        stop=sup.stop,
        finish=sup.finished,
        cores=cores,
        hearts=hearts,
        nodes=NodeCounters([n.index for n in nodes.nodes]) if nodes else None)
    evaluator = plan.evaluator(longest_request(task, tokenizer, eval_spec), rollout.dtype)
    # What every process gets: the typed config whole, what was settled here, and its own few values.
    setup = RunSetup(model_path, run_dir, stop_ids, max_prompt_len, eval_spec, config,
                     resume_path=resume["path"] if resume else "",
                     resume_step=resume["step"] if resume else 0, multi_turn=task.multi_turn)
    slots = engine_slots(cfg.max_staleness, cfg.train.batch_groups, rollout.group_size, rollout.max_batch)
    engines = [plan.engine(w, slots, max_prompt_len + rollout.max_new_tokens, rollout.dtype)
               for w in range(workers)]
    # perf/learner_mfu's CPU peak, measured while nothing else computes (a GPU's: by its trainer rank)
    device = plan.placement(0).device
    if device.type == "cpu" and ctx is not None and ctx.get_start_method() == "forkserver":
        wait_for_imports()
    peak = learner_peak(device, cfg.train.autocast, cores.most("trainer")) if device.type == "cpu" else None
    port = free_port()
    start = time.time()
    error = None
    _print_notices()

    delivered_at_start: dict[int, int] = {}  # groups worker w had delivered when its current process started

    def start_worker(w: int, first_group: int) -> None:
        delivered_at_start[w] = shared.counters.get(w, "groups")
        args = RolloutArgs(w, workers, cfg, setup, engines[w], evaluator, shared, first_group)
        sup.start(f"rollout-{w}", run_worker, dict(args=args), cores.worker_threads())

    def restart_worker(name: str, message: str) -> bool:
        """A rollout worker died or was stuck: free what it held and start a new one where it stopped, up to
        max_restarts. One that never delivered a group (its set-up failed or hung) would only do it again: the
        run stops with its error."""
        if not name.startswith("rollout-"):
            return False
        w = int(name.split("-")[1])
        restarts = shared.counters.get(w, "restarts")
        if restarts >= plan.max_restarts or shared.counters.get(w, "groups") == delivered_at_start[w]:
            return False
        lost = shared.reclaim(w)
        if lost is None:  # the trainer took its last step meanwhile: the worker is retired, not replaced
            return False
        print(f"warning: {message.splitlines()[0]}; restarting it ({restarts + 1}/{plan.max_restarts}), "
              f"{lost} unfinished groups dropped", file=sys.stderr)
        start_worker(w, shared.counters.get(w, "next_group"))
        return True

    try:
        for w in range(workers):
            start_worker(w, resume["next_group"].get(w, 0) if resume else 0)
        if nodes is not None:
            from launch.agent import NodeRun

            engine = plan.engine(0, slots, max_prompt_len + rollout.max_new_tokens, rollout.dtype)
            nodes.start(NodeRun(lanes, cfg, setup, plan, engine, evaluator,
                                lane_slots(cfg.max_staleness, cfg.train.batch_groups), max_prompt_len,
                                os.path.join(run_dir, "stacks"), slots),
                        shared, slots, resume["next_group"] if resume else {})
        plan.wait_for_engines(shared.weights, sup)
        for r in range(plan.trainer_ranks):
            args = TrainerArgs(Rank(r, plan.trainer_ranks, port, plan.placement(r)), lanes, cfg, setup,
                               evaluator, shared, progress=cfg.progress and r == 0, peak=peak)
            sup.start(f"trainer-{r}", run_learner, dict(args=args), cores.trainer_threads(alone=False),
                      essential=True)
        error = sup.watch(on_failure=restart_worker)
        if nodes is not None and nodes.error:  # the trainer stopped because nothing was left to generate
            error = nodes.error
    except KeyboardInterrupt:
        error = "interrupted"
    except (TimeoutError, ValueError) as e:  # cluster=ray: a node or Ray itself that did not come up
        error = str(e)
    except Exception as e:  # cluster=ray: anything else from Ray or a collective's set-up, in one line
        if nodes is None:
            raise
        error = f"cluster=ray: {type(e).__name__}: {str(e).strip().splitlines()[0] if str(e).strip() else ''}"
    finally:
        late = sup.shutdown()
        if late:
            print(f"warning: {late}", file=sys.stderr)
        if nodes is not None:
            nodes.close()
        counts = {**_launcher_counts(shared.counters), **(nodes.metrics() if nodes else {})}
        write_summary(run_dir, start, error, sup.peak_mb, counts, sup.peak_parts, sup.peak_each,
                      sup.peak_rss_mb)
        if cfg.curves:
            draw_curves(run_dir)
    return error


def _trainer_node(cfg, plan: str):
    """cluster=ray: the config with cluster.rollout_workers and trainer_ranks those of the trainer node's
    entry."""
    import dataclasses

    if plan != "cpu":
        raise ValueError("cluster=ray runs the CPU plan on every node so far (cluster.plan=cpu)")
    node = cfg.cluster.ray.trainer_node
    return dataclasses.replace(cfg, cluster=dataclasses.replace(
        cfg.cluster, rollout_workers=node.rollout_workers, trainer_ranks=node.trainer_ranks))


def _launcher_counts(counters) -> dict:
    """What the launcher counted (worker restarts, groups lost with a dead worker), read once every process
    has stopped: summary.json's, equal to the last metrics row's by construction (runtime.shared.Finish)."""
    return {f"rollout/{name}": counters.total(name) for name in ("restarts", "lost_groups")}


def _reached(run_dir: str) -> str:
    """When the run's reward got to each bar of summary.json (launch/summary.py's time to reward)."""
    from launch.summary import THRESHOLDS

    with open(os.path.join(run_dir, "summary.json")) as f:
        summary = json.load(f)
    parts = [f"{t} at {summary[f'time_to_reward_{t}']:.0f} s (step {summary[f'step_to_reward_{t}']})"
             for t in THRESHOLDS if summary.get(f"time_to_reward_{t}") is not None]
    return f"; 3-step mean reward reached {', '.join(parts)}" if parts else ""


def _precision(cfg, plan: str):
    """The config with `auto` precisions settled for this machine (launch.plan.resolve_precision)."""
    import dataclasses

    from launch.plan import resolve_precision

    dtype, autocast, notice = resolve_precision(cfg.rollout.dtype, cfg.train.autocast, plan)
    if notice:
        NOTICES.append(notice)
    return dataclasses.replace(cfg, rollout=dataclasses.replace(cfg.rollout, dtype=dtype),
                               train=dataclasses.replace(cfg.train, autocast=autocast))


def _plan(name: str, cfg, model_path: str, model_config):
    """The plan's pieces: launch.plan.CPUPlan, or launch.gpu.GPUPlan laid out for these GPUs and this
    model."""
    from engines import ENGINES
    from launch.plan import CPUPlan, compute_device, engine_kind

    engine, notice = engine_kind(cfg.rollout.engine, compute_device(name, cfg.cluster.device))
    if notice:
        NOTICES.append(notice)
    described = ENGINES.get(engine).SPEC.model_notice(model_config)  # a model it cannot run: one line, exit 2
    if described:
        NOTICES.append(described)
    if name == "cpu":
        return CPUPlan(cfg.cluster.rollout_workers, cfg.cluster.trainer_ranks, cfg.cluster.max_restarts,
                       engine, cfg.cluster.activation_checkpointing)
    import torch

    from launch.gpu import gpu_plan

    if cfg.cluster.device == "cpu":  # the one-GPU layout, its "GPU" this machine's memory
        gpus, gpu_bytes = 1, os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    else:
        gpus, gpu_bytes = torch.cuda.device_count(), torch.cuda.get_device_properties(0).total_memory
    plan = gpu_plan(cfg.cluster, cfg.rollout, cfg.train.batch_groups // cfg.train.minibatches,
                    facts.meta_model(model_path), gpus, gpu_bytes, engine=engine)
    print(f"gpu plan{' on the cpu' if cfg.cluster.device == 'cpu' else ''}: {plan.layout.describe()}; "
          f"engine: {engine}")
    return plan


def _eval_spec(cfg, stop_ids: tuple):
    from runtime.setup import EvalSpec

    return EvalSpec(cfg.eval, cfg.reward, cfg.rollout.max_new_tokens, stop_ids, cfg.seed, cfg.rollout.dtype,
                    tuple(sorted(cfg.model.chat_template.items())), cfg.env)


def _evaluate_only(cfg, plan, model_path, run_dir, task) -> None:
    """`eval.only=true`: the model's accuracy on the test split, printed and written as metrics; no training.
    It generates on the plan's first engine: a built-in engine, or SGLang on the GPU plan."""
    import torch

    import tasks
    from evaluate import evaluate, longest_request

    tokenizer = tasks.load_tokenizer(model_path, cfg.model.chat_template)
    spec = _eval_spec(cfg, facts.stop_ids(model_path))
    # alone: every core
    torch.set_num_threads(cfg.cluster.threads_per_process or len(os.sched_getaffinity(0)))
    _print_notices()
    start = time.time()
    engine_spec = plan.engine(0, 64, longest_request(task, tokenizer, spec), cfg.rollout.dtype)
    with engine_spec.open(model_path, cfg.seed) as engine:
        results = evaluate(engine, tokenizer, task, spec)
    with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps({"step": 0, "time_s": round(time.time() - start, 3), **results}) + "\n")
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump({"status": "completed", "model": model_path, **results}, f, indent=2)
    print(" ".join(f"{k}={v:.4g}" for k, v in results.items()))


def _or_exit(fn, *args):
    """Run a set-up step whose failure is the user's to fix: one line on stderr, exit code 2."""
    try:
        return fn(*args)
    except (ValueError, OSError) as e:
        print(f"error: {str(e).strip().splitlines()[0]}", file=sys.stderr)
        sys.exit(2)


def _max_prompt_len(tokenizer, task, budget: int, long_prompts: str) -> int:
    """The ring's prompt width: the longest training prompt, or the budget if one is set and some exceed
    it."""
    import tasks

    lengths = [len(ids) for ids in tasks.first_prompts(tokenizer, task, task.train)]
    if not budget or budget >= max(lengths):
        return max(lengths)
    if long_prompts == "skip" and min(lengths) > budget:
        print(f"error: config key 'rollout.max_prompt_len' ({budget}) is below every training prompt "
              f"(shortest {min(lengths)} tokens); raise it or set rollout.long_prompts=truncate",
              file=sys.stderr)
        sys.exit(2)
    return budget


if __name__ == "__main__":
    import signal

    # SIGTERM shuts down like Ctrl-C; and Ctrl-C works even when started from a shell that ignores SIGINT for
    # background jobs (Python would otherwise keep the inherited "ignore").
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    if "--help" in sys.argv or "-h" in sys.argv:  # ours, not Hydra's: every key's default, meaning and range
        from launch.help import main as print_help

        sys.exit(print_help(sys.argv[1:]))
    resume = [a.partition("=")[2] for a in sys.argv[1:] if a.startswith("resume=")]
    if resume and resume[-1] and not any(a.startswith("hydra.run.dir=") for a in sys.argv[1:]):
        sys.argv.append(f"hydra.run.dir={resume[-1]}")  # a resumed run continues in its own directory
    try:
        check_overrides(sys.argv[1:])
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    register()
    try:
        hydra.main(version_base=None, config_path="conf", config_name="config")(main)()
        code = 0
    except SystemExit as e:  # our sys.exit(1 / 2 / 130), or Hydra's
        code = e.code if isinstance(e.code, int) else 0 if e.code is None else 1
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
    from launch.supervisor import fast_exit

    fast_exit(code)  # every process has stopped and every file is written: skip the 2 s interpreter teardown
