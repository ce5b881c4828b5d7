"""ringrl: asynchronous RL post-training of language models on one machine.

    python train.py                               # Trajectory Balance, arithmetic task, SmolLM2-135M, on the CPU
    python train.py max_staleness=0               # the synchronous baseline of the same code
    python train.py -m max_staleness=0,1,2,4      # a sweep, one run after another
    python train.py model.path=<HF dir or hub id> steps=100 train.lr=1e-5
    python train.py resume=outputs/<date>/<time>  # continue a run from its latest checkpoint
    python train.py algo=tb task=gsm8k cluster=gpu8 model.path=Qwen/Qwen2.5-1.5B-Instruct  # 8 GPUs (docs/gpu.md)
    python plot.py multirun/<date>/<time>         # a sweep side by side: sweep.png and a table

Rollout workers generate while trainer ranks learn; trajectories cross through a shared-memory ring,
weights come back after every optimizer step, and `max_staleness` bounds how old the data may be.
Outputs go to the Hydra run directory: config.yaml, metrics.jsonl, curves.png, checkpoints/step_N/,
summary.json.
"""
import dataclasses
import json
import os
import sys
import time

import hydra
from hydra.core.hydra_config import HydraConfig
from omegaconf import OmegaConf

from launch.config import Config, build, check_overrides


def main(raw) -> None:
    if raw.resume:
        from launch.resume import resumed_config

        raw = _or_exit(resumed_config, raw, HydraConfig.get().overrides.task)
    cfg, algo_cfg, task_cfg = _parse(raw)
    run_dir = HydraConfig.get().runtime.output_dir
    from trainer.logger import check_backend

    _or_exit(check_backend, cfg.logger)
    from launch.resume import resume_point

    resume = _or_exit(resume_point, run_dir) if cfg.resume else None
    with open(os.path.join(run_dir, "config.yaml"), "w") as f:
        f.write(OmegaConf.to_yaml(OmegaConf.to_container(raw, resolve=True)))

    from launch.plan import device_plan, pin_threads

    # Heavy imports after the config is known to be good: a typo should fail in a second.
    import torch

    plan_name = _or_exit(device_plan, cfg.cluster.plan, torch.cuda.device_count())
    pin_threads(cfg.cluster.threads_per_process)

    torch.set_num_threads(cfg.cluster.threads_per_process)
    from models.loader import resolve

    model_path = _or_exit(resolve, cfg.model.path)
    plan = _or_exit(_plan, plan_name, cfg, model_path)
    if cfg.eval.only:
        return _evaluate_only(cfg, task_cfg, plan, model_path, run_dir)
    error = run(cfg, algo_cfg, task_cfg, plan, model_path, run_dir, resume, OmegaConf.to_container(raw, resolve=True))
    if error:
        print(f"error: {error}", file=sys.stderr)
        sys.exit(130 if error == "interrupted" else 1)
    print(f"done: {run_dir}")


def run(cfg, algo_cfg, task_cfg, plan, model_path: str, run_dir: str, resume: dict | None, config: dict) -> str | None:
    """Rollout workers and trainer ranks as `plan` says, until the last step; the error that ended it, or None."""
    import torch

    import tasks
    from buffer.ring import TrajectoryRing
    from buffer.staleness import StalenessGate
    from launch.plan import free_port
    from launch.summary import draw_curves, write_summary
    from launch.supervisor import Supervisor
    from rollout import NEXT_GROUP, RESTARTS, STAT_COLUMNS, reclaim_worker
    from rollout import run as run_worker
    from trainer.loop import run as run_learner

    task = _or_exit(tasks.get(task_cfg.name).build, task_cfg, cfg.seed)
    max_prompt_len = _max_prompt_len(model_path, task, cfg.rollout.max_prompt_len, cfg.rollout.long_prompts)
    rollout, train, cluster = cfg.rollout, cfg.train, cfg.cluster
    workers = plan.rollout_workers

    # Every shared object exists before the first spawn; children receive them as arguments.
    # Each worker owns a lane of slots; one lane can hold every group the staleness bound lets it start.
    lane = (cfg.max_staleness + 1) * train.batch_groups + 1
    ring = TrajectoryRing(workers * lane, rollout.group_size, max_prompt_len, rollout.max_new_tokens,
                          num_producers=workers)
    gate = StalenessGate(train.batch_groups, cfg.max_staleness, version=resume["step"] if resume else 0)
    weights = plan.weights(_meta_model(model_path))
    evals = plan.evals()  # None: rank 0 evaluates with a CPU engine of its own
    gen_stats = torch.zeros(workers, len(STAT_COLUMNS), dtype=torch.long).share_memory_()

    sup = Supervisor()
    shared = (ring, gate, weights, gen_stats, sup.stop)
    port = free_port()
    start = time.time()
    error = None
    engine_len = max_prompt_len + rollout.max_new_tokens
    eval_spec = _eval_spec(cfg, model_path)
    engines = [plan.engine(w, rollout.max_batch, engine_len, rollout.dtype) for w in range(workers)]
    worker_specs = [_worker_spec(cfg, task_cfg, w, workers, engine, model_path, max_prompt_len, resume, evals,
                                 eval_spec) for w, engine in enumerate(engines)]

    def restart_worker(name: str, message: str) -> bool:
        """A rollout worker died: free what it held and start a new one where it stopped, up to max_restarts."""
        if not name.startswith("rollout-"):
            return False
        w = int(name.split("-")[1])
        if gen_stats[w, RESTARTS] >= plan.max_restarts:
            return False
        lost = reclaim_worker(ring, gate, gen_stats, w)
        print(f"warning: {message.splitlines()[0]}; restarting it ({int(gen_stats[w, RESTARTS])}/"
              f"{plan.max_restarts}), {lost} unfinished groups dropped", file=sys.stderr)
        spec = dataclasses.replace(worker_specs[w], first_group=int(gen_stats[w, NEXT_GROUP]))
        sup.start(name, run_worker, (spec, *shared), cluster.threads_per_process)
        return True

    try:
        for w, spec in enumerate(worker_specs):
            sup.start(f"rollout-{w}", run_worker, (spec, *shared), cluster.threads_per_process)
        plan.wait_for_engines(weights, sup)
        for r in range(plan.trainer_ranks):
            spec = _learner_spec(cfg, algo_cfg, task_cfg, r, plan, port, model_path, run_dir, eval_spec, evals,
                                 resume, config)
            sup.start(f"trainer-{r}", run_learner, (spec, *shared), cluster.threads_per_process, essential=True)
        error = sup.watch(on_failure=restart_worker)
    except KeyboardInterrupt:
        error = "interrupted"
    finally:
        sup.shutdown()
        write_summary(run_dir, start, error, sup.peak_mb)
        draw_curves(run_dir)
    return error


