"""The learner loop: ring -> replay buffer -> batch -> optimizer step -> publish weights -> metrics."""
import os
import time

import torch
import torch.distributed as dist

from buffer.replay import ReplayBuffer
from rollout import (LOST_GROUPS, PROMPTS_SKIPPED, PROMPTS_TRUNCATED, RESTARTS, REWARD_ERRORS, REWARD_TIMEOUTS,
                     STAT_COLUMNS, TOKENS)
from trainer.batch import pack
from trainer.checkpoint import save_checkpoint
from trainer.learner import Learner, LearnerSpec
from trainer.logger import MetricsLogger, truncate_metrics


class Stopped(Exception):
    """The launcher asked everyone to stop."""


def run(spec: LearnerSpec, ring, gate, weights, gen_stats, stop) -> None:
    """One trainer rank. `weights` is the plan's weight path: a WeightStore (CPU) or a GPUWeights."""
    torch.manual_seed(spec.seed + spec.rank)
    spec.placement.init_process_group(spec.rank, spec.world_size, spec.port)
    try:
        _loop(spec, ring, gate, weights, gen_stats, stop)
    except Stopped:
        pass
    finally:
        dist.destroy_process_group()


def _loop(spec, ring, gate, weights, gen_stats, stop):
    lead = spec.rank == 0
    learner = Learner(spec)
    publish = weights.publisher(learner.policy, lead, stop)
    evaluator = _evaluator(spec) if lead and spec.eval is not None else None
    replay = ReplayBuffer(spec.sampler, spec.recent_prob, spec.inv_temp, spec.per_prompt_capacity, spec.seed)
    # next_group[w]: one past the newest group index received from worker w (a resumed worker starts there)
    progress = {"next_group": {}, "time_s": 0.0}
    if spec.start_step:
        progress = _restore(spec, learner, replay)
    logger = None
    if lead:
        truncate_metrics(os.path.join(spec.run_dir, "metrics.jsonl"), spec.start_step)
        logger = MetricsLogger(spec.run_dir, spec.logger, spec.steps, spec.progress, spec.config, spec.start_step)
    start = last_time = time.time() - progress["time_s"]
    last_tokens = 0

    saved = [spec.start_step]

    def checkpoint(step):
        saved[0] = step
        state = {"step": step, "time_s": time.time() - start, "next_group": progress["next_group"],
                 "optimizer": learner.optimizer_state(), "skipped": learner.skipped,
                 "replay": replay.state_dict() if lead else None, "torch_rng": torch.get_rng_state()}
        save_checkpoint(learner.policy, spec.model_path, spec.run_dir, step, state, spec.checkpoint_keep)

    try:
        for step in range(spec.start_step + 1, spec.steps + 1):
            version = step - 1
            payload = None  # stays None on rank 0 when the launcher asks to stop: every rank then checkpoints
            if lead:
                t0 = time.time()
                try:
                    fresh, dropped = _take_fresh(ring, gate, replay, spec, version, stop, progress["next_group"])
                    wait_time = time.time() - t0
                    batch = pack(replay.sample(spec.batch_groups, version))
                    # reward and staleness describe the fresh data (the current policy's); replay has its own
                    info = {"reward_mean": torch.cat([g.rewards for g in fresh]).mean().item(),
                            "staleness/dropped_groups": dropped, **replay.stats(), **_staleness(fresh, version)}
                    payload = (batch, info)
                except Stopped:
                    pass
            payload = _broadcast(payload)
            if payload is None:
                if version > saved[0]:  # Ctrl-C / SIGTERM: keep what was learned since the last checkpoint
                    checkpoint(version)
                raise Stopped
            batch, info = payload
            t0 = time.time()
            metrics = learner.step(batch, step)
            train_time = time.time() - t0
            due = evaluator is not None and (step == spec.steps or (spec.eval_every and step % spec.eval_every == 0))
            learner.publish(publish, step, into=evaluator.targets if due else None)
            if lead:  # the row before the checkpoint: a run resumed from step N has every row up to N
                gate.set_version(step)  # after publishing: new groups must start on the new weights
                results = {}
                if due:
                    t_eval = time.time()
                    results = evaluator(step, stop)
                    results["perf/eval_s"] = time.time() - t_eval  # training waits for it
                now, tokens = time.time(), int(gen_stats[:, TOKENS].sum())
                logger.log({
                    "step": step, "time_s": round(now - start, 3),
                    "reward_mean": info.pop("reward_mean"), "loss": metrics.pop("loss"),
                    "staleness_mean": info.pop("staleness_mean"), "staleness_max": info.pop("staleness_max"),
                    "gen_tokens_per_s": (tokens - last_tokens) / max(now - last_time, 1e-9),
                    "train_tokens_per_s": metrics.pop("train/tokens") / max(train_time, 1e-9),
                    "reward/batch_mean": batch.rewards.mean().item(),
                    "reward/timeouts": int(gen_stats[:, REWARD_TIMEOUTS].sum()),
                    "reward/errors": int(gen_stats[:, REWARD_ERRORS].sum()),
                    "perf/train_step_s": train_time, "perf/wait_s": wait_time,
                    "perf/completion_len": batch.mask.sum(1).mean().item(),
                    **_worker_counters(gen_stats),
                    **info, **metrics, **results,
                })
                last_tokens, last_time = tokens, now
            if step == spec.steps or (spec.checkpoint_every and step % spec.checkpoint_every == 0):
                checkpoint(step)
    finally:
        if logger is not None:
            logger.close()


