"""The trainer node's side of cluster=ray: Ray between machines, today's plan inside each (docs/design.md).

    nodes = RayNodes(cfg.cluster.ray, first_worker=plan.rollout_workers)
    nodes.start(NodeRun(...), shared, engine_slots, first_groups)
    ...                                       # the trainer node's own workers and trainer ranks,
                                                as on one machine
    nodes.close()                             # generator nodes stopped, Ray shut down, nothing left running

train.py runs on the trainer node (a real cluster's head; with cluster.ray.address="" Ray starts here and
simulates the nodes on this machine). Each generator node of cluster.ray.nodes has a placement group of its
own (one bundle of its cores): the run starts once cluster.ray.min_nodes of them are placed, and each of the
others starts when a machine with its cores joins the cluster. On it, an agent actor (launch/agent.py) runs
the node's rollout workers. A forwarding thread here, the only writer of those workers' lanes in the trainer
node's ring, keeps one call in flight per node and takes the answers as they come (`ray.wait`), so no node
waits for another:
- each call carries group starts leased from the trainer's StalenessGate (at most a node's engine capacity
  unused at a time), so every group started anywhere was counted by the one gate;
- it brings at most as many finished groups as the node's lanes here have free slots (back-pressure: a full
  lane stops the node, whose own ring then fills and stops its workers), and the node's counters;
- after each optimizer step, every node's weight channel (a gloo pair with the node, driven by a thread of
  its own: launch/ray_weights.py `WeightChannel`) sends it the new version; a channel still busy with an older
  version leaves the others unaffected.
A node whose call or weight push takes longer than cluster.ray.node_deadline_s is fenced: what it was leased
and has not delivered goes back to the gate (so the other nodes can start those groups), its weights are no
longer awaited, and it gets no new lease. When it answers again it rejoins: what it delivers meanwhile is
counted (`StalenessGate.count_started`), its unused lease is taken back, and its weights are brought up to
date. A node whose call fails (Ray's health checks end a lost node's actor) is restarted on its machine while
that machine is in the cluster (up to cluster.max_restarts), else lost, with one warning line; a machine that
joins later with its cores replaces it (Ray moves its placement group there). `python -m scripts.ray_drain
<run folder> <node>` drains a node: no new lease, its unused lease taken back, its started groups delivered,
then it stops and its placement group goes (ray/node<i>_lost_groups stays 0). With nothing left to generate,
the run waits cluster.ray.replace_timeout_s for a machine. Every Ray call and collective set-up has a deadline
(cluster.ray.call_timeout_s).
"""
import os
import statistics
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import timedelta

import torch

from launch.agent import GeneratorAgent, NodeArgs, NodeRun
from launch.memory import remove_unmapped_semaphores
from launch.ray_cluster import (
    ROOT,
    answers,
    check_address,
    first_line,
    get,
    import_ray,
    join_command,
    kill_ray_below,
    simulated_cluster,
)
from launch.ray_weights import Snapshot, WeightChannel

POLL_S = 0.05  # the longest the forwarding thread waits for an answer before it looks at everything again
QUIET_S = 0.5  # a node with nothing to send or take is still called this often (its counters, its health)


@dataclass
class NodeCounts:
    """What a generator node did, for summary.json (ray/node<i>_*)."""
    delivered: int = 0  # groups put in the trainer node's ring
    lost_groups: int = 0  # leased and never delivered, when its agent failed
    restarts: int = 0  # new agents started for it on its machine
    replacements: int = 0  # new machines that took its place after it was lost
    fences: int = 0  # times it missed cluster.ray.node_deadline_s and was fenced
    written_off: int = 0  # groups leased to it and handed back to the gate when it was fenced
    # the newest policy version of a token it delivered: its weights follow the trainer's
    newest_version: int = -1
    forward_s: list[float] = field(default_factory=list)  # each call that brought groups: seconds
    push_s: list[float] = field(default_factory=list)  # each weight push to it: seconds