def _plan(name: str, cfg, model_path: str):
    """The plan's pieces: launch.plan.CPUPlan, or launch.gpu.GPUPlan laid out for these GPUs and this model."""
    from launch.plan import CPUPlan

    if name == "cpu":
        return CPUPlan(cfg.cluster.rollout_workers, cfg.cluster.trainer_ranks, cfg.cluster.max_restarts)
    import torch

    from launch.gpu import gpu_plan

    plan = gpu_plan(cfg.cluster, cfg.train.batch_groups, _meta_model(model_path), torch.cuda.device_count(),
                    torch.cuda.get_device_properties(0).total_memory)
    print(f"gpu plan: {plan.layout.describe()}")
    return plan


def _worker_spec(cfg, task_cfg, worker: int, workers: int, engine, model_path: str, max_prompt_len: int,
                 resume: dict | None, evals, eval_spec):
    from engines.cpu import SamplingParams
    from rollout import WorkerSpec

    r = cfg.rollout
    sampling = SamplingParams(r.temperature, r.top_p, r.max_new_tokens, _stop_ids(model_path))
    return WorkerSpec(worker, workers, cfg.seed, model_path, task_cfg.name, task_cfg, r.group_size, engine, sampling,
                      cfg.reward.workers, cfg.reward.timeout_s, resume["path"] if resume else "",
                      resume["step"] if resume else 0, resume["next_group"].get(worker, 0) if resume else 0,
                      max_prompt_len, r.long_prompts, evals, eval_spec)


def _learner_spec(cfg, algo_cfg, task_cfg, rank: int, plan, port: int, model_path: str, run_dir: str, eval_spec,
                  evals, resume: dict | None, config: dict):
    from trainer.learner import LearnerSpec

    train, buffer = cfg.train, cfg.buffer
    return LearnerSpec(
        rank=rank, world_size=plan.trainer_ranks, port=port, model_path=model_path, run_dir=run_dir,
        steps=cfg.steps, seed=cfg.seed, max_staleness=cfg.max_staleness, batch_groups=train.batch_groups,
        micro_groups=train.micro_groups, micro_tokens=train.micro_tokens, group_size=cfg.rollout.group_size,
        max_new_tokens=cfg.rollout.max_new_tokens, temperature=cfg.rollout.temperature, lr=train.lr,
        weight_decay=train.weight_decay, grad_clip=train.grad_clip, autocast=train.autocast == "bfloat16",
        compile=train.compile,
        algo=algo_cfg.name, algo_cfg=algo_cfg, checkpoint_every=cfg.checkpoint.every,
        progress=cfg.progress and rank == 0, sampler=_sampler(buffer.sampler, algo_cfg.name),
        recent_prob=buffer.recent_prob, inv_temp=buffer.inv_temp, per_prompt_capacity=buffer.per_prompt_capacity,
        task=task_cfg.name, task_cfg=task_cfg, eval_every=cfg.eval.every, eval=eval_spec, evals=evals,
        num_workers=plan.rollout_workers, init_path=resume["path"] if resume else "",
        start_step=resume["step"] if resume else 0, checkpoint_keep=cfg.checkpoint.keep, logger=cfg.logger,
        config=config, placement=plan.placement(rank))


