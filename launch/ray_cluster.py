"""The Ray cluster under cluster=ray (launch/ray_nodes.py drives the nodes on it): importing Ray, the
simulated cluster on this machine and what it leaves, the address checks, the command that joins a machine,
the gloo pairs weights go over, and the deadline-bound `ray.get` every call goes through.
"""
import fcntl
import os
import socket
import struct
import time
from datetime import timedelta

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def import_ray():
    """Import Ray (an optional extra), on loopback where the cluster is simulated: without these, ray.init
    picks the machine's own interface and retries for minutes."""
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
    try:
        import ray
    except ImportError:
        raise ValueError("cluster=ray needs Ray: pip install -r requirements-ray.txt") from None
    return ray


def simulated_cluster(ray_cfg, generator_nodes: int):
    """The nodes of cluster.ray.nodes as Ray nodes on this machine: the trainer node as the head, and the
    first `generator_nodes` generator nodes (the others join later, as machines do: scripts/ray_join.py)."""
    from ray.cluster_utils import Cluster

    store = ray_cfg.object_store_mb * 2**20
    period_ms = int(ray_cfg.health_check_period_s * 1000)
    head, *others = sorted(ray_cfg.nodes, key=lambda n: n.role != "trainer")
    cluster = Cluster(initialize_head=True, head_node_args=dict(
        num_cpus=head.cores, object_store_memory=store, node_ip_address="127.0.0.1", include_dashboard=False,
        _system_config={"health_check_period_ms": period_ms, "health_check_failure_threshold": 3}))
    for node in others[:generator_nodes]:  # a node's GPUs, simulated too: Ray's count of them
        cluster.add_node(num_cpus=node.cores, num_gpus=node.gpus, object_store_memory=store,
                         node_ip_address="127.0.0.1")
    return cluster


def interface_of(address: str) -> str | None:
    """The name of this machine's network interface that holds IPv4 `address`, None if none does."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        for _, name in socket.if_nameindex():
            try:
                # SIOCGIFADDR
                found = fcntl.ioctl(s.fileno(), 0x8915, struct.pack("256s", name[:15].encode()))
            except OSError:  # no IPv4 address
                continue
            if socket.inet_ntoa(found[20:24]) == address:
                return name
    return None


def gloo_where(address: str) -> dict:
    """Where a gloo pair this process forms listens, for a node whose Ray address is `address`: the interface
    of that address, unless GLOO_SOCKET_IFNAME names one. By default gloo takes what the hostname resolves to,
    which on many machines (a container's 127.0.0.1, Debian's 127.0.1.1) is the loopback, where no other
    machine reaches it, and the pair's set-up ends in a connect timeout. A simulated cluster's peers are all
    on the loopback."""
    if address.startswith("127."):
        return {"hostname": address}
    name = os.environ.get("GLOO_SOCKET_IFNAME") or interface_of(address)
    return {"interface": name} if name else {"hostname": address}


def gloo_pair(store, rank: int, address: str, timeout_s: float):
    """A gloo group of two (the trainer node rank 0, a generator node rank 1) formed through `store`,
    listening on `gloo_where(address)`; every operation, and the forming, within `timeout_s`."""
    import torch.distributed as dist

    options = dist.ProcessGroupGloo._Options()
    options._timeout = timedelta(seconds=timeout_s)
    options._devices = [dist.ProcessGroupGloo.create_device(**gloo_where(address))]
    return dist.ProcessGroupGloo(store, rank, 2, options)


def kill_ray_below(root: int) -> None:
    """Kill every Ray process in `root`'s tree (a simulated cluster's daemons and workers), and wait for
    them."""
    from launch.reaper import kill_and_wait, tree

    def is_ray(pid: int) -> bool:
        try:
            with open(f"/proc/{pid}/cmdline", "rb") as f:
                cmd = f.read().decode(errors="replace")
        except OSError:
            return False
        return cmd.startswith("ray::") or "/ray/" in cmd

    kill_and_wait({pid: start for pid, start in tree(root).items() if is_ray(pid)})


def join_command(ray_cfg, address: str, simulated: bool) -> str:
    """How a machine joins the cluster whose head is at `address` as a generator node."""
    cores = max(node.cores for node in ray_cfg.generator_nodes)
    if not simulated:
        return f"ray start --address={address} --num-cpus={cores}"
    # a simulated cluster, on the loopback, which `ray start` cannot join (scripts/ray_join.py says why)
    return (f"python -m scripts.ray_join --address={address} --num-cpus={cores} "
            f"--object-store-memory={ray_cfg.object_store_mb * 2**20}")


def check_address(address: str, timeout: float) -> None:
    """Refuse, in one line, a cluster.ray.address where nothing listens."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"cluster.ray.address={address!r} must be HOST:PORT of a Ray head, auto, or empty")
    try:
        socket.create_connection((host, int(port)), timeout=min(timeout, 10.0)).close()
    except OSError as e:
        raise TimeoutError(f"cluster.ray.address={address}: nothing answers there ({e.strerror or e}); "
                           f"start Ray there with `ray start --head --port={port}`, or leave the address "
                           "empty to simulate the nodes on this machine") from None


def answers(address: str) -> bool:
    """Whether a GCS at HOST:PORT accepts a connection (twice refused, a second apart: gone)."""
    host, _, port = address.rpartition(":")
    for attempt in range(2):
        try:
            socket.create_connection((host, int(port)), timeout=2.0).close()
            return True
        except OSError:
            if attempt == 0:
                time.sleep(1.0)
    return False


def first_line(error: Exception) -> str:
    return str(error).strip().splitlines()[0] if str(error).strip() else repr(error)


def get(ray, refs, timeout: float, what: str):
    """ray.get with a deadline (without one it waits forever and ignores signals); a one-line error naming
    `what`."""
    try:
        return ray.get(refs, timeout=timeout)
    except ray.exceptions.GetTimeoutError:
        raise TimeoutError(f"{what} did not answer within {timeout:g} s "
                           "(cluster.ray.call_timeout_s)") from None
