"""The learner loop: ring -> replay buffer -> batch -> optimizer step -> publish weights -> metrics."""
import os
import time
from contextlib import ExitStack, closing, nullcontext
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

import algos
from buffer.dynamic import DynamicSampling
from buffer.replay import ReplayBuffer
from buffer.staleness import too_old
from runtime.cores import Threads, follow_workers, step_runs_alone
from runtime.shared import EPISODE_COUNTERS, Shared
from trainer import row_metrics
from trainer.batch import Batch, batch_for
from trainer.checkpoint import save_checkpoint
from trainer.freeze import train_flops_per_token
from trainer.learner import Learner, Rank
from trainer.logger import MetricsLogger, truncate_metrics
from trainer.peak import Peak, learner_mfu, learner_peak
from trainer.policy import decoder_layers
from trainer.samples import SampleLog

if TYPE_CHECKING:
    from evaluate import Evaluator
    from runtime.schema import Config
    from runtime.setup import RunSetup



class Stopped(Exception):
    """The launcher asked everyone to stop."""


@dataclass(frozen=True)
class TrainerArgs:
    """One trainer rank process's arguments: built by the launcher (train.py), picklable, passed whole."""
    rank: Rank  # this rank, the world size, the rendezvous port and where it runs (its Placement)
    workers: int  # the plan's rollout workers: group ids interleave them
    cfg: "Config"  # the run's typed config (runtime/schema.py)
    # what the launcher settled: the model's folder, the run folder, a resumed checkpoint, ...
    setup: "RunSetup"
    evaluator: "Evaluator"  # how rank 0 evaluates the version it just published (the plan's)
    shared: Shared
    progress: bool = False  # this rank draws the console's progress bar
    # the matmul peak perf/learner_mfu divides by, measured by the launcher on a quiet CPU
    peak: Peak | None = None


def run(args: TrainerArgs) -> None:
    """One trainer rank: rank 0 feeds, logs, evaluates and checkpoints; every rank trains and publishes."""
    cfg, setup, rank, shared = args.cfg, args.setup, args.rank, args.shared
    torch.manual_seed(cfg.seed + rank.rank)
    rank.placement.init_process_group(rank.rank, rank.world_size, rank.port)
    lead = rank.rank == 0
    try:
        learner = Learner(rank=rank, model_path=setup.model_path, init_path=setup.resume_path,
                          train=cfg.train, algo=cfg.algo, rollout=cfg.rollout)
        # Now, not at the first publish: NCCL weight sync joins its process group here, and the engines wait
        # on it.
        publish = shared.weights.publisher(learner.policy, lead, shared.stop)
        with ExitStack() as stack:
            evaluate = samples = None
            if lead:
                import tasks

                data = tasks.get(cfg.task.name).build(cfg.task, cfg.seed)
                evaluate = stack.enter_context(args.evaluator.open(setup.model_path, shared.weights, data,
                                                                   setup.eval_spec))
                tokenizer = tasks.load_tokenizer(setup.model_path, cfg.model.chat_template)
                samples = stack.enter_context(closing(SampleLog(setup.run_dir, tokenizer, cfg.log_samples,
                                                                setup.resume_step)))
            replay = ReplayBuffer.from_config(cfg.buffer, _sampler(cfg.buffer.sampler, cfg.algo.name),
                                              cfg.seed)
            log = stack.enter_context(_logger(lead, args, setup.resume_step))
            _Loop(learner, publish, replay, evaluate, log, samples, args).run()
    except Stopped:
        pass
    finally:
        dist.destroy_process_group()


def _logger(lead: bool, args: TrainerArgs, start_step: int):
    """Rank 0's metrics logger, closed on the way out (a resumed run first drops rows past its checkpoint)."""
    if not lead:
        return nullcontext(None)
    run_dir = args.setup.run_dir
    truncate_metrics(os.path.join(run_dir, "metrics.jsonl"), start_step)
    return closing(MetricsLogger(run_dir, args.cfg.logger, args.cfg.steps, args.progress, args.setup.config,
                                 start_step))


