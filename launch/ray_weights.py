"""A generator node's weights under cluster=ray (launch/ray_nodes.py): the trainer node's consistent copy of
its store (`Snapshot`) and, per node, the thread that sends each new version over that node's gloo pair
(`WeightChannel`), so that a node that stops answering holds up only its own pushes.
"""
import threading
import time

import torch

from launch.ray_cluster import first_line, get, gloo_pair


class Snapshot:
    """One consistent copy of the trainer node's weight store, which the weight channels send from; refilled
    in place only while no channel is sending it."""

    def __init__(self, store):
        self.buffers = [torch.empty_like(b) for b in store.buffers()]
        self.version = -1
        self.users = 0  # channels sending it now
        self.lock = threading.Lock()


class WeightChannel:
    """The trainer node's end of one generator node's weights: a gloo pair (this process rank 0, the node's
    agent rank 1), formed and driven by a thread of its own, so that a node that stops answering holds up
    nothing but its own pushes. Every step has a deadline (the pair's timeout, cluster.ray.call_timeout_s);
    the forwarding thread fences a node whose push takes longer than cluster.ray.node_deadline_s."""

    def __init__(self, ray, node, store, host: str, prefix: str, timeout_s: float):
        """node: the launch.ray_nodes.Node it sends to (its agent, index and push counts)."""
        self.ray, self.node, self.store, self.host, self.prefix = ray, node, store, host, prefix
        self.timeout_s = timeout_s
        self.offered: Snapshot | None = None
        self.sent = -1  # the version the node holds from this channel
        # sending since (a push has cluster.ray.node_deadline_s); forming the pair has the set-up's deadline
        self.busy_since: float | None = None
        self.error: str | None = None
        self.closed = False
        self.wake = threading.Condition()
        self.thread = threading.Thread(target=self._run, name=f"weights-node{node.index}", daemon=True)
        self.thread.start()

    def offer(self, snapshot: Snapshot) -> None:
        with self.wake:
            self.offered = snapshot
            self.wake.notify()

    def close(self) -> None:
        with self.wake:
            self.closed = True
            self.wake.notify()

    def _run(self) -> None:
        import torch.distributed as dist

        ray, node, timeout = self.ray, self.node, self.timeout_s
        try:
            joined = node.place.agent.join_weights.remote(self.host, self.store.port, self.prefix, timeout)
            pair = gloo_pair(dist.PrefixStore(self.prefix, self.store), 0, self.host, timeout)
            get(ray, joined, timeout, f"generator node {node.index}'s weight channel")
            while True:
                with self.wake:
                    while not self.closed and (self.offered is None or self.offered.version <= self.sent):
                        self.wake.wait()
                    if self.closed:
                        return
                    snapshot = self.offered
                with snapshot.lock:
                    snapshot.users += 1
                    version = snapshot.version
                received = None
                try:
                    self.busy_since = start = time.monotonic()
                    received = node.place.agent.receive_weights.remote(version)
                    for buffer in snapshot.buffers:
                        pair.broadcast(buffer, 0).wait()
                    get(ray, received, timeout, f"generator node {node.index}'s weights")
                    received = None
                finally:
                    with snapshot.lock:
                        snapshot.users -= 1
                    if received is not None:  # cut off: the node's end fails too; its error is this one's
                        try:
                            ray.get(received, timeout=timeout)
                        except Exception:
                            pass
                node.counts.push_s.append(time.monotonic() - start)
                self.sent, self.busy_since = version, None
        except Exception as e:  # the node stopped answering, or its agent is gone: the forwarding thread sees
            if not self.closed:
                self.error = first_line(e)
