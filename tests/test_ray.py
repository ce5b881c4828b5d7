"""cluster=ray on a simulated two-node cluster on this machine (launch/ray_nodes.py, launch/agent.py): a
trainer node and a generator node whose groups are forwarded to it. Needs the optional extra:
pip install -r requirements-ray.txt."""
import json
import os
import shutil
import signal
import subprocess
import sys
import threading
import time

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


def test_gloo_listens_on_the_interface_of_the_node_s_address(monkeypatch):
    """Where the hostname resolves to the loopback, gloo would listen there and a generator node on another
    machine could not join the weight broadcast (the two-network-stack test below failed so): gloo_on points
    it at the interface of the node's Ray address, leaves a simulated cluster's loopback and a user's
    GLOO_SOCKET_IFNAME be, and restores the environment after."""
    from launch.ray_cluster import gloo_on, interface_of

    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    assert interface_of("127.0.0.1") == "lo" and interface_of("203.0.113.254") is None  # TEST-NET-3: nobody's
    with gloo_on("127.0.0.1"):
        assert "GLOO_SOCKET_IFNAME" not in os.environ
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
    with gloo_on(address):
        assert os.environ["GLOO_SOCKET_IFNAME"] == name
    assert "GLOO_SOCKET_IFNAME" not in os.environ
    monkeypatch.setenv("GLOO_SOCKET_IFNAME", "mine")
    with gloo_on(address):
        assert os.environ["GLOO_SOCKET_IFNAME"] == "mine"
    assert os.environ["GLOO_SOCKET_IFNAME"] == "mine"


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
    assert _ray_processes() <= ray_before and shm_files() <= before  # nothing left running, no shared memory


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
    assert _ray_processes() <= ray_before and shm_files() <= before  # nothing left running, no shared memory
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

        def end():  # the machine leaves: its node's processes stopped, whatever of them outlives it killed
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
        return end

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
