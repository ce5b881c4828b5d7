"""cluster=ray on a simulated two-node cluster on this machine (launch/ray_nodes.py, launch/agent.py): a
trainer node and a generator node whose groups are forwarded to it. Needs the optional extra:
pip install -r requirements-ray.txt."""
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from tests.helpers import ROOT, TINY, die_with_parent, run_train, shm_files, train_cmd


def _without_ray(tmp_path) -> dict:
    """An environment whose `import ray` fails, in the launcher and in every process it spawns."""
    fake = tmp_path / "no_ray" / "ray"
    fake.mkdir(parents=True)
    (fake / "__init__.py").write_text("raise ImportError('ray was imported')\n")
    return dict(os.environ, PYTHONPATH=str(tmp_path / "no_ray"))


def test_a_run_without_cluster_ray_never_imports_ray(tiny_model_dir, tmp_path):
    result = subprocess.run(train_cmd(tmp_path / "run", f"model.path={tiny_model_dir}", "steps=1",
                                      "eval.every=0", "checkpoint.at_end=false", *TINY), cwd=ROOT,
                            capture_output=True, text=True, timeout=300, env=_without_ray(tmp_path),
                            preexec_fn=die_with_parent)
    assert result.returncode == 0, result.stderr[-3000:]


def test_cluster_ray_without_ray_installed_says_how_to_install_it(tiny_model_dir, tmp_path):
    result = subprocess.run(train_cmd(tmp_path / "run", f"model.path={tiny_model_dir}", "cluster=ray",
                                      "steps=1", *TINY), cwd=ROOT, capture_output=True, text=True,
                            timeout=300, env=_without_ray(tmp_path), preexec_fn=die_with_parent)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1] \
        == "error: cluster=ray needs Ray: pip install -r requirements-ray.txt"


def _ray_processes() -> set[int]:
    """Live processes of Ray's (its daemons and workers), from /proc."""
    found = set()
    for entry in os.listdir("/proc"):
        if entry.isdigit():
            try:
                with open(f"/proc/{entry}/cmdline", "rb") as f:
                    cmd = f.read().decode(errors="replace")
            except OSError:
                continue
            if "ray/" in cmd or "raylet" in cmd or "gcs_server" in cmd or cmd.startswith("ray::"):
                found.add(int(entry))
    return found


def _nothing_left(ray_before: set, shm_before: set) -> None:
    """No Ray process and no /dev/shm file of the run left, once they have had time to exit (a loaded machine
    takes a while to end a run's Ray processes: a wait for a state, bounded)."""
    deadline = time.time() + 60
    while not (_ray_processes() <= ray_before and shm_files() <= shm_before) and time.time() < deadline:
        time.sleep(0.2)
    assert _ray_processes() <= ray_before and shm_files() <= shm_before


def test_an_address_where_no_ray_answers_is_one_line(tiny_model_dir, tmp_path):
    pytest.importorskip("ray")
    result = run_train(tmp_path, f"model.path={tiny_model_dir}", "cluster=ray",
                       "cluster.ray.address=127.0.0.1:1", "steps=1", *TINY, timeout=120)
    assert result.returncode == 1
    assert result.stderr.strip().splitlines()[-1].startswith(
        "error: cluster.ray.address=127.0.0.1:1: nothing answers there (Connection refused); "
        "start Ray there with")


def test_the_join_command_fits_the_cluster_and_a_negative_wait_is_refused():
    """What the lost-node warnings tell a user to run: `ray start` for a real cluster, with the generator
    nodes' cores; scripts/ray_join.py for a simulated one (on the loopback, which `ray start` cannot join)."""
    from launch.ray_cluster import join_command
    from runtime.schema import RayConfig, RayNode

    cfg = RayConfig(enabled=True, object_store_mb=128,
                    nodes=[RayNode("trainer", 4, 0, 0, 1), RayNode(cores=2),
                           RayNode(cores=8, rollout_workers=2)])
    assert join_command(cfg, "10.0.0.1:6379", simulated=False) \
        == "ray start --address=10.0.0.1:6379 --num-cpus=8"
    assert join_command(cfg, "127.0.0.1:5000", simulated=True) == (
        "python -m scripts.ray_join --address=127.0.0.1:5000 --num-cpus=8 "
        f"--object-store-memory={128 * 2**20}")
    cfg.replace_timeout_s = -1
    with pytest.raises(ValueError, match="cluster.ray.replace_timeout_s"):
        cfg.check()


def test_gloo_pairs_listen_on_the_interface_of_the_node_s_address(monkeypatch):
    """Where the hostname resolves to the loopback, gloo would listen there and a generator node on another
    machine could not form its weight pair (the two-network-stack test below failed so): gloo_where points
    it at the interface of the node's Ray address, leaves a simulated cluster on the loopback and honours a
    user's GLOO_SOCKET_IFNAME."""
    from launch.ray_cluster import gloo_where, interface_of

    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert interface_of("127.0.0.1") == "lo" and interface_of("203.0.113.254") is None  # TEST-NET-3: nobody's
    assert gloo_where("127.0.0.1") == {"hostname": "127.0.0.1"}
    assert gloo_where("203.0.113.254") == {"hostname": "203.0.113.254"}  # no interface of ours: as given
    import socket

    # the address this machine reaches others from
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect(("192.0.2.1", 9))  # TEST-NET-1: only picks the route, sends nothing
            address = s.getsockname()[0]
        except OSError:
            pytest.skip("no route off this machine")
    if address.startswith("127."):
        pytest.skip("no interface but the loopback has an IPv4 address here")
    name = interface_of(address)
    assert name in {n for _, n in socket.if_nameindex()} - {"lo"}
    assert gloo_where(address) == {"interface": name}
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "mine")
    assert gloo_where(address) == {"interface": "mine"}


