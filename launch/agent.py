"""A generator node of a cluster=ray run: the agent, one Ray actor per node, runs the node's rollout workers
as train.py runs them on one machine (a supervisor, a local ring, a weight store, heartbeats and restarts),
and answers the trainer node's calls (launch/ray_nodes.py):

    agent.exchange(grant, room)     # starts leased from the trainer's gate in; up to `room` finished
                                      groups out (revoke=True first takes back the unused lease)
    agent.join_weights(...)         # the gloo pair of this node and the trainer node, for its weights
    agent.receive_weights(version)  # the trainer node's push of `version` over that pair, into its store
    agent.stop()                    # the run is over (or the node drained): the workers stop, and the
                                      supervisor shuts them down

Nothing here imports Ray: the trainer node makes this class an actor, whose calls run in threads (an exchange
never waits behind a weight push). Its rollout workers keep their global ids (lanes of the trainer node's
ring, group ids), and start groups only out of the starts the trainer node leased to this node
(buffer/staleness.py LeaseGate), so the staleness bound stays exact across nodes.
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
    engine_slots: int  # sequences one worker's engine holds (a GPU node builds its engines' specs from it)


@dataclass(frozen=True)
class NodeArgs:
    """One generator node's agent's arguments."""
    node: int  # this node's index in cluster.ray.nodes
    worker_ids: tuple[int, ...]  # its rollout workers' global ids
    # where each starts (resumed, or a restarted agent: past what was delivered)
    first_groups: tuple[int, ...]
    threads: int  # torch threads per rollout worker
    run: NodeRun
    gpus: int = 0  # the node's GPUs: > 0 runs the GPU plan's generation on them
    counters: torch.Tensor | None = None  # its workers' counters so far (a restarted agent goes on from them)


@dataclass
class Exchange:
    """A generator node's answer to `exchange`."""
    groups: list  # finished groups (buffer.ring.Group), oldest first
    counters: torch.Tensor  # its workers' rows of runtime.shared.WorkerCounters
    unused: int  # leased starts not used yet
    error: str | None  # the supervisor's one-line failure, once the node's workers cannot go on
    revoked: int = 0  # unused leased starts taken back (revoke=True)


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
        meta = facts.meta_model(run.setup.model_path)
        # the store the trainer node's pushes arrive in, laid out as the trainer node's own
        self.received = run.plan.weights(meta, cfg.rollout.dtype)
        engines, weights = [run.engine] * len(args.worker_ids), self.received
        self.publish, max_restarts = None, c.max_restarts
        if args.gpus:  # the GPU plan's generation: each version goes on to the engines in buckets
            plan, weights, self.publish = gpu_generation(cfg, args.gpus, meta, list(args.worker_ids),
                                                         self.sup.stop)
            max_len = run.max_prompt_len + cfg.rollout.max_new_tokens
            engines = [plan.engine(i, run.engine_slots, max_len, plan.engine_dtype)
                       for i in range(len(args.worker_ids))]
            max_restarts = plan.max_restarts
            layout = plan.layout
            print(f"note: generator node {args.node} runs the GPU plan's generation: {layout.num_engines} "
                  f"{plan.engine_kind} engine(s) on {cfg.cluster.device} ({layout.describe().split(';')[0]})",
                  file=sys.stderr)
        self.shared = Shared(ring=ring, gate=LeaseGate(), weights=weights,
                             counters=WorkerCounters(run.workers), stop=self.sup.stop,
                             finish=self.sup.finished, hearts=hearts)
        if args.counters is not None:
            self.shared.counters.set_rows(list(args.worker_ids), args.counters)
        self.error: str | None = None
        self.pair = None  # the gloo pair (the trainer node rank 0, this node rank 1) its weights come over

        def start(w: int, first_group: int) -> None:
            engine = engines[args.worker_ids.index(w)]
            worker = RolloutArgs(w, run.workers, cfg, run.setup, engine, run.evaluator, self.shared,
                                 first_group)
            self.sup.start(f"rollout-{w}", run_worker, dict(args=worker), args.threads, essential=True)

        delivered_at_start = {w: self.shared.counters.get(w, "groups") for w in args.worker_ids}

        def restart(name: str, message: str) -> bool:
            """As train.py's restart of a rollout worker: up to cluster.max_restarts, unless it never
            delivered."""
            w = int(name.split("-")[1])
            counters = self.shared.counters
            if counters.get(w, "restarts") >= max_restarts \
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

    def join_weights(self, host: str, port: int, prefix: str, timeout_s: float) -> None:
        """Form this node's gloo pair with the trainer node (rank 0), whose store listens at host:port, under
        `prefix` (a new one each time the trainer node forms it again); every step has a deadline."""
        import ray
        import torch.distributed as dist

        from launch.ray_cluster import gloo_pair

        self.pair = None  # the one before, if any: its trainer node's end was given up
        store = dist.PrefixStore(prefix, dist.TCPStore(host, port, is_master=False,
                                                       timeout=timedelta(seconds=timeout_s)))
        # on this machine's address, where the trainer node reaches it
        self.pair = gloo_pair(store, 1, ray.util.get_node_ip_address(), timeout_s)

    def receive_weights(self, version: int) -> float:
        """This node's end of the trainer node's push of `version`, straight into its store (whose readers
        see it once complete); the seconds it took."""
        import time

        start = time.perf_counter()
        store, pair = self.received, self.pair  # a pair formed again meanwhile is the next push's
        with store.writing(version):
            for buffer in store.buffers():
                pair.broadcast(buffer, 0).wait()
        if self.publish is not None:  # a GPU node: on to its engines, as trainer rank 0 ships on one machine
            self.publish(store.items(), version)
        return time.perf_counter() - start

    def exchange(self, grant: int, room: int, wait_s: float, revoke: bool = False) -> Exchange:
        """Take back the unused lease if `revoke`; add `grant` leased starts; hand over up to `room` finished
        groups, waiting up to `wait_s` for a first."""
        revoked = self.shared.gate.revoke() if revoke else 0
        if grant:
            self.shared.gate.grant(grant)
        groups = []
        while len(groups) < room:
            group = self.shared.ring.get(timeout=0 if groups else wait_s)
            if group is None:
                break
            groups.append(group)
        return Exchange(groups, self.shared.counters.rows(list(self.args.worker_ids)),
                        self.shared.gate.unused, self.error, revoked)

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
        self.pair = None
        return late


