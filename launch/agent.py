"""A generator node of a cluster=ray run: the agent, one Ray actor per node, runs the node's rollout workers
as train.py runs them on one machine (a supervisor, a local ring, a weight store, heartbeats and restarts),
and answers the trainer node's calls (launch/ray_nodes.py):

    agent.exchange(grant, room)     # starts leased from the trainer's gate in; up to `room` finished
                                      groups out
    agent.receive_weights(version)  # this node's part of the trainer node's gloo broadcast, into its store
    agent.stop()                    # the run is over: the workers stop and the supervisor shuts them down

Nothing here imports Ray: the trainer node makes this class an actor. Its rollout workers keep their global
ids (lanes of the trainer node's ring, group ids), and start groups only out of the starts the trainer node
leased to this node (buffer/staleness.py LeaseGate), so the staleness bound stays exact across nodes.
"""
import sys
import threading
from dataclasses import dataclass
from datetime import timedelta

import torch

from buffer.ring import TrajectoryRing
from buffer.staleness import LeaseGate
from launch.supervisor import Supervisor
from runtime.heartbeat import Allowance, Heartbeats
from runtime.shared import Shared, WorkerCounters


@dataclass(frozen=True)
class NodeRun:
    """What every generator node gets alike: the run as the trainer node settled it."""
    workers: int  # every node's rollout workers together: the ring's lanes, the group ids' stride
    cfg: object  # the run's typed config
    setup: object  # runtime.setup.RunSetup
    plan: object  # the nodes' launch.plan.CPUPlan: the weight store
    engine: object  # each worker's engine spec
    evaluator: object  # the plan's evaluator (generator nodes take no part in evaluation)
    lane_slots: int  # ring slots per worker, as on the trainer node
    max_prompt_len: int
    stacks_dir: str  # where stuck workers' stacks go (on the node)


@dataclass(frozen=True)
class NodeArgs:
    """One generator node's agent's arguments."""
    node: int  # this node's index in cluster.ray.nodes
    worker_ids: tuple[int, ...]  # its rollout workers' global ids
    # where each starts (resumed, or a restarted agent: past what was delivered)
    first_groups: tuple[int, ...]
    threads: int  # torch threads per rollout worker
    run: NodeRun
    counters: torch.Tensor | None = None  # its workers' counters so far (a restarted agent goes on from them)


@dataclass
class Exchange:
    """A generator node's answer to `exchange`."""
    groups: list  # finished groups (buffer.ring.Group), oldest first
    counters: torch.Tensor  # its workers' rows of runtime.shared.WorkerCounters
    unused: int  # leased starts not used yet
    error: str | None  # the supervisor's one-line failure, once the node's workers cannot go on