def test_a_weight_pair_sends_across_and_a_missing_peer_ends_in_its_deadline():
    """The gloo pair a generator node's weights go over: a broadcast arrives whole, and forming a pair whose
    peer never comes ends at its deadline instead of waiting for ever."""
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    from launch.ray_cluster import gloo_pair

    store = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                          timeout=timedelta(seconds=10))
    got = torch.zeros(5)

    def node():
        client = dist.TCPStore("127.0.0.1", store.port, is_master=False, timeout=timedelta(seconds=10))
        gloo_pair(dist.PrefixStore("p1", client), 1, "127.0.0.1", 10).broadcast(got, 0).wait()

    thread = threading.Thread(target=node)
    thread.start()
    gloo_pair(dist.PrefixStore("p1", store), 0, "127.0.0.1", 10).broadcast(torch.arange(5.0), 0).wait()
    thread.join(timeout=30)
    assert got.tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    start = time.monotonic()
    with pytest.raises(Exception, match="timeout|Timeout|timed out"):
        gloo_pair(dist.PrefixStore("p2", store), 0, "127.0.0.1", 1)
    assert time.monotonic() - start < 30  # a bound on a hang, not a timing


def test_the_lease_gate_takes_back_unused_starts_and_the_trainer_gate_counts_late_ones():
    """A drained or rejoining node's unused lease is taken back; groups a fenced node started from a lease
    already handed back are counted when they arrive, and hold the gate until the bound allows again."""
    from buffer.staleness import LeaseGate, StalenessGate

    lease = LeaseGate()
    lease.grant(3)
    assert lease.try_start() and lease.unused == 2
    assert lease.revoke() == 2 and lease.unused == 0 and not lease.try_start()
    assert lease.revoke() == 0
    gate = StalenessGate(batch_groups=2, max_staleness=0)
    assert gate.try_start() and gate.try_start() and not gate.try_start()
    gate.cancel(2)  # a fenced node's lease handed back
    assert gate.try_start() and gate.try_start()  # ... and started elsewhere
    gate.count_started(2)  # the fenced node delivers its two after all
    assert gate.started == 4 and not gate.try_start()
    gate.set_version(1)
    assert not gate.try_start()  # (0 + 1 + 1) * 2 = 4: still at the bound
    gate.set_version(2)
    assert gate.try_start()


