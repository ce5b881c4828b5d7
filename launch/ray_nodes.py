"""The trainer node's side of cluster=ray: Ray between machines, today's plan inside each (docs/design.md).

    nodes = RayNodes(cfg.cluster.ray, first_worker=plan.rollout_workers)
    nodes.start(NodeRun(...), shared, engine_slots, first_groups)
    ...                                       # the trainer node's own workers and trainer ranks,
                                                as on one machine
    nodes.close()                             # generator nodes stopped, Ray shut down, nothing left running

train.py runs on the trainer node (a real cluster's head; with cluster.ray.address="" Ray starts here and
simulates every node on this machine). One agent actor per generator node (launch/agent.py), each in its own
bundle of a STRICT_SPREAD placement group, runs that node's rollout workers. A forwarding thread here, the
only writer of those workers' lanes in the trainer node's ring, loops over the nodes:
- it leases group starts from the trainer's StalenessGate (at most a node's engine capacity unused at a time)
  and sends them with its call, so every group started anywhere was counted by the one gate;
- it takes at most as many finished groups as the node's lanes here have free slots (back-pressure: a full
  lane stops the node, whose own ring then fills and stops its workers), and copies its counters;
- after each optimizer step it broadcasts the new weights to every generator node's store over gloo (the
  object store would take seconds for a model's weights).
A node that fails a call (Ray's health checks end a lost node's actor) is dropped with one warning line: its
lease not yet delivered goes back to the gate, as `Shared.reclaim` does for a dead worker, and the run goes on
with the other nodes. A machine that joins the cluster later with the cores asked for replaces it: Ray moves
the lost node's bundle of the placement group there, and a new agent takes over the node's workers where they
stopped. With nothing left to generate, the run waits cluster.ray.replace_timeout_s for such a machine. Every
Ray call and collective set-up has a deadline (cluster.ray.call_timeout_s).
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
from launch.plan import free_port
from launch.ray_cluster import (
    ROOT,
    answers,
    check_address,
    first_line,
    get,
    gloo_on,
    import_ray,
    join_command,
    kill_ray_below,
    simulated_cluster,
)


@dataclass
class NodeCounts:
    """What a generator node did, for summary.json (ray/node<i>_*)."""
    delivered: int = 0  # groups put in the trainer node's ring
    lost_groups: int = 0  # leased and never delivered, when its agent failed
    restarts: int = 0  # new agents started for it on its machine
    replacements: int = 0  # new machines that took its place after it was lost
    # the newest policy version of a token it delivered: its weights follow the trainer's
    newest_version: int = -1
    forward_s: list[float] = field(default_factory=list)  # each call that brought groups: seconds


@dataclass
class Node:
    """A generator node, as the trainer node keeps track of it."""
    index: int  # in cluster.ray.nodes
    worker_ids: list[int]
    capacity: int  # groups its engines hold at once: the most starts it may keep leased and unused
    agent: object = None
    node_id: str = ""  # Ray's id of the machine its agent runs on
    leased: int = 0  # starts granted in all, less those handed back: compared with counts.delivered
    unused: int = 0  # the lease it has not used, as of its last answer
    lost: bool = False
    counts: NodeCounts = field(default_factory=NodeCounts)


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
        self.group = None
        self.pg = None
        self.thread = None
        self.done = threading.Event()
        self.broadcast_s: list[float] = []
        self.version = -1  # the version every generator node's store holds
        self.regroup = False  # the weight broadcast's group must be formed again (a node lost, an agent new)

    def start(self, run: NodeRun, shared, engine_slots: int, first_groups: dict[int, int]) -> None:
        """Start (or join) Ray, place one agent per generator node and start forwarding. engine_slots:
        sequences one worker's engine holds; first_groups: where each worker starts (a resumed run)."""
        ray = import_ray()
        self.ray, self.shared, self.run = ray, shared, run
        timeout = self.cfg.call_timeout_s
        if self.cfg.address not in ("", "auto"):
            check_address(self.cfg.address, timeout)  # ray.init would retry a wrong address for minutes
        if not self.cfg.address:
            self.cluster = simulated_cluster(self.cfg)
            # Its daemons are this process's children; the reaper kills them if this process dies unannounced.
            self.reaper = subprocess.Popen([sys.executable, "-m", "launch.reaper", str(os.getpid())],
                                           cwd=ROOT, start_new_session=True)
        ray.init(address=self.cluster.address if self.cluster else self.cfg.address, log_to_driver=True,
                 runtime_env={"env_vars": {"PYTHONPATH": ROOT}}, logging_level="WARNING",
                 configure_logging=False)
        from ray.util.placement_group import placement_group

        # One bundle per node, no two on one node; the first reserves the trainer node's cores (the head's).
        trainer = self.cfg.trainer_node
        bundles = [{"CPU": trainer.cores, "node:__internal_head__": 0.001}] + \
                  [{"CPU": self.cfg.nodes[n.index].cores} for n in self.nodes]
        self.pg = placement_group(bundles, strategy="STRICT_SPREAD")
        get(ray, self.pg.ready(), timeout, "the placement group of cluster.ray.nodes (are the nodes up, with "
                                            "the cores asked for?)")
        for node in self.nodes:
            node.capacity = len(node.worker_ids) * max(1, engine_slots // run.cfg.rollout.group_size)
            self._place(node, tuple(first_groups.get(w, 0) for w in node.worker_ids))
        ready = get(ray, [n.agent.ready.remote() for n in self.nodes], timeout, "the generator nodes' agents")
        for node, node_id in zip(self.nodes, ready):
            node.node_id = node_id
        self._join_weights()
        self.gcs = ray.get_runtime_context().gcs_address  # the head's: the trainer node's Ray
        self.thread = threading.Thread(target=self._forward, name="ray-forward", daemon=True)
        self.thread.start()

    def _place(self, node: Node, first_groups: tuple, counters=None) -> None:
        """Start `node`'s agent in its bundle of the placement group."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        spec = self.cfg.nodes[node.index]
        args = NodeArgs(node.index, tuple(node.worker_ids), first_groups,
                        max(1, spec.cores // spec.rollout_workers), self.run, counters)
        bundle = 1 + self.nodes.index(node)
        agent_class = self.ray.remote(num_cpus=0, max_restarts=0)(GeneratorAgent)
        node.agent = agent_class.options(scheduling_strategy=PlacementGroupSchedulingStrategy(
            self.pg, placement_group_bundle_index=bundle)).remote(args)

    def _join_weights(self) -> None:
        """A gloo group of this process (rank 0) and every live agent, for the weight broadcast; a new one
        after a node is lost or an agent restarted (whose next broadcast then sends the current version to
        all)."""
        import torch.distributed as dist

        timeout = self.cfg.call_timeout_s
        if self.group is not None:
            dist.destroy_process_group()
            self.group = None
        live = [n for n in self.nodes if not n.lost]
        if not live:
            return
        address = "127.0.0.1" if self.cluster else self.ray.util.get_node_ip_address()
        init = f"tcp://{address}:{free_port()}"
        joins = [n.agent.join_weights.remote(init, rank, len(live) + 1, timeout)
                 for rank, n in enumerate(live, 1)]
        with gloo_on(address):
            dist.init_process_group("gloo", init_method=init, rank=0, world_size=len(live) + 1,
                                    timeout=timedelta(seconds=timeout))
        self.group = dist.group.WORLD
        get(self.ray, joins, timeout, "the weight broadcast's gloo group")
        self.version = -1

    def _forward(self) -> None:
        shared = self.shared
        next_probe = next_replace = time.monotonic()
        idle_since = None  # since when nothing could generate (every generator node lost, none here)
        while not (self.done.is_set() or shared.rollouts_over()):
            if time.monotonic() >= next_probe:  # the trainer node's Ray gone while this launcher lives: stop
                next_probe = time.monotonic() + self.cfg.health_check_period_s
                if not answers(self.gcs):
                    return self._lose_head()
            moved = 0
            for node in [n for n in self.nodes if not n.lost]:
                try:
                    moved += self._exchange(node)
                except Exception as e:  # a lost node, a dead agent, a call past its deadline
                    if not answers(self.gcs):  # not the node: the head (Ray's node table is gone with it)
                        return self._lose_head()
                    self._failed(node, e)
            if self.regroup and not self.done.is_set():  # before any broadcast: the old group has a dead peer
                self.regroup = False
                try:
                    self._join_weights()
                except Exception as e:
                    print(f"warning: the weight broadcast's group did not form ({first_line(e)}); retrying",
                          file=sys.stderr)
                    self.regroup = True
            try:
                if not self.regroup:
                    self._send_weights()
            except Exception as e:
                # a peer gone mid-broadcast: its next exchange fails, and the group is rebuilt
                print(f"warning: the weight broadcast failed ({first_line(e)}); "
                      "retrying after the next exchange", file=sys.stderr)
                self.regroup = True
            if any(n.lost for n in self.nodes) and time.monotonic() >= next_replace:
                next_replace = time.monotonic() + self.cfg.health_check_period_s
                for node in [n for n in self.nodes if n.lost]:
                    self._replace(node)
            self._publish_counts()
            if not all(n.lost for n in self.nodes):
                idle_since = None
            elif not self.local_workers:  # nothing can generate: wait for a replacement, then end in one line
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
                self.done.wait(0.2)
            else:
                self.done.wait(0.2)

    def _lose_head(self) -> None:
        """The head's Ray is gone while this launcher lives: the run stops in one line (Ray's own client ends
        this process a minute after its GCS went, so nothing here may wait on Ray any more)."""
        self.head_lost = True
        self.error = (f"the trainer node's Ray (its head, {self.gcs}) stopped answering; resume=<this run's "
                      "folder> continues from its last checkpoint")
        self.shared.stop.set()

    def _exchange(self, node: Node) -> int:
        shared, ray = self.shared, self.ray
        grant = 0
        while node.unused + grant < node.capacity and shared.gate.try_start():
            grant += 1
        node.leased += grant
        room = min(self.cfg.forward_groups, sum(shared.ring.free_slots(w) for w in node.worker_ids))
        start = time.perf_counter()
        answer = get(ray, node.agent.exchange.remote(grant, room, 0.05 if room else 0.0),
                      self.cfg.call_timeout_s, f"generator node {node.index}")
        if answer.error:
            raise RuntimeError(answer.error)
        for group in answer.groups:
            shared.ring.put(group)  # its lane had room: never blocks
        counts = node.counts
        if answer.groups:
            counts.forward_s.append(time.perf_counter() - start)
            counts.newest_version = max(counts.newest_version,
                                        *(int(g.versions.max()) for g in answer.groups))
        counts.delivered += len(answer.groups)
        node.unused = answer.unused
        shared.counters.set_rows(node.worker_ids, answer.counters)
        if not answer.groups and not room:
            time.sleep(0.005)  # its lanes here are full: the trainer takes groups meanwhile
        return len(answer.groups)

    def _send_weights(self) -> None:
        """After a step: the trainer node's store, one consistent snapshot, broadcast to every generator
        node."""
        import torch.distributed as dist

        store = self.shared.weights
        live = [n for n in self.nodes if not n.lost]
        if store.version <= max(self.version, 0) or not live or self.group is None:
            return
        if not hasattr(self, "_copies"):
            self._copies = [torch.empty_like(b) for b in store.buffers()]
        version = store.read_buffers(self._copies)
        start = time.perf_counter()
        calls = [n.agent.receive_weights.remote(version) for n in live]
        for buffer in self._copies:
            dist.broadcast(buffer, src=0)
        get(self.ray, calls, self.cfg.call_timeout_s, "the weight broadcast")
        self.broadcast_s.append(time.perf_counter() - start)
        self.version = version

    def _failed(self, node: Node, error: Exception) -> None:
        """`node`'s call failed. What it was leased and did not deliver goes back to the gate (its groups in
        flight are lost). If its machine is still in the cluster, a new agent takes over where its workers
        stopped (up to cluster.max_restarts); if not, the run goes on without the node. One warning line
        either way."""
        undelivered = node.leased - node.counts.delivered
        self.shared.gate.recover()
        if undelivered > 0:
            self.shared.gate.cancel(undelivered)
        counters = self.shared.counters
        for w in node.worker_ids:  # as Shared.reclaim: the unfinished groups counted lost, none started
            counters.add(w, "lost_groups", max(counters.get(w, "started") - counters.get(w, "groups"), 0))
            counters.set(w, "started", counters.get(w, "groups"))
        node.leased, node.unused = node.counts.delivered, 0
        node.counts.lost_groups += max(undelivered, 0)
        try:
            self.ray.kill(node.agent)
        except Exception:
            pass
        self.regroup = True
        if self._node_alive(node) and node.counts.restarts < self.run.cfg.cluster.max_restarts:
            node.counts.restarts += 1
            print(f"warning: generator node {node.index}'s agent failed ({first_line(error)}); restarting it "
                  f"({node.counts.restarts}/{self.run.cfg.cluster.max_restarts}), {max(undelivered, 0)} "
                  "groups lost", file=sys.stderr)
            try:
                self._take_over(node, "new agent")
                return
            except Exception as e:
                error = e
        node.lost = True
        if self.cluster is not None:  # a simulated node, on this machine: what its killed processes left
            remove_unmapped_semaphores()
        print(f"warning: generator node {node.index} lost ({first_line(error)}); {max(undelivered, 0)} "
              f"groups leased to it and not delivered handed back; going on without it until a machine "
              f"replaces it ({self.join_command()})", file=sys.stderr)

    def _take_over(self, node: Node, what: str) -> None:
        """A new agent for `node` in its bundle, its workers starting where the last exchange saw them and
        their counters carried on; returns once it is up (its machine's id noted)."""
        counters = self.shared.counters
        self._place(node, tuple(counters.get(w, "next_group") for w in node.worker_ids),
                    counters.rows(node.worker_ids))
        node.node_id = get(self.ray, node.agent.ready.remote(), self.cfg.call_timeout_s,
                           f"generator node {node.index}'s {what}")

    def _node_alive(self, node: Node) -> bool:
        """Whether the machine `node`'s agent ran on is still in the cluster, once Ray's health checks
        (3 missed) have had time to notice a lost one."""
        deadline = time.monotonic() + 4 * self.cfg.health_check_period_s + 2.0
        while True:
            alive = any(n["NodeID"] == node.node_id and n["Alive"] for n in self.ray.nodes())
            if not alive or time.monotonic() > deadline:
                return alive
            time.sleep(0.5)

    def _replace(self, node: Node) -> None:
        """If Ray has placed lost `node`'s bundle on a machine that joined since (a placement group's bundles
        move to a new node that has the resources), start a new agent there that takes over the node's workers
        where they stopped. One warning line whether it starts or not."""
        from ray.util.placement_group import placement_group_table

        bundle = 1 + self.nodes.index(node)
        table = placement_group_table(self.pg)
        where = table.get("bundles_to_node_id", {}).get(bundle)
        if table.get("state") != "CREATED" or not where or where == node.node_id:
            return
        try:
            self._take_over(node, "replacement")
        except Exception as e:
            print(f"warning: generator node {node.index}'s replacement did not start ({first_line(e)}); "
                  "waiting for another", file=sys.stderr)
            try:
                self.ray.kill(node.agent)
            except Exception:
                pass
            node.node_id = where  # that machine is not tried again
            return
        node.lost = False
        node.counts.replacements += 1
        self.regroup = True  # the broadcast's group gains it; its first broadcast brings the current weights
        print(f"warning: generator node {node.index} replaced by a machine that joined the cluster (Ray node "
              f"{where[:12]}); its workers continue where they stopped", file=sys.stderr)

    def join_command(self) -> str:
        """How a machine joins this cluster as a generator node."""
        return join_command(self.cfg, self.cluster.address if self.cluster else self.gcs,
                            self.cluster is not None)

    def _publish_counts(self) -> None:
        """The nodes' counts where trainer rank 0 reads them for its metrics rows
        (runtime.shared.NodeCounters)."""
        table = self.shared.nodes
        if table is None:
            return
        for row, n in enumerate(self.nodes):
            c = n.counts
            table.set(row, groups=c.delivered, lost_groups=c.lost_groups, restarts=c.restarts,
                      lost=int(n.lost), replacements=c.replacements, forward_calls=len(c.forward_s),
                      forward_s=sum(c.forward_s))
        table.set(0, broadcasts=len(self.broadcast_s), broadcast_s=sum(self.broadcast_s))

    def metrics(self) -> dict:
        """Per node: groups delivered, lost, forwarding seconds; the weight broadcast's seconds."""
        out = {"ray/broadcasts": len(self.broadcast_s), "ray/weights_version": self.version,
               "ray/broadcast_s": sum(self.broadcast_s) / len(self.broadcast_s) if self.broadcast_s else 0.0}
        for n in self.nodes:
            counts = n.counts
            out[f"ray/node{n.index}_groups"] = counts.delivered
            out[f"ray/node{n.index}_lost"] = int(n.lost)
            out[f"ray/node{n.index}_lost_groups"] = counts.lost_groups
            out[f"ray/node{n.index}_restarts"] = counts.restarts
            out[f"ray/node{n.index}_replacements"] = counts.replacements
            out[f"ray/node{n.index}_newest_version"] = counts.newest_version
            out[f"ray/node{n.index}_forward_s"] = (statistics.mean(counts.forward_s) if counts.forward_s
                                                   else 0.0)
        return out

    def close(self) -> None:
        """Stop the forwarding, every agent and its workers, and Ray: nothing of the run is left running."""
        self.done.set()
        if self.thread is not None:
            self.thread.join(timeout=self.cfg.call_timeout_s)
        ray = getattr(self, "ray", None)
        # no Ray call can succeed: end the simulated nodes here
        if self.head_lost and self.cluster is not None:
            kill_ray_below(os.getpid())
            self.cluster = None
            remove_unmapped_semaphores()
        elif ray is not None and ray.is_initialized():
            stops = [n.agent.stop.remote() for n in self.nodes if n.agent is not None and not n.lost]
            try:
                ray.get(stops, timeout=60)
            except Exception as e:  # an agent that does not stop is killed below
                print(f"warning: a generator node did not stop cleanly ({str(e).splitlines()[0]})",
                      file=sys.stderr)
            exits = [n.agent.exit.remote() for n in self.nodes if n.agent is not None and not n.lost]
            try:
                ray.get(exits, timeout=30)
            except (ray.exceptions.RayActorError, ray.exceptions.GetTimeoutError):
                pass  # the actor has exited (its call ends with it) or is killed below
            for n in self.nodes:
                if n.agent is not None:
                    ray.kill(n.agent)
            if self.pg is not None:
                from ray.util.placement_group import remove_placement_group

                remove_placement_group(self.pg)
            ray.shutdown()
        if self.group is not None:
            import torch.distributed as dist

            dist.destroy_process_group()
            self.group = None
        if self.cluster is not None:
            self.cluster.shutdown()
            self.cluster = None
            remove_unmapped_semaphores()
        if self.reaper is not None:
            self.reaper.terminate()
            self.reaper.wait(timeout=30)
            self.reaper = None