@dataclass
class Placement:
    """Where a generator node runs: its placement group, its agent and the machine under them."""
    first_groups: tuple = ()  # where its workers start when its first agent starts (a resumed run)
    pg: object = None  # its placement group
    ready: object = None  # its placement group's ready(), while it waits for a machine
    agent: object = None
    node_id: str = ""  # Ray's id of the machine its agent runs on
    what: str = "agent"  # what its starting agent is: agent, new agent, replacement


@dataclass
class Call:
    """The one call a node has in flight: ready(), exchange() or stop()."""
    ref: object = None
    at: float = 0.0  # when it was made
    answered_at: float = 0.0  # when the node last answered


@dataclass
class Lease:
    """What a node holds of the trainer's gate."""
    leased: int = 0  # starts counted against the gate for it: delivered, in flight or unused
    unused: int = 0  # the lease it has not used, as of its last answer
    revoke: bool = False  # its next exchange takes its unused lease back
    pending: int = 0  # written off at its last fence (or failure): counted lost if it never answers again


@dataclass
class Trouble:
    since: float = 0.0  # when it was fenced, or its call failed
    error: str = ""  # why its call failed (state failing)


@dataclass
class Node:
    """A generator node, as the trainer node keeps track of it."""
    index: int  # in cluster.ray.nodes
    worker_ids: list[int]
    capacity: int  # groups its engines hold at once: the most starts it may keep leased and unused
    # waiting (no machine yet) | starting | up | fenced | draining | stopping | failing | drained | lost
    state: str = "waiting"
    place: Placement = field(default_factory=Placement)
    call: Call = field(default_factory=Call)
    lease: Lease = field(default_factory=Lease)
    trouble: Trouble = field(default_factory=Trouble)
    channel: WeightChannel | None = None
    counts: NodeCounts = field(default_factory=NodeCounts)

    @property
    def lost(self) -> bool:
        return self.state == "lost"