@pytest.mark.slow
def test_a_generator_node_feeds_the_trainer_node(tiny_model_dir, tmp_path):
    pytest.importorskip("ray")
    before, ray_before = shm_files(), _ray_processes()
    result = run_train(tmp_path, f"model.path={tiny_model_dir}", "cluster=ray", "steps=4", "max_staleness=1",
                       "eval.every=0", "checkpoint.at_end=false", *TINY, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    with open(tmp_path / "metrics.jsonl") as f:
        rows = [json.loads(line) for line in f]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [r["step"] for r in rows] == [1, 2, 3, 4]
    assert max(r["staleness_max"] for r in rows) <= 1
    # the trainer node has no rollout worker (the preset): every group trained came from the generator node
    assert summary["ray/node1_groups"] >= 4 * 2 and summary["ray/node1_lost"] == 0
    # its weights followed the trainer's: a new version went out after steps, and its tokens were sampled by
    # them
    assert summary["ray/broadcasts"] >= 2 and summary["ray/weights_version"] >= 2
    assert summary["ray/node1_newest_version"] >= 1
    # ... and each metrics row says how far the node had got: its groups never fall, and they fed every step
    groups = [r["ray/node1_groups"] for r in rows]
    assert groups == sorted(groups) and groups[-1] >= 4 * 2 and rows[-1]["ray/node1_lost"] == 0
    assert rows[-1]["ray/broadcasts"] >= 2 and rows[-1]["ray/broadcast_s"] > 0 \
        and rows[-1]["ray/node1_forward_s"] > 0
    _nothing_left(ray_before, before)  # nothing left running, no shared memory


def _pid_named(name: str) -> int | None:
    """The live process whose title is `name` (the supervisor names them: ringrl:rollout-1)."""
    return next((int(p) for p in os.listdir("/proc") if p.isdigit() and _cmdline(int(p)) == name), None)


def _parent(pid: int) -> int:
    with open(f"/proc/{pid}/stat") as f:
        return int(f.read().rsplit(")", 1)[1].split()[1])


def _rows(metrics) -> int:
    return len(metrics.read_text().splitlines()) if metrics.exists() else 0


def _fault_run(tmp_path, model_dir, nodes: str, kill, warning: str, worker: str, recover=None):
    """A long cluster=ray run: once the trainer has logged a step, `kill(pid of the generator node's worker)`;
    once the run has said `warning` (and `recover(lines, wait_for)` has returned, if given) and trained two
    more steps, Ctrl-C. Its stderr lines and summary. `recover` returns a function that ends what it started,
    called once the run has stopped."""
    pytest.importorskip("ray")
    before, ray_before = shm_files(), _ray_processes()
    proc = subprocess.Popen(train_cmd(tmp_path, f"model.path={model_dir}", "cluster=ray",
                                      f"cluster.ray.nodes={nodes}", "cluster.ray.call_timeout_s=30",
                                      "steps=1000", "max_staleness=1", "eval.every=0",
                                      "checkpoint.at_end=false", *TINY),
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                            preexec_fn=die_with_parent)
    lines = []
    reader = threading.Thread(target=lambda: lines.extend(proc.stderr), daemon=True)
    reader.start()
    deadline = time.time() + 300  # a bound on a hang, not a timing: every wait is for a state
    metrics = tmp_path / "metrics.jsonl"

    def wait_for(state):
        while not state():
            assert proc.poll() is None and time.time() < deadline, "".join(lines)[-3000:]
            time.sleep(0.2)

    end = None
    try:
        wait_for(lambda: _rows(metrics) and _pid_named(f"ringrl:{worker}"))
        kill(_pid_named(f"ringrl:{worker}"))
        wait_for(lambda: any(line.startswith(warning) for line in lines))
        if recover is not None:
            end = recover(lines, wait_for)
        rows = _rows(metrics)
        wait_for(lambda: _rows(metrics) >= rows + 2)  # the run goes on
        proc.send_signal(signal.SIGINT)
        proc.wait(timeout=300)
    finally:
        if proc.poll() is None:
            proc.kill()
        if end is not None:
            end()
    reader.join(timeout=30)
    assert proc.returncode == 130, "".join(lines)[-3000:]  # interrupted: the launcher's Ctrl-C
    summary = json.loads((tmp_path / "summary.json").read_text())
    with open(metrics) as f:
        assert max(json.loads(line)["staleness_max"] for line in f) <= 1
    _nothing_left(ray_before, before)  # nothing left running, no shared memory
    return [line.rstrip("\n") for line in lines], summary


def _kill_the_node(rollout: int) -> None:
    """The generator node's machine goes: its raylet killed (the agent and its workers go with it)."""
    os.kill(_parent(_parent(rollout)), signal.SIGKILL)


@pytest.mark.slow
def test_a_lost_generator_node_is_dropped_and_the_run_goes_on(tiny_model_dir, tmp_path):
    """The generator node's machine goes (its raylet killed: Ray's health checks end it and its actors); the
    trainer node's own worker keeps the run going."""
    lines, summary = _fault_run(tmp_path, tiny_model_dir, "[{role: trainer, cores: 1, rollout_workers: 1, "
                                "trainer_ranks: 1}, {role: generator, cores: 1}]", _kill_the_node,
                                "warning: generator node 1 lost",
                                "rollout-1")  # the trainer node's is rollout-0
    assert len([line for line in lines if line.startswith("warning: generator node 1 lost")]) == 1
    assert summary["ray/node1_lost"] == 1 and summary["ray/node1_restarts"] == 0
    assert summary["ray/node1_replacements"] == 0


@pytest.mark.slow
def test_a_machine_that_joins_replaces_a_lost_generator_node(tiny_model_dir, tmp_path):
    """Nothing else generates (the trainer node has no rollout worker), so the run waits, in one warning line
    that gives the command a new machine runs; a Ray node started with it (on this machine) takes the lost
    node's place and the steps after it are trained on its groups."""
    def join(lines, wait_for):
        (waiting,) = [line for line in lines if line.startswith("warning: every generator node is lost")]
        command = waiting.split("replace one: ", 1)[1].split()  # a simulated cluster's: scripts/ray_join.py
        assert command[:3] == ["python", "-m", "scripts.ray_join"] \
            and command[3].startswith("--address=127.0.0.1:")
        node = subprocess.Popen([sys.executable, *command[1:]], cwd=ROOT, stdout=subprocess.DEVNULL,
                                stderr=subprocess.DEVNULL, start_new_session=True)
        wait_for(lambda: any(line.startswith("warning: generator node 1 replaced") for line in lines))

        return lambda: _leave(node, ray_before)

    ray_before = _ray_processes()
    lines, summary = _fault_run(tmp_path, tiny_model_dir, "[{role: trainer, cores: 1, rollout_workers: 0, "
                                "trainer_ranks: 1}, {role: generator, cores: 1}]", _kill_the_node,
                                "warning: every generator node is lost", "rollout-0", recover=join)
    assert len([line for line in lines if line.startswith("warning: generator node 1 lost")]) == 1
    assert summary["ray/node1_replacements"] == 1 and summary["ray/node1_lost"] == 0


@pytest.mark.slow
def test_a_killed_agent_is_restarted_where_its_workers_stopped(tiny_model_dir, tmp_path):
    """The agent actor dies (SIGKILL), its machine stays: a new agent takes over. The trainer node generates
    nothing, so the steps after the restart are trained on the new agent's groups."""
    lines, summary = _fault_run(tmp_path, tiny_model_dir, "[{role: trainer, cores: 1, rollout_workers: 0, "
                                "trainer_ranks: 1}, {role: generator, cores: 1}]",
                                lambda rollout: os.kill(_parent(rollout), signal.SIGKILL),
                                "warning: generator node 1's agent failed", "rollout-0")  # the only one
    restarted = [line for line in lines if line.startswith("warning: generator node 1's agent failed")]
    assert len(restarted) == 1 and "restarting it (1/3)" in restarted[0]
    assert summary["ray/node1_restarts"] == 1 and summary["ray/node1_lost"] == 0


def _checkpointing_run(tmp_path, model_dir, stderr=subprocess.DEVNULL):
    """A long cluster=ray run, returned once its checkpoint of step 2 is written."""
    proc = subprocess.Popen(train_cmd(tmp_path, f"model.path={model_dir}", "cluster=ray", "steps=1000",
                                      "max_staleness=1", "eval.every=0", "checkpoint.every=2",
                                      "checkpoint.at_end=false", *TINY),
                            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=stderr, text=True,
                            preexec_fn=die_with_parent)
    deadline = time.time() + 300  # a bound on a hang, not a timing: the wait is for a state
    while not (tmp_path / "checkpoints" / "step_2").exists():
        if proc.poll() is not None or time.time() > deadline:
            proc.kill()
            raise AssertionError("the run did not write its step-2 checkpoint")
        time.sleep(0.2)
    return proc


def _nothing_left_and_resume_continues(tmp_path, shm_before, ray_before):
    """Once nothing of the run is left running (nor in /dev/shm), `resume=` continues it two steps further."""
    def ours():
        return [p for p in os.listdir("/proc") if p.isdigit() and _cmdline(int(p)).startswith("ringrl:")]

    deadline = time.time() + 120
    while _ray_processes() - ray_before or ours() or not shm_files() <= shm_before:
        assert time.time() < deadline, (_ray_processes() - ray_before, ours(), shm_files() - shm_before)
        time.sleep(0.2)
    done = max(int(name.split("_")[1])
               for name in os.listdir(tmp_path / "checkpoints") if name.startswith("step_"))
    resumed = run_train(tmp_path, f"resume={tmp_path}", f"steps={done + 2}", timeout=600)
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    with open(tmp_path / "metrics.jsonl") as f:
        assert [json.loads(line)["step"] for line in f] == list(range(1, done + 3))
    assert json.loads((tmp_path / "summary.json").read_text())["ray/node1_groups"] >= 2 * 2
    assert not _ray_processes() - ray_before and shm_files() <= shm_before


@pytest.mark.slow
def test_a_lost_trainer_node_leaves_nothing_running_and_resume_continues(tiny_model_dir, tmp_path):
    """The trainer node's machine goes: its launcher killed, and with it the simulated cluster's head. Its own
    processes die with it, the reaper (launch/reaper.py) ends the simulated nodes' daemons and the generator
    node's agent and workers, and `resume=` continues from the last checkpoint, on a new cluster."""
    pytest.importorskip("ray")
    before, ray_before = shm_files(), _ray_processes()
    proc = _checkpointing_run(tmp_path, tiny_model_dir)
    proc.kill()  # SIGKILL: nothing of the launcher's shutdown runs
    proc.wait()
    _nothing_left_and_resume_continues(tmp_path, before, ray_before)


@pytest.mark.slow
def test_the_trainer_node_s_ray_lost_is_one_line_and_resume_continues(tiny_model_dir, tmp_path):
    """The head's Ray (its GCS) dies while the launcher lives: the run stops with one line naming resume=."""
    pytest.importorskip("ray")
    before, ray_before = shm_files(), _ray_processes()
    proc = _checkpointing_run(tmp_path, tiny_model_dir, stderr=subprocess.PIPE)
    gcs = [int(p) for p in os.listdir("/proc") if p.isdigit() and "gcs_server" in _cmdline(int(p))]
    assert len(gcs) == 1
    os.kill(gcs[0], signal.SIGKILL)
    _, stderr = proc.communicate(timeout=300)
    assert proc.returncode == 1, stderr[-3000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("error: the trainer node's Ray (its head, ") and last.endswith(
        "stopped answering; resume=<this run's folder> continues from its last checkpoint"), stderr[-3000:]
    _nothing_left_and_resume_continues(tmp_path, before, ray_before)


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().split(b"\0")[0].decode(errors="replace").strip()
    except OSError:
        return ""


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, timeout=30)


@pytest.fixture
def two_hosts():
    """Two network stacks on this machine, joined by a veth pair as two machines on one subnet are (each with
    its own address, a default route through it, and the hostname still resolving to 127.0.0.1, as in many
    containers and Debian's 127.0.1.1): (namespace, address) of machine A and of machine B. Needs root and
    iproute2."""
    if os.geteuid() != 0 or not shutil.which("ip"):
        pytest.skip("needs root and iproute2 (network namespaces)")
    tag = f"rr{os.getpid() % 100000}"
    hosts = [(f"{tag}a", "10.213.0.1"), (f"{tag}b", "10.213.0.2")]
    try:
        for name, _ in hosts:
            _ip("netns", "add", name)
        _ip("link", "add", f"{tag}va", "type", "veth", "peer", "name", f"{tag}vb")
        for (name, address), end in zip(hosts, "ab"):
            _ip("link", "set", f"{tag}v{end}", "netns", name)
            _ip("-n", name, "addr", "add", f"{address}/24", "dev", f"{tag}v{end}")
            _ip("-n", name, "link", "set", "lo", "up")
            _ip("-n", name, "link", "set", f"{tag}v{end}", "up")
            _ip("-n", name, "route", "add", "default", "dev", f"{tag}v{end}")
    except (subprocess.CalledProcessError, OSError) as e:
        for name, _ in hosts:
            subprocess.run(["ip", "netns", "del", name], capture_output=True)
        pytest.skip(f"network namespaces unavailable here: {e}")
    yield hosts
    for name, _ in hosts:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)  # the veth pair goes with them


