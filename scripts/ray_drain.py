"""Drain a generator node of a running cluster=ray run: it gets no new lease, its unused lease is taken back,
the groups it started are delivered, then its agent stops and its placement group goes, so its machine may
leave without a group lost (launch/ray_nodes.py). Returns at once; the run says `note: generator node N
drained` when it is done.

    python -m scripts.ray_drain RUN_FOLDER NODE    # NODE: its index in cluster.ray.nodes
"""
import argparse
import os
import sys

import yaml


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("run", help="the run's folder (where its config.yaml is)")
    parser.add_argument("node", type=int, help="the generator node's index in cluster.ray.nodes")
    args = parser.parse_args()
    try:
        with open(os.path.join(args.run, "config.yaml")) as f:
            config = yaml.safe_load(f)
    except OSError as e:
        sys.exit(f"error: {args.run} is not a run's folder ({e.strerror}: config.yaml)")
    ray = config.get("cluster", {}).get("ray", {})
    nodes = ray.get("nodes") or []
    if not ray.get("enabled"):
        sys.exit(f"error: the run in {args.run} is not a cluster=ray run")
    if not 0 <= args.node < len(nodes) or nodes[args.node].get("role") != "generator":
        generators = [i for i, n in enumerate(nodes) if n.get("role") == "generator"]
        sys.exit(f"error: node {args.node} is not a generator node of that run (its generator nodes: "
                 f"{', '.join(map(str, generators))})")
    os.makedirs(os.path.join(args.run, "ray"), exist_ok=True)
    with open(os.path.join(args.run, "ray", f"drain_node{args.node}"), "w") as f:
        f.write("drain\n")
    print(f"asked the run in {args.run} to drain generator node {args.node}")


if __name__ == "__main__":
    main()