class RayNodes:
    def __init__(self, ray_cfg, first_worker: int):
        self.cfg = ray_cfg
        ids = iter(range(first_worker,
                         first_worker + sum(n.rollout_workers for n in ray_cfg.generator_nodes)))
        self.nodes = [Node(i, [next(ids) for _ in range(n.rollout_workers)], 0)
                      for i, n in enumerate(ray_cfg.nodes) if n.role == "generator"]
        self.workers = first_worker + sum(len(n.worker_ids) for n in self.nodes)  # every node's together
        self.local_workers = first_worker  # the trainer node's own
        self.error: str | None = None  # why the nodes ended the run, if they did
        self.gcs = ""  # the head's GCS address, once started
        self.head_lost = False  # the head's Ray stopped answering
        self.cluster = None  # the simulated cluster (address "")
        self.reaper = None  # its reaper (launch/reaper.py)
        self.trainer_pg = None
        self.store = None  # the TCP store the weight channels form their pairs through
        self.snapshot: Snapshot | None = None
        self.channels = 0  # pairs formed so far: each gets a prefix of its own
        self.thread = None
        self.done = threading.Event()

    @property
    def min_nodes(self) -> int:
        return self.cfg.min_nodes or len(self.nodes)

    def start(self, run: NodeRun, shared, engine_slots: int, first_groups: dict[int, int]) -> None:
        """Start (or join) Ray, place the generator nodes that can be placed (cluster.ray.min_nodes at least)
        and start forwarding. engine_slots: sequences one worker's engine holds; first_groups: where each
        worker starts (a resumed run)."""
        ray = import_ray()
        self.ray, self.shared, self.run = ray, shared, run
        timeout = self.cfg.call_timeout_s
        for node in self.nodes:  # a drain asked for in the run this one resumes is not this run's
            if os.path.exists(self.drain_file(node.index)):
                os.remove(self.drain_file(node.index))
        if self.cfg.address not in ("", "auto"):
            check_address(self.cfg.address, timeout)  # ray.init would retry a wrong address for minutes
        if not self.cfg.address:
            self.cluster = simulated_cluster(self.cfg, self.min_nodes)
            # Its daemons are this process's children; the reaper kills them if this process dies unannounced.
            self.reaper = subprocess.Popen([sys.executable, "-m", "launch.reaper", str(os.getpid())],
                                           cwd=ROOT, start_new_session=True)
        # Every node's processes import ringrl from ROOT; a job (`ray job submit --working-dir .`) brings its
        # uploaded copy to every node itself, where ROOT is this node's path of it.
        in_job = "RAY_JOB_CONFIG_JSON_ENV_VAR" in os.environ
        ray.init(address=self.cluster.address if self.cluster else self.cfg.address, log_to_driver=True,
                 runtime_env=None if in_job else {"env_vars": {"PYTHONPATH": ROOT}}, logging_level="WARNING",
                 configure_logging=False)
        from ray.util.placement_group import placement_group

        self.trainer_pg = placement_group([{"CPU": self.cfg.trainer_node.cores,
                                            "node:__internal_head__": 0.001}], strategy="STRICT_PACK")
        get(ray, self.trainer_pg.ready(), timeout, "the trainer node's placement group (does the head have "
                                                   "the cores asked for?)")
        for node in self.nodes:
            node.capacity = len(node.worker_ids) * max(1, engine_slots // run.cfg.rollout.group_size)
            node.place.first_groups = tuple(first_groups.get(w, 0) for w in node.worker_ids)
            spec = self.cfg.nodes[node.index]
            bundle = {"CPU": spec.cores, **({"GPU": spec.gpus} if spec.gpus else {})}
            node.place.pg = placement_group([bundle], strategy="STRICT_PACK")
            node.place.ready = node.place.pg.ready()
        placed, _ = ray.wait([n.place.ready for n in self.nodes], num_returns=self.min_nodes, timeout=timeout)
        if len(placed) < self.min_nodes:
            raise TimeoutError(f"{len(placed)} of the {self.min_nodes} generator nodes the run starts with "
                               f"(cluster.ray.min_nodes) were placed within {timeout:g} s "
                               "(cluster.ray.call_timeout_s): are the nodes up, with the cores asked for?")
        self.gcs = ray.get_runtime_context().gcs_address  # the head's: the trainer node's Ray
        self.host = "127.0.0.1" if self.cluster else ray.util.get_node_ip_address()
        self.store = torch.distributed.TCPStore(self.host, 0, is_master=True, wait_for_workers=False,
                                                timeout=timedelta(seconds=timeout))
        for node in self.nodes:
            if node.place.ready in placed:
                self._place(node, node.place.first_groups)
        for node in [n for n in self.nodes if n.state == "starting"]:  # the run starts with them up
            answer = get(ray, node.call.ref, timeout, "the generator nodes' agents")
            node.call.ref = None
            self._up(node, answer)
        waiting = [n.index for n in self.nodes if n.state == "waiting"]
        if waiting:
            print(f"note: generator nodes {', '.join(map(str, waiting))} are not up yet "
                  f"(cluster.ray.min_nodes={self.cfg.min_nodes}); each starts once a machine with its cores "
                  f"joins: {self.join_command()}", file=sys.stderr)
        self.thread = threading.Thread(target=self._forward, name="ray-forward", daemon=True)
        self.thread.start()

    def _place(self, node: Node, first_groups: tuple, counters=None, what: str = "agent") -> None:
        """Start `node`'s agent in its placement group; its ready() is the node's call until it answers."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        spec = self.cfg.nodes[node.index]
        threads = max(1, spec.cores // spec.rollout_workers)
        args = NodeArgs(node.index, tuple(node.worker_ids), first_groups, threads, self.run, gpus=spec.gpus,
                        counters=counters)
        # Calls in threads (up to 4 at once): an exchange never waits behind a weight push or a pair forming.
        # A GPU node's agent holds its GPUs (Ray sets CUDA_VISIBLE_DEVICES to them; its workers inherit it).
        agent_class = self.ray.remote(num_cpus=0, max_restarts=0, max_concurrency=4)(GeneratorAgent)
        where = PlacementGroupSchedulingStrategy(node.place.pg, placement_group_bundle_index=0)
        node.place.agent = agent_class.options(num_gpus=spec.gpus, scheduling_strategy=where).remote(args)
        node.state, node.place.what = "starting", what
        node.call.ref, node.call.at = node.place.agent.ready.remote(), time.monotonic()

    def _up(self, node: Node, node_id: str) -> None:
        """`node`'s agent is up on machine `node_id`: it gets a weight channel and its first lease."""
        joined = node.place.what == "agent" and node.place.node_id == "" and node.counts.delivered == 0
        replaced = node.place.what == "replacement"
        node.place.node_id, node.state, node.call.answered_at = node_id, "up", time.monotonic()
        node.lease.unused, node.lease.revoke = 0, False
        self._open_channel(node)
        if replaced:
            node.counts.replacements += 1
            print(f"warning: generator node {node.index} replaced by a machine that joined the cluster (Ray "
                  f"node {node_id[:12]}); its workers continue where they stopped", file=sys.stderr)
        elif joined and self.thread is not None:  # placed after the run started
            print(f"note: generator node {node.index} joined (Ray node {node_id[:12]})", file=sys.stderr)

    def _open_channel(self, node: Node) -> None:
        if node.channel is not None:
            node.channel.close()
        self.channels += 1
        node.channel = WeightChannel(self.ray, node, self.store, self.host, f"pair{self.channels}",
                                     self.cfg.call_timeout_s)
        if self.snapshot is not None and self.snapshot.version > 0:
            node.channel.offer(self.snapshot)

    def _forward(self) -> None:
        shared = self.shared
        next_probe = next_look = time.monotonic()
        idle_since = None  # since when nothing could generate (every generator node gone, none here)
        while not (self.done.is_set() or shared.rollouts_over()):
            now = time.monotonic()
            if now >= next_probe:  # the trainer node's Ray gone while this launcher lives: stop
                next_probe = now + self.cfg.health_check_period_s
                if not answers(self.gcs):
                    return self._lose_head()
            if now >= next_look:  # machines that joined, drains asked for, failed nodes' machines
                next_look = now + QUIET_S
                self._look_around()
            for node in self.nodes:
                if node.call.ref is None and node.state in ("up", "draining", "fenced"):
                    self._call(node)
            calls = [n.call.ref for n in self.nodes if n.call.ref is not None]
            ready = set()
            if calls:  # the first answer, then every other one already there
                self.ray.wait(calls, num_returns=1, timeout=POLL_S)
                ready = set(self.ray.wait(calls, num_returns=len(calls), timeout=0)[0])
            else:
                self.done.wait(POLL_S)
            for node in self.nodes:
                if node.call.ref is not None and node.call.ref in ready:
                    self._answered(node)
            self._check_deadlines()
            self._offer_weights()
            self._publish_counts()
            if any(n.state not in ("lost", "waiting", "drained") for n in self.nodes):
                idle_since = None
            elif not self.local_workers:  # nothing can generate: wait for a machine, then end in one line
                if idle_since is None:
                    idle_since = time.monotonic()
                    print(f"warning: every generator node is lost and the trainer node has no rollout "
                          f"worker; waiting up to {self.cfg.replace_timeout_s:g} s "
                          f"(cluster.ray.replace_timeout_s) for a machine to replace one: "
                          f"{self.join_command()}", file=sys.stderr)
                if time.monotonic() - idle_since >= self.cfg.replace_timeout_s:
                    self.error = ("every generator node is lost, the trainer node has no rollout worker and "
                                  f"no machine replaced one in {self.cfg.replace_timeout_s:g} s "
                                  "(cluster.ray.replace_timeout_s); resume=<this run's folder> continues "
                                  "from its last checkpoint")
                    shared.stop.set()
                    return

    def _lose_head(self) -> None:
        """The head's Ray is gone while this launcher lives: the run stops in one line (Ray's own client ends
        this process a minute after its GCS went, so nothing here may wait on Ray any more)."""
        self.head_lost = True
        self.error = (f"the trainer node's Ray (its head, {self.gcs}) stopped answering; resume=<this run's "
                      "folder> continues from its last checkpoint")
        self.shared.stop.set()

    def _call(self, node: Node) -> None:
        """Send `node` its next exchange: the starts it may lease, the room its lanes here have."""
        shared = self.shared
        grant = 0
        if node.state == "up":
            while node.lease.unused + grant < node.capacity and shared.gate.try_start():
                grant += 1
        room = min(self.cfg.forward_groups, sum(shared.ring.free_slots(w) for w in node.worker_ids))
        # a fenced node's lease was handed back: its call takes back what it has not used, and rejoins it
        revoke = node.lease.revoke or node.state in ("draining", "fenced")
        if not (grant or room or revoke) and time.monotonic() - node.call.answered_at < QUIET_S:
            return  # its lanes here are full: the trainer takes groups meanwhile
        node.lease.leased += grant
        node.lease.unused += grant
        node.call.ref = node.place.agent.exchange.remote(grant, room, 4 * POLL_S if room else 0.0, revoke)
        node.call.at = time.monotonic()

    def _answered(self, node: Node) -> None:
        """`node`'s call has an answer (or failed)."""
        call, node.call.ref = node.call.ref, None
        elapsed = time.monotonic() - node.call.at
        try:
            answer = self.ray.get(call, timeout=0)
            if getattr(answer, "error", None):
                raise RuntimeError(answer.error)
        except Exception as e:  # a lost node, a dead agent
            if not answers(self.gcs):  # not the node: the head (Ray's node table is gone with it)
                return self._lose_head()
            return self._failed(node, e)
        node.call.answered_at = time.monotonic()
        if node.state == "starting":
            return self._up(node, answer)
        if node.state == "stopping":
            return self._drained(node)
        if node.state == "fenced":
            self._rejoin(node, elapsed)
        shared, counts = self.shared, node.counts
        for group in answer.groups:
            shared.ring.put(group)  # its lane had room: never blocks
        if answer.groups:
            counts.forward_s.append(elapsed)
            counts.newest_version = max(counts.newest_version,
                                        *(int(g.versions.max()) for g in answer.groups))
        counts.delivered += len(answer.groups)
        if counts.delivered > node.lease.leased:  # started from a lease handed back while it was fenced
            shared.gate.count_started(counts.delivered - node.lease.leased)
            node.lease.leased = counts.delivered
        if answer.revoked and node.state == "draining":  # while fenced the lease was handed back already
            shared.gate.cancel(answer.revoked)
            node.lease.leased -= answer.revoked
        node.lease.revoke = False
        node.lease.unused = answer.unused
        shared.counters.set_rows(node.worker_ids, answer.counters)
        if node.state == "draining" and node.lease.leased == counts.delivered and not answer.unused:
            node.state, node.call.ref = "stopping", node.place.agent.stop.remote()
            node.call.at = time.monotonic()

    def _check_deadlines(self) -> None:
        """Fence a node whose call, or weight push, has taken longer than cluster.ray.node_deadline_s; a node
        starting or stopping has cluster.ray.call_timeout_s."""
        now, deadline = time.monotonic(), self.cfg.node_deadline_s
        for node in self.nodes:
            if node.state in ("starting", "stopping") and node.call.ref is not None \
                    and now - node.call.at > self.cfg.call_timeout_s:
                what = "start" if node.state == "starting" else "stop"
                limit = self.cfg.call_timeout_s
                self._failed(node, TimeoutError(f"its agent did not {what} within {limit:g} s "
                                                "(cluster.ray.call_timeout_s)"))
            elif node.state in ("up", "draining"):
                channel = node.channel
                late_call = node.call.ref is not None and now - node.call.at > deadline
                late_push = channel is not None and channel.busy_since is not None \
                    and now - channel.busy_since > deadline
                if late_call or late_push or (channel is not None and channel.error):
                    why = (f"its weight channel failed ({channel.error})" if channel and channel.error else
                           f"its {'call' if late_call else 'weight push'} took over {deadline:g} s "
                           "(cluster.ray.node_deadline_s)")
                    self._fence(node, why)

    def _write_off(self, node: Node) -> int:
        """Hand back to the gate what `node` was leased and has not delivered; how many."""
        undelivered = node.lease.leased - node.counts.delivered
        if undelivered > 0:
            self.shared.gate.cancel(undelivered)
        node.lease.leased, node.lease.unused = node.counts.delivered, 0
        return max(undelivered, 0)

    def _fence(self, node: Node, why: str) -> None:
        written = self._write_off(node)
        node.lease.pending, node.trouble.since, node.state = written, time.monotonic(), "fenced"
        node.counts.fences += 1
        node.counts.written_off += written
        if node.channel is not None:
            node.channel.close()
            node.channel = None
        print(f"warning: generator node {node.index} fenced: {why}; its {written} groups leased and not "
              "delivered handed back to the gate, its weights no longer awaited, until it answers",
              file=sys.stderr)

    def _rejoin(self, node: Node, elapsed: float) -> None:
        node.state, node.lease.revoke, node.lease.pending = "up", True, 0
        self._open_channel(node)
        print(f"warning: generator node {node.index} answered again after {elapsed:.1f} s and rejoined; its "
              "unused lease is taken back and its weights brought up to date", file=sys.stderr)

    def _failed(self, node: Node, error: Exception) -> None:
        """`node`'s call failed: what it was leased and did not deliver goes back to the gate (its groups in
        flight are lost). Whether it restarts on its machine or is lost is settled once Ray's health checks
        have had time to notice a lost machine (`_settle`)."""
        if node.channel is not None:
            node.channel.close()
            node.channel = None
        undelivered = self._write_off(node) + node.lease.pending
        self.shared.gate.recover()
        counters = self.shared.counters
        for w in node.worker_ids:  # as Shared.reclaim: the unfinished groups counted lost, none started
            counters.add(w, "lost_groups", max(counters.get(w, "started") - counters.get(w, "groups"), 0))
            counters.set(w, "started", counters.get(w, "groups"))
        node.counts.lost_groups += undelivered
        node.lease.pending, node.call.ref = undelivered, None  # pending: for the warning line
        try:
            self.ray.kill(node.place.agent)
        except Exception:
            pass
        node.state, node.trouble.since, node.trouble.error = "failing", time.monotonic(), first_line(error)

    def _settle(self, node: Node) -> None:
        """A failing node: lost once Ray says its machine is gone; restarted there once it has stayed in the
        cluster past 3 missed health checks (up to cluster.max_restarts)."""
        alive = any(n["NodeID"] == node.place.node_id and n["Alive"] for n in self.ray.nodes())
        waited = time.monotonic() - node.trouble.since > 4 * self.cfg.health_check_period_s + 2.0
        if alive and not waited:
            return
        lost = node.lease.pending
        if alive and node.counts.restarts < self.run.cfg.cluster.max_restarts:
            node.counts.restarts += 1
            print(f"warning: generator node {node.index}'s agent failed ({node.trouble.error}); restarting "
                  f"it ({node.counts.restarts}/{self.run.cfg.cluster.max_restarts}), {lost} groups lost",
                  file=sys.stderr)
            return self._take_over(node, "new agent")
        node.state = "lost"
        if self.cluster is not None:  # a simulated node, on this machine: what its killed processes left
            remove_unmapped_semaphores()
        print(f"warning: generator node {node.index} lost ({node.trouble.error}); {lost} groups leased to it "
              f"and not delivered handed back; going on without it until a machine replaces it "
              f"({self.join_command()})", file=sys.stderr)

    def _take_over(self, node: Node, what: str) -> None:
        """A new agent for `node` in its placement group, its workers starting where the last exchange saw
        them and their counters carried on."""
        counters = self.shared.counters
        self._place(node, tuple(counters.get(w, "next_group") for w in node.worker_ids),
                    counters.rows(node.worker_ids), what)

    def _look_around(self) -> None:
        """What changes slowly: nodes whose machine joined (placed, or a lost node's placement group moved
        to a new machine), drains asked for, failing nodes to settle."""
        from ray.util.placement_group import placement_group_table

        for node in self.nodes:
            if node.state == "waiting" and self.ray.wait([node.place.ready], timeout=0)[0]:
                self._place(node, node.place.first_groups)
            elif node.state == "failing":
                self._settle(node)
            elif node.state == "lost":
                table = placement_group_table(node.place.pg)
                where = table.get("bundles_to_node_id", {}).get(0)
                if table.get("state") == "CREATED" and where and where != node.place.node_id:
                    node.place.node_id = where  # that machine is tried once
                    self._take_over(node, "replacement")
            elif node.state in ("up", "fenced") and os.path.exists(self.drain_file(node.index)):
                if node.state == "fenced":
                    continue  # drained once it answers again
                node.state = "draining"
                print(f"note: draining generator node {node.index}: no new lease; it leaves once the "
                      f"{node.lease.leased - node.counts.delivered} groups it was leased are delivered or "
                      "handed back", file=sys.stderr)

    def drain_file(self, index: int) -> str:
        """Where `python -m scripts.ray_drain` asks for generator node `index` to be drained."""
        return os.path.join(self.run.setup.run_dir, "ray", f"drain_node{index}")

    def _drained(self, node: Node) -> None:
        from ray.util.placement_group import remove_placement_group

        if node.channel is not None:
            node.channel.close()
            node.channel = None
        try:
            self.ray.get(node.place.agent.exit.remote(), timeout=30)
        except Exception:
            pass  # the actor has exited (its call ends with it) or is killed here
        self.ray.kill(node.place.agent)
        remove_placement_group(node.place.pg)
        node.state = "drained"
        print(f"note: generator node {node.index} drained: its {node.counts.delivered} groups delivered, "
              "none lost; its machine may leave", file=sys.stderr)

    def _offer_weights(self) -> None:
        """After a step: one consistent snapshot of the trainer node's store, offered to every node's channel
        (a channel still sending an older one sends this one next)."""
        store = self.shared.weights
        channels = [n.channel for n in self.nodes if n.channel is not None and n.state in ("up", "draining")]
        if not channels or store.version <= 0 or (self.snapshot and self.snapshot.version >= store.version):
            return
        snapshot = self.snapshot
        if snapshot is None or snapshot.users:  # one still being sent keeps its copy until it is done
            snapshot = Snapshot(store)
        with snapshot.lock:
            if snapshot.users:  # a channel took it up meanwhile
                snapshot = Snapshot(store)
            snapshot.version = store.read_buffers(snapshot.buffers)
        self.snapshot = snapshot
        for channel in channels:
            channel.offer(snapshot)

    def join_command(self) -> str:
        """How a machine joins this cluster as a generator node."""
        return join_command(self.cfg, self.cluster.address if self.cluster else self.gcs,
                            self.cluster is not None)

    def _pushes(self) -> list[float]:
        return [s for n in self.nodes for s in n.counts.push_s]

    def _weights_version(self) -> int:
        """The oldest version a serving node's store holds from the trainer node (-1: none yet)."""
        held = [n.channel.sent for n in self.nodes if n.channel is not None and n.state == "up"]
        return min(held) if held else -1

    def _publish_counts(self) -> None:
        """The nodes' counts where trainer rank 0 reads them for its metrics rows
        (runtime.shared.NodeCounters)."""
        table = self.shared.nodes
        if table is None:
            return
        for row, n in enumerate(self.nodes):
            c = n.counts
            table.set(row, groups=c.delivered, lost_groups=c.lost_groups, restarts=c.restarts,
                      lost=int(n.lost), replacements=c.replacements, fences=c.fences,
                      written_off=c.written_off, drained=int(n.state == "drained"),
                      forward_calls=len(c.forward_s), forward_s=sum(c.forward_s))
        pushes = self._pushes()
        table.set(0, broadcasts=len(pushes), broadcast_s=sum(pushes))

    def metrics(self) -> dict:
        """Per node: groups delivered, lost, fenced, forwarding and weight-push seconds; the pushes' count and
        mean seconds."""
        pushes = self._pushes()
        out = {"ray/broadcasts": len(pushes), "ray/weights_version": self._weights_version(),
               "ray/broadcast_s": statistics.mean(pushes) if pushes else 0.0}
        for n in self.nodes:
            counts = n.counts
            out[f"ray/node{n.index}_groups"] = counts.delivered
            out[f"ray/node{n.index}_lost"] = int(n.lost)
            out[f"ray/node{n.index}_lost_groups"] = counts.lost_groups
            out[f"ray/node{n.index}_restarts"] = counts.restarts
            out[f"ray/node{n.index}_replacements"] = counts.replacements
            out[f"ray/node{n.index}_fences"] = counts.fences
            out[f"ray/node{n.index}_written_off"] = counts.written_off
            out[f"ray/node{n.index}_drained"] = int(n.state == "drained")
            out[f"ray/node{n.index}_newest_version"] = counts.newest_version
            out[f"ray/node{n.index}_forward_s"] = (statistics.mean(counts.forward_s) if counts.forward_s
                                                   else 0.0)
            out[f"ray/node{n.index}_push_s"] = statistics.mean(counts.push_s) if counts.push_s else 0.0
        return out

    def close(self) -> None:
        """Stop the forwarding, every agent and its workers, and Ray: nothing of the run is left running."""
        self.done.set()
        if self.thread is not None:
            self.thread.join(timeout=self.cfg.call_timeout_s)
        for node in self.nodes:
            if node.channel is not None:
                node.channel.close()
        ray = getattr(self, "ray", None)
        # no Ray call can succeed: end the simulated nodes here
        if self.head_lost and self.cluster is not None:
            kill_ray_below(os.getpid())
            self.cluster = None
            remove_unmapped_semaphores()
        elif ray is not None and ray.is_initialized():
            # a fenced node may never answer: it is killed below
            serving = [n for n in self.nodes
                       if n.place.agent is not None and n.state in ("up", "draining", "stopping", "starting")]
            stops = [n.place.agent.stop.remote() for n in serving]
            try:
                ray.get(stops, timeout=60)
            except Exception as e:  # an agent that does not stop is killed below
                print(f"warning: a generator node did not stop cleanly ({str(e).splitlines()[0]})",
                      file=sys.stderr)
            exits = [n.place.agent.exit.remote() for n in serving]
            try:
                ray.get(exits, timeout=30)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass  # the actor has exited (its call ends with it) or is killed below
            from ray.util.placement_group import remove_placement_group

            for n in self.nodes:
                if n.place.agent is not None:
                    ray.kill(n.place.agent)
                if n.place.pg is not None and n.state != "drained":
                    remove_placement_group(n.place.pg)
            if self.trainer_pg is not None:
                remove_placement_group(self.trainer_pg)
            ray.shutdown()
        self.store = None
        if self.cluster is not None:
            self.cluster.shutdown()
            self.cluster = None
            remove_unmapped_semaphores()
        if self.reaper is not None:
            self.reaper.terminate()
            self.reaper.wait(timeout=30)
            self.reaper = None