@pytest.mark.slow
def test_the_readme_s_two_machine_commands_on_two_network_stacks(tiny_model_dir, tmp_path, two_hosts):
    """The README's real-cluster commands on two machines' network stacks (network namespaces):
    `ray start --head` on A, `ray start --address=A:6379` on B (one core each, to fit a 2-core box), then
    train.py on A with cluster.ray.address=auto, and `ray stop` on both, as a user would (it stops every Ray
    process of the machine). Unlike a simulated cluster, nothing is on the loopback: the generator node
    reaches the trainer node's Ray and its gloo group at A's address (before launch/ray_cluster.py `gloo_on`,
    that group's init timed out here)."""
    pytest.importorskip("ray")
    (a, a_ip), (b, _) = two_hosts
    ray_cli = [sys.executable, "-m", "ray.scripts.scripts"]
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")
    before, ray_before = shm_files(), _ray_processes()

    def on(host, *cmd, timeout=120):
        return subprocess.run(["ip", "netns", "exec", host, *cmd], cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout, env=env, preexec_fn=die_with_parent)

    try:
        head = on(a, *ray_cli, "start", "--head", "--port=6379", "--num-cpus=1", "--disable-usage-stats")
        assert head.returncode == 0, head.stderr[-3000:]
        node = on(b, *ray_cli, "start", f"--address={a_ip}:6379", "--num-cpus=1")
        assert node.returncode == 0, node.stderr[-3000:]
        result = on(a, *train_cmd(tmp_path, f"model.path={tiny_model_dir}", "cluster=ray",
                                  "cluster.ray.address=auto",
                                  "cluster.ray.nodes=[{role: trainer, cores: 1, rollout_workers: 0, "
                                  "trainer_ranks: 1}, {role: generator, cores: 1, rollout_workers: 1}]",
                                  "cluster.ray.call_timeout_s=60", "steps=3", "max_staleness=1",
                                  "eval.every=0", "checkpoint.at_end=false", *TINY),
                    timeout=600)
        assert result.returncode == 0, result.stderr[-3000:]
    finally:
        for host in (b, a):
            on(host, *ray_cli, "stop", "--force", timeout=120)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 3 and summary["ray/node1_groups"] >= 3 * 2 and summary["ray/node1_lost"] == 0
    assert summary["ray/broadcasts"] >= 2 and summary["ray/node1_newest_version"] >= 1
    deadline = time.time() + 60  # `ray stop` returns before its processes are gone: wait for that state
    while _ray_processes() - ray_before and time.time() < deadline:
        time.sleep(0.2)
    assert not _ray_processes() - ray_before and shm_files() <= before