def _eval_spec(cfg, model_path: str):
    from evaluate import EvalSpec

    e = cfg.eval
    return EvalSpec(e.k, e.temperature, cfg.rollout.max_new_tokens, e.max_examples, _stop_ids(model_path), cfg.seed,
                    cfg.reward.workers, cfg.reward.timeout_s, cfg.rollout.dtype)


def _evaluate_only(cfg, task_cfg, plan, model_path, run_dir) -> None:
    """`eval.only=true`: the model's accuracy on the test split, printed and written as metrics; no training.
    It generates on the plan's first engine: a CPU engine, or SGLang on the GPU plan."""
    from transformers import AutoTokenizer

    import tasks
    from evaluate import evaluate, longest_request

    task = _or_exit(tasks.get(task_cfg.name).build, task_cfg, cfg.seed)
    tokenizer = AutoTokenizer.from_pretrained(model_path)
    spec = _eval_spec(cfg, model_path)
    start = time.time()
    engine_spec = plan.engine(0, 64, longest_request(task, tokenizer, spec), cfg.rollout.dtype)
    with engine_spec.open(model_path, cfg.seed) as engine:
        results = evaluate(engine, tokenizer, task, spec)
    with open(os.path.join(run_dir, "metrics.jsonl"), "a") as f:
        f.write(json.dumps({"step": 0, "time_s": round(time.time() - start, 3), **results}) + "\n")
    with open(os.path.join(run_dir, "summary.json"), "w") as f:
        json.dump({"status": "completed", "model": model_path, **results}, f, indent=2)
    print(" ".join(f"{k}={v:.4g}" for k, v in results.items()))


def _parse(raw):
    """Typed config from Hydra's dict; the algo and task sections are checked by their own modules."""
    import algos
    import tasks

    data = OmegaConf.to_container(raw, resolve=True)
    try:
        cfg = build(Config, data)
        algo_cfg = build(algos.get(cfg.algo.get("name", "")).Config, cfg.algo, "algo.")
        task_cfg = build(tasks.get(cfg.task.get("name", "")).Config, cfg.task, "task.")
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    return cfg, algo_cfg, task_cfg


def _sampler(choice: str, algo: str) -> str:
    """`buffer.sampler=auto` takes the loss's own preference (TB replays; the policy-gradient rules do not)."""
    import algos

    return getattr(algos.get(algo).Loss, "sampler", "fifo") if choice == "auto" else choice


def _or_exit(fn, *args):
    """Run a set-up step whose failure is the user's to fix: one line on stderr, exit code 2."""
    try:
        return fn(*args)
    except (ValueError, OSError) as e:
        print(f"error: {str(e).strip().splitlines()[0]}", file=sys.stderr)
        sys.exit(2)


def _max_prompt_len(model_path, task, budget: int, long_prompts: str) -> int:
    """The ring's prompt width: the longest training prompt, or the budget if one is set and some exceed it."""
    import tasks
    from transformers import AutoTokenizer

    tokenizer = _or_exit(AutoTokenizer.from_pretrained, model_path)
    lengths = [len(tasks.prompt_ids(tokenizer, ex.question)) for ex in task.train]
    if not budget or budget >= max(lengths):
        return max(lengths)
    if long_prompts == "skip" and min(lengths) > budget:
        print(f"error: config key 'rollout.max_prompt_len' ({budget}) is below every training prompt (shortest "
              f"{min(lengths)} tokens); raise it or set rollout.long_prompts=truncate", file=sys.stderr)
        sys.exit(2)
    return budget


def _stop_ids(model_path) -> tuple:
    from transformers import AutoConfig, AutoTokenizer

    eos = AutoConfig.from_pretrained(model_path).eos_token_id
    ids = set(eos if isinstance(eos, list) else [eos]) - {None}
    ids.add(AutoTokenizer.from_pretrained(model_path).eos_token_id)
    return tuple(sorted(i for i in ids if i is not None))


def _meta_model(model_path):
    """The model's parameter names and shapes without loading its weights."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(model_path))


if __name__ == "__main__":
    import signal

    # SIGTERM shuts down like Ctrl-C; and Ctrl-C works even when started from a shell that ignores SIGINT for
    # background jobs (Python would otherwise keep the inherited "ignore").
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    signal.signal(signal.SIGINT, signal.default_int_handler)
    resume = [a.partition("=")[2] for a in sys.argv[1:] if a.startswith("resume=")]
    if resume and resume[-1] and not any(a.startswith("hydra.run.dir=") for a in sys.argv[1:]):
        sys.argv.append(f"hydra.run.dir={resume[-1]}")  # a resumed run continues in its own directory
    try:
        check_overrides([a for a in sys.argv[1:]])
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)
    hydra.main(version_base=None, config_path="conf", config_name="config")(main)()
