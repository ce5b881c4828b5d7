"""Add a node to a simulated cluster=ray cluster (cluster.ray.address="": every node on this machine, on
127.0.0.1), in the foreground until Ctrl-C or SIGTERM, as `ray start --address=... --block` adds a machine to
a real cluster. `ray start` cannot join a simulated one: it turns 127.0.0.1 into this machine's address, where
the simulated nodes do not listen, and the head's GCS listens on 127.0.0.1 alone (`--address=127.0.0.2:PORT`
timed out, Ray 2.60); with RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER=0 it refuses to start a worker node. So this
script, for a simulated cluster only, starts the node through Ray's own `Node` class (`ray._private`, not a
public API); a real machine joins with the public `ray start --address=HEAD:6379 --block` (docs/cluster.md). A
run whose generator nodes are all lost prints this command, so that their replacement can be tried on one
machine (tests/test_ray.py does).

    python -m scripts.ray_join --address=127.0.0.1:PORT --num-cpus=1 --object-store-memory=BYTES
"""
import argparse
import os
import signal
import sys

from launch.memory import remove_unmapped_semaphores
from launch.reaper import kill_and_wait, tree


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--address", required=True, help="the simulated cluster's GCS, 127.0.0.1:PORT")
    parser.add_argument("--num-cpus", type=int, required=True)
    parser.add_argument("--object-store-memory", type=int, required=True, help="bytes")
    args = parser.parse_args()
    from ray._private.node import Node
    from ray._private.parameter import RayParams

    params = RayParams(gcs_address=args.address, node_ip_address="127.0.0.1", num_cpus=args.num_cpus,
                       num_gpus=0, object_store_memory=args.object_store_memory, include_log_monitor=False,
                       node_manager_port=0, min_worker_port=0, max_worker_port=0)
    params.dashboard_agent_listen_port = None  # a free port, not the head's
    node = Node(params, head=False, shutdown_at_exit=True, spawn_reaper=True)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    print(f"joined {args.address} with {args.num_cpus} CPUs; Ctrl-C ends it", flush=True)
    try:
        signal.pause()
    except (KeyboardInterrupt, SystemExit):
        pass
    finally:
        ours = tree(os.getpid())  # the raylet's agents outlive it (launch/reaper.py): seen now, killed after
        node.kill_all_processes(check_alive=False, allow_graceful=True, wait=True)
        kill_and_wait(ours)
        remove_unmapped_semaphores()


if __name__ == "__main__":
    main()