class _LongRun:
    """A long cluster=ray run in the background (Ctrl-C ends it): its stderr lines and metrics rows, and waits
    for states of it, each bounded (a bound on a hang, not a timing)."""

    def __init__(self, tmp_path, model_dir, nodes: str, *overrides, steps=1000, prefix=()):
        pytest.importorskip("ray")
        self.path, self.before, self.ray_before = tmp_path, shm_files(), _ray_processes()
        self.proc = subprocess.Popen(
            [*prefix, *train_cmd(tmp_path, f"model.path={model_dir}", "cluster=ray",
                                 f"cluster.ray.nodes={nodes}", "cluster.ray.call_timeout_s=30",
                                 f"steps={steps}", "max_staleness=1", "eval.every=0",
                                 "checkpoint.at_end=false", *overrides, *TINY)],
            cwd=ROOT, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
            preexec_fn=die_with_parent)
        self.lines = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stderr), daemon=True)
        self.reader.start()
        self.deadline = time.time() + 400

    def rows(self) -> list[dict]:
        metrics = self.path / "metrics.jsonl"
        if not metrics.exists():
            return []
        return [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]

    def said(self, start: str) -> list[str]:
        return [line.rstrip("\n") for line in self.lines if line.startswith(start)]

    def wait_for(self, state, running=True):
        while not state():
            assert (not running or self.proc.poll() is None) and time.time() < self.deadline, \
                "".join(self.lines)[-3000:]
            time.sleep(0.2)

    def interrupt(self, leftovers: bool = True) -> dict:
        """Ctrl-C; its summary, once (`leftovers`) nothing of it is left running and nothing left in
        /dev/shm."""
        try:
            self.proc.send_signal(signal.SIGINT)
            self.proc.wait(timeout=300)
        finally:
            if self.proc.poll() is None:
                self.proc.kill()
        self.reader.join(timeout=30)
        assert self.proc.returncode == 130, "".join(self.lines)[-3000:]
        assert max(r["staleness_max"] for r in self.rows()) <= 1
        if leftovers:
            self.nothing_left()
        return json.loads((self.path / "summary.json").read_text())

    def nothing_left(self) -> None:
        _nothing_left(self.ray_before, self.before)


TWO_GENERATORS = ("[{role: trainer, cores: 1, rollout_workers: 0, trainer_ranks: 1}, "
                  "{role: generator, cores: 1}, {role: generator, cores: 1}]")