class _Loop:
    """The optimizer steps of one rank, from `start_step` to `steps`; rank 0 also feeds, logs and
    evaluates."""

    def __init__(self, learner: Learner, publish, replay: ReplayBuffer, evaluate, log,
                 samples: SampleLog | None, args: TrainerArgs):
        cfg, setup = args.cfg, args.setup
        self.learner, self.publish, self.replay, self.shared = learner, publish, replay, args.shared
        self.evaluate, self.log, self.samples = evaluate, log, samples
        # rank 0: the step's fresh groups, a few of whose completions go to samples.jsonl
        self.fresh: list = []
        self.lead, self.steps = args.rank.rank == 0, cfg.steps
        self.model_path, self.run_dir = setup.model_path, setup.run_dir
        self.heart = args.shared.heart(f"trainer-{args.rank.rank}")
        self.max_staleness, self.batch_groups, self.workers = (cfg.max_staleness, cfg.train.batch_groups,
                                                               args.workers)
        self.eval_every, self.checkpoint_cfg, self.start_step = (cfg.eval.every, cfg.checkpoint,
                                                                 setup.resume_step)
        self.multi_turn = setup.multi_turn
        drops = int(cfg.buffer.dynamic_max_drops * self.batch_groups)
        self.dynamic = DynamicSampling(cfg.buffer.dynamic_sampling, drops)  # rank 0's
        self.last_episodes = (0, 0)  # rank 0: (episodes, successes) counted at the last row
        # next_group[w]: one past the newest group index received from worker w (a resumed worker starts
        # there)
        self.next_group: dict[int, int] = {}
        elapsed = 0.0
        if self.start_step:
            elapsed = self._restore(setup.resume_path)
        self.saved = self.start_step  # the newest checkpoint's step
        self.threads = Threads()
        cores = self.shared.cores
        # a compiled stack takes no hooks
        if cores is not None and cores.moves_in_step and not cfg.train.compile:
            follow_workers(decoder_layers(learner.policy.lm), cores, self.threads)
        # rank 0's row: the step's model FLOPs utilisation against a matmul peak; a GPU's measured here,
        # before the clock, a CPU's by the launcher before any process computed (measured here it would share
        # the cores)
        self.flops_per_token = train_flops_per_token(learner.policy.lm)
        self.peak = (args.peak or learner_peak(learner.device, learner.train.autocast,
                                               torch.get_num_threads())) \
            if self.lead else None
        self.start = time.time() - elapsed
        self.last_row = (self.start, 0)  # rank 0: (time, tokens generated so far) at the last row

    def run(self) -> None:
        """One step, version v to v + 1: the data, the learner's step, the weights out, rank 0's row, a
        checkpoint (docs/design.md, "One step of the learner")."""
        for step in range(self.start_step + 1, self.steps + 1):
            batch, info, perf = self._next_batch(step)
            self.threads.set(perf["perf/train_threads"])
            phase = "first_step" if step == self.start_step + 1 else "train_step"  # the first may compile
            self.learner.beat = lambda: self.heart.beat(phase)
            t0 = time.time()
            self.threads.mark()
            metrics = self.learner.step(batch, step)
            perf["perf/train_step_s"] = time.time() - t0
            # time-weighted: a shared step follows the workers
            perf["perf/train_threads"] = self.threads.mean()
            self.heart.beat("publish")
            t0 = time.time()
            self.learner.publish(self.publish, step)
            perf["perf/publish_s"] = time.time() - t0
            if self.shared.cores is not None:
                self.threads.set(self.shared.cores.trainer_after_step())
            if self.lead:  # the row before the checkpoint: a run resumed from step N has every row up to N
                self._end_step(step, batch, info, metrics, perf)
            every, at_end = self.checkpoint_cfg.every, self.checkpoint_cfg.at_end
            if (step == self.steps and at_end) or (every and step % every == 0):
                self.save(step)
        self.heart.beat("done")

    def _next_batch(self, step: int) -> tuple[Batch, dict, dict]:
        """Every rank's batch for `step`, with rank 0's description of its data and the step's perf figures so
        far. Rank 0 waits for fresh groups, drops those too old, samples the replay buffer and packs; the
        others wait for its word. When the launcher asks to stop, every rank checkpoints what it learned since
        the last checkpoint and raises Stopped."""
        version = step - 1
        payload = None  # stays None on rank 0 when the launcher asks to stop: every rank then checkpoints
        if self.lead:
            t0 = time.time()
            try:
                if self.shared.cores is not None:
                    self.shared.cores.trainer_waiting()
                fresh, dropped = self._take_fresh(version)
                self.fresh = fresh
                wait_time = time.time() - t0
                groups = self.replay.sample(self.batch_groups, version)
                batch = batch_for(groups, self.learner.loss_fn)
                # reward describes the fresh data (the current policy's, tied groups dropped by dynamic
                # sampling included); staleness what is trained on
                rewards = torch.cat([g.rewards for g in fresh + self.dynamic.dropped])
                info = {"reward_mean": rewards.mean().item(),
                        "reward/batch_mean": torch.cat([g.rewards for g in groups]).mean().item(),
                        "staleness/dropped_groups": len(dropped),
                        **row_metrics.kept_and_dropped(fresh, dropped),
                        **self.replay.stats(), **row_metrics.staleness(groups, fresh, version),
                        **self.dynamic.metrics(), **(row_metrics.episodes(fresh) if self.multi_turn else {})}
                payload = (batch, info, {"perf/wait_s": wait_time,
                                         "perf/train_threads": self._step_threads()})
            except Stopped:
                pass
            self.heart.post_step(step)
        else:
            self._wait_for_rank0(step)
        self.heart.beat("collective")
        payload = _broadcast(payload)
        if payload is None:
            if version > self.saved:  # Ctrl-C / SIGTERM: keep what was learned since the last checkpoint
                self.save(version)
            raise Stopped
        return payload

    def _end_step(self, step: int, batch: Batch, info: dict, metrics: dict, perf: dict) -> None:
        """Rank 0, the new weights published: evaluate when due, open the gate to version `step`, log the
        row."""
        results = {}
        evaluating = step == self.steps or (self.eval_every and step % self.eval_every == 0)
        # Synchronous: evaluate before generation may start, on every core; asynchronous: beside it.
        if evaluating and self.max_staleness == 0:
            results = self._evaluate(step)
        self.shared.gate.set_version(step)  # after publishing: new groups must start on the new weights
        if evaluating and self.max_staleness > 0:
            results = self._evaluate(step)
        # After the last step the workers stop and none is restarted; the row counts every restart.
        shared = self.shared
        counts = (shared.finish.set(lambda: row_metrics.worker_counts(shared)) if step == self.steps
                  else row_metrics.worker_counts(shared))
        if self.multi_turn:
            counts.update(self._episode_counts())
        now, tokens = time.time(), counts.pop("tokens")
        last_time, last_tokens = self.last_row
        train_time = perf["perf/train_step_s"]
        threads = perf["perf/train_threads"] if self.learner.device.type == "cpu" else 1
        computed = metrics["train/tokens"] - metrics["train/shared_prefix_tokens"]
        mfu = learner_mfu(self.flops_per_token, computed, train_time, self.peak, threads,
                          self.learner.rank.world_size)
        self.log.log({
            "step": step, "time_s": round(now - self.start, 3),
            "reward_mean": info.pop("reward_mean"), "loss": metrics.pop("loss"),
            "staleness_mean": info.pop("staleness_mean"), "staleness_max": info.pop("staleness_max"),
            "gen_tokens_per_s": (tokens - last_tokens) / max(now - last_time, 1e-9),
            "train_tokens_per_s": metrics.pop("train/tokens") / max(train_time, 1e-9),
            "perf/train_step_s": train_time, "perf/learner_mfu": mfu, "perf/wait_s": perf["perf/wait_s"],
            "perf/train_threads": perf["perf/train_threads"], "perf/publish_s": perf["perf/publish_s"],
            **row_metrics.peak_memory(self.learner.device),
            "perf/completion_len": batch.lens.float().mean().item(),
            **counts, **info, **metrics, **results,
        })
        self.samples.write(step, self.fresh)
        self.last_row = (now, tokens)

    def _episode_counts(self) -> dict:
        """The workers' episode counters (episode/<name>, totals so far), the success rate of the episodes
        ended since the last row, and the share of an episode's time spent waiting for its environment."""
        total = self.shared.counters.total
        out = {f"episode/{name}": total(name) for name in EPISODE_COUNTERS}
        episodes, successes = total("episodes"), total("successes")
        last_episodes, last_successes = self.last_episodes
        if episodes > last_episodes:
            out["episode/success_rate"] = (successes - last_successes) / (episodes - last_episodes)
        self.last_episodes = (episodes, successes)
        waited = total("model_ms") + total("env_ms")
        out["episode/env_time_frac"] = total("env_ms") / waited if waited else 0.0
        return out

    def _evaluate(self, step: int) -> dict:
        self.heart.beat("evaluate")
        t_eval = time.time()
        results = self.evaluate(step, self.shared.stop)
        results["perf/eval_s"] = time.time() - t_eval  # training waits for it
        return results

    def _wait_for_rank0(self, step: int) -> None:
        """Ranks > 0: rank 0 may take minutes (waiting for data, evaluating) before it broadcasts `step`'s
        batch. Wait for its word here, beating, so that the collective itself never waits long and a rank
        stuck in one is told apart from a rank waiting its turn."""
        hearts = self.shared.hearts
        while hearts is not None and hearts.step("trainer-0") < step:
            if self.shared.stop.is_set():
                raise Stopped
            self.heart.beat("wait_rank0")
            time.sleep(0.01)

    def _step_threads(self) -> int:
        """Rank 0, the batch in hand: each rank's thread count for this step (runtime/cores.py)."""
        shared = self.shared
        if shared.cores is None:
            return torch.get_num_threads()
        in_flight = shared.counters.total("started") - shared.counters.total("groups")
        return shared.cores.trainer_step(step_runs_alone(shared.gate.exhausted(), in_flight))

    def save(self, step: int) -> None:
        self.heart.beat("checkpoint")
        self.saved = step
        state = {"step": step, "time_s": time.time() - self.start, "next_group": self.next_group,
                 "optimizer": self.learner.optimizer_state(), "skipped": self.learner.skipped,
                 "replay": self.replay.state_dict() if self.lead else None,
                 "torch_rng": torch.get_rng_state()}
        save_checkpoint(self.learner.policy, self.model_path, self.run_dir, step, state,
                        self.checkpoint_cfg.keep)

    def _restore(self, init_path: str) -> float:
        """Continue from checkpoints/step_{start_step}: optimizer, replay buffer, RNG, data positions. Returns
        the run's time so far."""
        from trainer.checkpoint import load_state

        state = load_state(init_path)
        assert state["step"] == self.start_step, (state["step"], self.start_step)
        self.learner.load_optimizer_state(state["optimizer"] if self.lead else {})
        self.learner.skipped = state["skipped"]
        if state["replay"] is not None:
            self.replay.load_state_dict(state["replay"])
        torch.set_rng_state(state["torch_rng"])
        self.next_group = dict(state["next_group"])
        return state["time_s"]

    def _take_fresh(self, version: int):
        """Move B fresh groups from the ring into the buffer; groups too old to train on, and under dynamic
        sampling groups whose rewards all tie, are dropped (their budget goes back to the gate). Returns the
        groups taken and those dropped for staleness."""
        shared, taken, dropped, start = self.shared, [], [], time.monotonic()
        self.dynamic.new_step()
        while len(taken) < self.batch_groups:
            self.heart.beat("wait_data")
            group = shared.ring.get(timeout=0.5)
            if group is None:
                if shared.stop.is_set():
                    raise Stopped
                self.log.waiting(time.monotonic() - start, len(taken), self.batch_groups)
                continue
            index = group.group_id // self.workers
            self.next_group[group.worker_id] = max(self.next_group.get(group.worker_id, 0), index + 1)
            if too_old(group, version, self.max_staleness):
                dropped.append(group)
                shared.gate.cancel(1)
                continue
            if self.dynamic.drops(group):
                shared.gate.cancel(1)  # a worker generates one more in its place, within the same bound
                continue
            self.replay.add(group, version)
            taken.append(group)
        self.replay.expire_fresh(version, self.max_staleness)
        return taken, dropped


def _sampler(choice: str, algo: str) -> str:
    """`buffer.sampler=auto` takes the loss's own preference (TB replays; the policy-gradient rules do
    not)."""
    return getattr(algos.get(algo).Loss, "sampler", "fifo") if choice == "auto" else choice


def _broadcast(value):
    if dist.get_world_size() == 1:
        return value
    box = [value]
    dist.broadcast_object_list(box, src=0)
    return box[0]