class GeneratorAgent:
    def __init__(self, args: NodeArgs):
        from models import facts
        from rollout import RolloutArgs
        from rollout import run as run_worker

        self.args, run, cfg = args, args.run, args.run.cfg
        c = cfg.cluster
        torch.set_num_threads(1)  # the agent only moves groups and weights; the cores are the workers'
        names = [f"rollout-{w}" for w in args.worker_ids]
        hearts = Heartbeats(names)
        self.sup = Supervisor(run.stacks_dir, hearts, Allowance(c.hang_timeout_s, c.slow_timeout_s,
                                                                 c.start_timeout_s))
        ring = TrajectoryRing(run.workers * run.lane_slots, cfg.rollout.group_size, run.max_prompt_len,
                              cfg.rollout.max_new_tokens, num_producers=run.workers)
        self.shared = Shared(ring=ring, gate=LeaseGate(), weights=run.plan.weights(
            facts.meta_model(run.setup.model_path), cfg.rollout.dtype), counters=WorkerCounters(run.workers),
            stop=self.sup.stop, finish=self.sup.finished, hearts=hearts)
        if args.counters is not None:
            self.shared.counters.set_rows(list(args.worker_ids), args.counters)
        self.error: str | None = None
        self.group = None  # the gloo group of the weight broadcast

        def start(w: int, first_group: int) -> None:
            worker = RolloutArgs(w, run.workers, cfg, run.setup, run.engine, run.evaluator, self.shared,
                                 first_group)
            self.sup.start(f"rollout-{w}", run_worker, dict(args=worker), args.threads, essential=True)

        delivered_at_start = {w: self.shared.counters.get(w, "groups") for w in args.worker_ids}

        def restart(name: str, message: str) -> bool:
            """As train.py's restart of a rollout worker: up to cluster.max_restarts, unless it never
            delivered."""
            w = int(name.split("-")[1])
            counters = self.shared.counters
            if counters.get(w, "restarts") >= c.max_restarts \
                    or counters.get(w, "groups") == delivered_at_start[w]:
                return False
            lost = self.shared.reclaim(w)  # its unfinished groups' starts go back to this node's lease
            print(f"warning: node {args.node}: {message.splitlines()[0]}; restarting it, {lost} unfinished "
                  "groups dropped", file=sys.stderr)
            delivered_at_start[w] = counters.get(w, "groups")
            start(w, counters.get(w, "next_group"))
            return True

        for w, first_group in zip(args.worker_ids, args.first_groups):
            start(w, first_group)

        def watch():
            error = self.sup.watch(on_failure=restart)
            if error and not self.sup.stop.is_set():
                self.error = f"node {args.node}: {error.splitlines()[0]}"

        self.watcher = threading.Thread(target=watch, name="supervisor", daemon=True)
        self.watcher.start()

    def ready(self) -> str:
        """Ray's id of the machine this agent runs on, once its workers are starting."""
        import ray

        return ray.get_runtime_context().get_node_id()

    def join_weights(self, init_method: str, rank: int, world: int, timeout_s: float) -> None:
        """Join the trainer node's gloo group (rank 0 is the trainer node), leaving the one before if any:
        every init has a deadline."""
        import torch.distributed as dist

        if self.group is not None:
            dist.destroy_process_group()
            self.group = None
        import ray

        from launch.ray_cluster import gloo_on

        # this machine's address, where the trainer node reaches it
        with gloo_on(ray.util.get_node_ip_address()):
            dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world,
                                    timeout=timedelta(seconds=timeout_s))
        self.group = dist.group.WORLD

    def receive_weights(self, version: int) -> float:
        """This node's end of the trainer node's broadcast of `version`, straight into its store (whose
        readers see it once complete); the seconds it took."""
        import time

        import torch.distributed as dist

        start = time.perf_counter()
        store = self.shared.weights
        with store.writing(version):
            for buffer in store.buffers():
                dist.broadcast(buffer, src=0)
        return time.perf_counter() - start

    def exchange(self, grant: int, room: int, wait_s: float) -> Exchange:
        """Add `grant` leased starts; hand over up to `room` finished groups, waiting up to `wait_s` for a
        first."""
        if grant:
            self.shared.gate.grant(grant)
        groups = []
        while len(groups) < room:
            group = self.shared.ring.get(timeout=0 if groups else wait_s)
            if group is None:
                break
            groups.append(group)
        return Exchange(groups, self.shared.counters.rows(list(self.args.worker_ids)),
                        self.shared.gate.unused, self.error)

    def exit(self) -> None:
        """End this actor's process the way a Python program ends, so that what it created goes with it: the
        named semaphores of its ring, gate and queues (multiprocessing unlinks them at exit; a kill would
        leave them in /dev/shm)."""
        import ray

        ray.actor.exit_actor()

    def stop(self) -> str | None:
        """Stop the node's workers; the shutdown's one line if one had to be killed."""
        late = self.sup.shutdown()
        self.watcher.join(timeout=5.0)
        if self.group is not None:
            import torch.distributed as dist

            dist.destroy_process_group()
            self.group = None
        return late