@pytest.mark.slow
def test_a_stopped_agent_is_fenced_and_the_other_node_s_groups_keep_arriving(tiny_model_dir, tmp_path):
    """Node 1's agent SIGSTOPped for 30 s: once it misses cluster.ray.node_deadline_s it is fenced (its lease
    handed back to the gate), node 2's groups keep arriving and the steps go on; SIGCONT, and it answers,
    rejoins and delivers again."""
    run = _LongRun(tmp_path, tiny_model_dir, TWO_GENERATORS, "cluster.ray.node_deadline_s=5")
    try:
        run.wait_for(lambda: run.rows() and _pid_named("ringrl:rollout-0"))  # node 1's worker: rollout-0
        agent = _parent(_pid_named("ringrl:rollout-0"))
        os.kill(agent, signal.SIGSTOP)
        stopped = time.time()
        try:
            run.wait_for(lambda: run.said("warning: generator node 1 fenced"))
            rows = run.rows()
            run.wait_for(lambda: len(run.rows()) >= len(rows) + 3)  # the steps go on ...
            # ... on node 2's groups, which keep arriving
            assert run.rows()[-1]["ray/node2_groups"] >= rows[-1]["ray/node2_groups"] + 3 * 2
            time.sleep(max(0.0, 30 - (time.time() - stopped)))  # the fault lasts 30 s
        finally:
            os.kill(agent, signal.SIGCONT)
        run.wait_for(lambda: run.said("warning: generator node 1 answered again"))
        delivered = run.rows()[-1]["ray/node1_groups"]
        run.wait_for(lambda: run.rows()[-1]["ray/node1_groups"] > delivered)  # it delivers again
    finally:
        summary = run.interrupt()
    assert len(run.said("warning: generator node 1 fenced")) == 1
    assert run.said("warning: generator node 1 fenced")[0].endswith(
        "its weights no longer awaited, until it answers")
    assert summary["ray/node1_fences"] == 1 and summary["ray/node1_lost"] == 0
    assert summary["ray/node2_fences"] == 0 and summary["ray/node1_restarts"] == 0


def _join(command: list[str]) -> subprocess.Popen:
    """A machine joins the simulated cluster (scripts/ray_join.py on this machine)."""
    assert command[:3] == ["python", "-m", "scripts.ray_join"], command
    return subprocess.Popen([sys.executable, *command[1:]], cwd=ROOT, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, start_new_session=True)