def _restore(spec, learner, replay) -> dict:
    """Continue from checkpoints/step_{start_step}: optimizer, replay buffer, RNG, data positions."""
    from trainer.checkpoint import load_state

    state = load_state(spec.init_path)
    assert state["step"] == spec.start_step, (state["step"], spec.start_step)
    learner.load_optimizer_state(state["optimizer"] if spec.rank == 0 else {})
    learner.skipped = state["skipped"]
    if state["replay"] is not None:
        replay.load_state_dict(state["replay"])
    torch.set_rng_state(state["torch_rng"])
    return {"next_group": dict(state["next_group"]), "time_s": state["time_s"]}


def _evaluator(spec):
    """Rank 0's evaluation of the weights it just published, called as evaluator(version, stop). On the GPU
    plan the rollout workers' engines generate it (evaluate.EvalChannel); on the CPU plan a CPU engine of rank
    0's own (evaluate.Evaluator), whose weights `Learner.publish` copies into `evaluator.targets` on the way."""
    if spec.evals is not None:
        return spec.evals
    import tasks
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from evaluate import Evaluator

    task = tasks.get(spec.task).build(spec.task_cfg, spec.seed)
    model = AutoModelForCausalLM.from_pretrained(spec.model_path, dtype=torch.float32)
    # The engine keeps its own copy of the weights; the Hugging Face model is dropped.
    return Evaluator(model, AutoTokenizer.from_pretrained(spec.model_path), task, spec.eval)


def _take_fresh(ring, gate, replay, spec, version, stop, next_group):
    """Move B fresh groups from the ring into the buffer; groups more than eta versions old are dropped
    (their budget goes back to the gate). Returns the groups taken and how many were dropped."""
    taken, dropped = [], 0
    while len(taken) < spec.batch_groups:
        group = ring.get(timeout=0.5)
        if group is None:
            if stop.is_set():
                raise Stopped
            continue
        index = group.group_id // spec.num_workers
        next_group[group.worker_id] = max(next_group.get(group.worker_id, 0), index + 1)
        if version - group.min_version() > spec.max_staleness:
            dropped += 1
            gate.cancel(1)
            continue
        replay.add(group, version)
        taken.append(group)
    replay.expire_fresh(version, spec.max_staleness)
    return taken, dropped


def _worker_counters(gen_stats) -> dict:
    """Restarts, groups lost with a dead worker, and prompts over the length budget, summed over workers."""
    totals = gen_stats.sum(0)
    return {f"rollout/{STAT_COLUMNS[c]}": int(totals[c])
            for c in (RESTARTS, LOST_GROUPS, PROMPTS_TRUNCATED, PROMPTS_SKIPPED)}


def _staleness(fresh: list, version: int) -> dict:
    """Policy-version lag of the fresh (not replayed) groups in the batch."""
    lags = [version - g.min_version() for g in fresh] or [0]
    return {"staleness_mean": sum(lags) / len(lags), "staleness_max": max(lags)}


def _broadcast(value):
    if dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