class LocalEngines:
    """A GPU generator node's weight path as its rollout workers see it: they keep their global ids, the path
    numbers the node's engines from 0."""

    def __init__(self, path, first_worker: int):
        self.path, self.first = path, first_worker

    def follower(self, engine, worker: int):
        return self.path.follower(engine, worker - self.first)

    def engines_ready(self) -> bool:
        return self.path.engines_ready()


def gpu_generation(cfg, gpus: int, meta, worker_ids: list[int], stop):
    """A generator node's GPU plan (launch/gpu.py), generation only: one engine per cluster.tp_size of its
    `gpus` GPUs (cluster.device=cpu: on the CPU), the engine kind rollout.engine picks on this node, weights
    to the engines in buckets over CUDA IPC. Returns the plan, the path its workers follow, and
    `publish(named, version)`, which the agent calls once a version has arrived whole."""
    from engines.weight_sync import Publisher
    from launch.gpu import GPUPlan
    from launch.layout import generation_layout
    from launch.plan import engine_kind

    kind, _ = engine_kind(cfg.rollout.engine, "gpu")
    dtype = "bfloat16" if cfg.cluster.device == "cuda" else cfg.rollout.dtype
    plan = GPUPlan(generation_layout(gpus, cfg.cluster.tp_size, cfg.cluster.mem_fraction_static), "ipc",
                   cfg.cluster.bucket_mb, False, engine_kind=kind, engine_dtype=dtype,
                   device_type=cfg.cluster.device, cuda_graphs=cfg.rollout.cuda_graphs)
    path = plan.weights(meta, dtype)
    named = list(meta.state_dict().items())
    publisher = Publisher(path, named, meta.config.tie_word_embeddings, lead=True,
                          device=torch.device(plan.engine_device(0)), stop=stop)
    return plan, LocalEngines(path, worker_ids[0]), publisher.publish