def _leave(node: subprocess.Popen, ray_before: set) -> None:
    """The machine leaves: its node's processes stopped, whatever of them outlives it killed."""
    node.terminate()
    try:
        node.wait(timeout=60)
    finally:
        try:
            os.killpg(node.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        node.wait()
    deadline = time.time() + 60
    while _ray_processes() - ray_before and time.time() < deadline:
        time.sleep(0.2)


@pytest.mark.slow
def test_a_node_that_joins_mid_run_contributes_groups(tiny_model_dir, tmp_path):
    """cluster.ray.min_nodes=1 of two generator nodes: the run starts with node 1 and says how a machine
    joins; one that joins mid-run (scripts/ray_join.py here) becomes node 2, and its groups are trained on."""
    run = _LongRun(tmp_path, tiny_model_dir, TWO_GENERATORS, "cluster.ray.min_nodes=1")
    machine = None
    try:
        run.wait_for(lambda: run.rows())
        (waiting,) = run.said("note: generator nodes 2 are not up yet")
        assert run.rows()[-1]["ray/node2_groups"] == 0
        machine = _join(waiting.split("cores joins: ", 1)[1].split())
        run.wait_for(lambda: run.said("note: generator node 2 joined"))
        run.wait_for(lambda: run.rows()[-1]["ray/node2_groups"] >= 2)
        summary = run.interrupt(leftovers=False)  # the machine that joined is still up
    finally:
        if run.proc.poll() is None:
            run.proc.kill()
        if machine is not None:
            _leave(machine, run.ray_before)
    run.nothing_left()
    assert summary["ray/node2_groups"] >= 2 and summary["ray/node1_groups"] >= 2
    assert summary["ray/node2_lost"] == 0 and summary["ray/node2_replacements"] == 0


@pytest.mark.slow
def test_a_drained_node_leaves_with_no_group_lost(tiny_model_dir, tmp_path):
    """`python -m scripts.ray_drain RUN 1` mid-run: node 1 gets no new lease, delivers what it started and
    leaves; the trainer node's own worker carries the run on, and no group is lost."""
    run = _LongRun(tmp_path, tiny_model_dir, "[{role: trainer, cores: 1, rollout_workers: 1, "
                   "trainer_ranks: 1}, {role: generator, cores: 1}]")
    try:
        run.wait_for(lambda: run.rows() and run.rows()[-1]["ray/node1_groups"] >= 2)
        asked = subprocess.run([sys.executable, "-m", "scripts.ray_drain", str(tmp_path), "1"], cwd=ROOT,
                               capture_output=True, text=True, timeout=60)
        assert asked.returncode == 0, asked.stderr
        run.wait_for(lambda: run.said("note: generator node 1 drained"))
        rows = len(run.rows())
        delivered = run.rows()[-1]["ray/node1_groups"]
        run.wait_for(lambda: len(run.rows()) >= rows + 2)  # the run goes on without it
        assert run.rows()[-1]["ray/node1_groups"] == delivered  # ... and it delivers nothing more
    finally:
        summary = run.interrupt()
    assert summary["ray/node1_drained"] == 1 and summary["ray/node1_lost"] == 0
    assert summary["ray/node1_lost_groups"] == 0 and summary["rollout/lost_groups"] == 0
    assert summary["ray/node1_written_off"] == 0


def test_a_drain_names_a_generator_node_of_a_cluster_ray_run(tmp_path):
    (tmp_path / "config.yaml").write_text("cluster:\n  ray:\n    enabled: true\n    nodes:\n"
                                          "    - {role: trainer}\n    - {role: generator}\n")

    def drain(*args):
        return subprocess.run([sys.executable, "-m", "scripts.ray_drain", *args], cwd=ROOT,
                              capture_output=True, text=True, timeout=60)

    refused = drain(str(tmp_path), "0")
    assert refused.returncode == 1 and refused.stderr.strip() \
        == "error: node 0 is not a generator node of that run (its generator nodes: 1)"
    assert drain(str(tmp_path / "nowhere"), "1").stderr.strip().startswith(
        f"error: {tmp_path / 'nowhere'} is not a run's folder")
    assert drain(str(tmp_path), "1").returncode == 0
    assert (tmp_path / "ray" / "drain_node1").exists()


@pytest.mark.slow
def test_a_link_taken_down_between_two_network_stacks_and_the_run_finishes(tiny_model_dir, tmp_path,
                                                                            two_hosts):
    """Machine B's link goes down mid-run (`ip link set ... down`, the closest thing here to a machine cut
    off): its node is fenced, then lost once Ray's health checks give it up, and the trainer node's own
    worker carries the run to its last step."""
    pytest.importorskip("ray")
    (a, a_ip), (b, _) = two_hosts
    ray_cli = [sys.executable, "-m", "ray.scripts.scripts"]
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0")

    def on(host, *cmd, timeout=120):
        return subprocess.run(["ip", "netns", "exec", host, *cmd], cwd=ROOT, capture_output=True, text=True,
                              timeout=timeout, env=env, preexec_fn=die_with_parent)

    run = None
    ray_before = _ray_processes()
    try:
        head = on(a, *ray_cli, "start", "--head", "--port=6379", "--num-cpus=1", "--disable-usage-stats")
        assert head.returncode == 0, head.stderr[-3000:]
        node = on(b, *ray_cli, "start", f"--address={a_ip}:6379", "--num-cpus=1")
        assert node.returncode == 0, node.stderr[-3000:]
        run = _LongRun(tmp_path, tiny_model_dir, "[{role: trainer, cores: 1, rollout_workers: 1, "
                       "trainer_ranks: 1}, {role: generator, cores: 1}]", "cluster.ray.address=auto",
                       "cluster.ray.node_deadline_s=5", steps=600, prefix=("ip", "netns", "exec", a))
        run.wait_for(lambda: run.rows() and run.rows()[-1]["ray/node1_groups"] >= 1)
        _ip("-n", b, "link", "set", f"{b[:-1]}vb", "down")
        run.wait_for(lambda: run.said("warning: generator node 1 fenced"))  # before the run's last step
        run.wait_for(lambda: run.proc.poll() is not None, running=False)
        run.reader.join(timeout=30)
        assert run.proc.returncode == 0, "".join(run.lines)[-3000:]
    finally:
        if run is not None and run.proc.poll() is None:
            run.proc.kill()
        for host in (b, a):
            on(host, *ray_cli, "stop", "--force", timeout=120)
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["steps"] == 600 and summary["ray/node1_fences"] >= 1
    deadline = time.time() + 60  # `ray stop` returns before its processes are gone: wait for that state
    while _ray_processes() - ray_before and time.time() < deadline:
        time.sleep(0.2)
    assert not _ray_processes() - ray_before and shm_files() <= run.before


def _blocks(language: str) -> list[str]:
    text = (Path(ROOT) / "docs" / "cluster.md").read_text()
    return [block.split("```", 1)[0] for block in text.split(f"```{language}\n")[1:]]


def _train_overrides(command: str) -> list[str]:
    """The overrides of the `python train.py ...` in `command` (a shell line), as the shell splits them."""
    words = shlex.split(command.replace("\\\n", " "))
    return words[words.index("train.py") + 1:]


def test_the_cluster_docs_examples_parse_and_their_runs_compose():
    """docs/cluster.md's KubeRay RayJob is a RayJob whose head and worker groups reserve the cores its
    nodes ask for; its Slurm script passes `bash -n`; every train.py line in the page composes to a valid
    cluster=ray config (launch/config.py, as train.py would)."""
    import yaml

    from launch.config import compose, parse

    (rayjob,) = [yaml.safe_load(block) for block in _blocks("yaml")]
    assert rayjob["apiVersion"] == "ray.io/v1" and rayjob["kind"] == "RayJob"
    spec = rayjob["spec"]
    head, (workers,) = spec["rayClusterSpec"]["headGroupSpec"], spec["rayClusterSpec"]["workerGroupSpecs"]
    commands = [spec["entrypoint"]]
    for block in _blocks("bash"):
        checked = subprocess.run(["bash", "-n"], input=block, text=True, capture_output=True)
        assert checked.returncode == 0, checked.stderr
        commands += [line for line in block.replace("\\\n", " ").splitlines() if "train.py" in line]
    assert len(commands) == 4  # by hand, a job, KubeRay, Slurm
    for command in commands:
        cfg = parse(compose([o for o in _train_overrides(command) if not o.startswith("hydra.")]))
        assert cfg.cluster.ray.enabled and cfg.cluster.ray.address
    cfg = parse(compose([o for o in _train_overrides(spec["entrypoint"]) if not o.startswith("hydra.")]))
    generators = cfg.cluster.ray.generator_nodes
    assert int(head["rayStartParams"]["num-cpus"]) == cfg.cluster.ray.trainer_node.cores
    assert workers["replicas"] == len(generators)
    assert {int(workers["rayStartParams"]["num-cpus"])} == {n.cores for n in generators}


@pytest.mark.slow
def test_a_run_submitted_as_a_ray_job_runs_from_the_uploaded_code(tiny_model_dir, tmp_path):
    """docs/cluster.md's submission against a head on this machine: `JobSubmissionClient.submit_job` with
    the repository as working_dir (what `ray job submit --working-dir .` does): the job's train.py runs in
    the uploaded copy, and the generator node's agent imports ringrl from it (ray_nodes.py passes no
    PYTHONPATH inside a job)."""
    pytest.importorskip("ray")
    pytest.importorskip("aiohttp", reason="the dashboard needs ray[default] (requirements-ray.txt)")
    from ray.job_submission import JobStatus, JobSubmissionClient

    from launch.plan import free_port

    ray_cli = [sys.executable, "-m", "ray.scripts.scripts"]
    env = dict(os.environ, RAY_USAGE_STATS_ENABLED="0",
               PATH=f"{os.path.dirname(sys.executable)}:{os.environ['PATH']}")  # the job's `python` is ours
    port, dashboard = free_port(), free_port()
    before, ray_before = shm_files(), _ray_processes()
    run = tmp_path / "run"
    try:
        head = subprocess.run([*ray_cli, "start", "--head", f"--port={port}", f"--dashboard-port={dashboard}",
                               "--include-dashboard=true", "--node-ip-address=127.0.0.1", "--num-cpus=2",
                               "--disable-usage-stats"], cwd=tmp_path, capture_output=True, text=True,
                              timeout=180, env=env)
        assert head.returncode == 0, head.stderr[-3000:]
        client = JobSubmissionClient(f"http://127.0.0.1:{dashboard}")
        nodes = ("[{role: trainer, cores: 1, rollout_workers: 0, trainer_ranks: 1}, "
                 "{role: generator, cores: 1, rollout_workers: 1}]")
        entrypoint = " ".join(shlex.quote(word) for word in [
            "python", "train.py", "cluster=ray", "cluster.ray.address=auto", f"cluster.ray.nodes={nodes}",
            f"model.path={tiny_model_dir}", f"hydra.run.dir={run}", "steps=2", "eval.every=0",
            "checkpoint.at_end=false", "progress=false", "curves=false", *TINY])
        job = client.submit_job(entrypoint=entrypoint,
                                runtime_env={"working_dir": ROOT, "excludes": [".git"]})
        deadline = time.time() + 400  # a bound on a hang, not a timing
        while client.get_job_status(job) not in {JobStatus.SUCCEEDED, JobStatus.FAILED, JobStatus.STOPPED}:
            assert time.time() < deadline, client.get_job_logs(job)[-3000:]
            time.sleep(0.5)
        logs = client.get_job_logs(job)
        assert client.get_job_status(job) == JobStatus.SUCCEEDED, logs[-3000:]
    finally:
        subprocess.run([*ray_cli, "stop", "--force"], capture_output=True, timeout=120, env=env)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["steps"] == 2 and summary["ray/node1_groups"] >= 2 * 2
    config = (run / "config.yaml").read_text()
    assert f"path: {tiny_model_dir}" in config
    deadline = time.time() + 60  # `ray stop` returns before its processes are gone: wait for that state
    while _ray_processes() - ray_before and time.time() < deadline:
        time.sleep(0.2)
    assert not _ray_processes() - ray_before and shm_files() <= before


def test_gpus_go_on_generator_nodes_with_one_rollout_worker_per_engine():
    from launch.config import compose, parse

    def nodes(trainer_gpus: int, gpus: int, workers: int, *more: str):
        return parse(compose(["cluster=ray", *more, "cluster.ray.nodes=[{role: trainer, "
                              f"gpus: {trainer_gpus}, rollout_workers: 0, trainer_ranks: 1}}, "
                              f"{{role: generator, gpus: {gpus}, rollout_workers: {workers}}}]"]))

    assert nodes(0, 2, 2).cluster.ray.nodes[1].gpus == 2
    assert nodes(0, 4, 2, "cluster.tp_size=2").cluster.ray.nodes[1].rollout_workers == 2
    with pytest.raises(ValueError, match=r"cluster.ray.nodes\[0\].gpus.*must be 0 on the trainer node"):
        nodes(1, 1, 1)
    with pytest.raises(ValueError, match=r"nodes\[1\].rollout_workers.*must be 2 on a node of 2 GPUs"):
        nodes(0, 2, 1)


@pytest.mark.slow
def test_a_gpu_plan_generator_node_feeds_the_trainer_node(tiny_model_dir, tmp_path):
    """A generator node with `gpus: 1` runs the GPU plan's generation (launch/agent.py gpu_generation: the
    built-in engine's static decode step, each version shipped on to it in buckets), here with
    cluster.device=cpu, the GPU plan's classes on the CPU; it feeds the trainer node for 4 steps."""
    pytest.importorskip("ray")
    before, ray_before = shm_files(), _ray_processes()
    result = run_train(tmp_path, f"model.path={tiny_model_dir}", "cluster=ray", "cluster.device=cpu",
                       "cluster.ray.nodes=[{role: trainer, cores: 1, rollout_workers: 0, trainer_ranks: 1}, "
                       "{role: generator, cores: 1, gpus: 1, rollout_workers: 1}]", "steps=4",
                       "max_staleness=1", "eval.every=0", "checkpoint.at_end=false", *TINY, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "note: generator node 1 runs the GPU plan's generation: 1 builtin engine(s) on cpu" \
        in result.stderr
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and max(r["staleness_max"] for r in rows) <= 1
    assert summary["ray/node1_groups"] >= 4 * 2 and summary["ray/node1_lost"] == 0
    # each version went to the node and on to its engine: its tokens were sampled by new weights
    assert summary["ray/broadcasts"] >= 2 and summary["ray/node1_newest_version"] >= 1
    _nothing_left(ray_before, before)
