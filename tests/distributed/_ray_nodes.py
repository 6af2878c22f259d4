"""A real multi-node Ray cluster on one machine: `ray start --head` plus more `ray start
--address ...` nodes, each its own raylet with its own resources, as on separate machines.

Every process started here is ended here, by id: each `ray start --block` runs in its own
session, and a node is killed (or stopped) by signalling its process group and every process
descended from it (the raylet's workers run in process groups of their own). The cluster uses
its own temp dir, ports and a fresh token (token authentication, as Ray 2.60 enables by
default), so it neither finds nor disturbs other Ray clusters on the machine.
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

RAY = Path(sys.executable).with_name("ray")

# The head notices a dead node within about 3 s instead of Ray's default 30 s or so.
FAST_HEALTH_CHECKS = {
    "RAY_health_check_period_ms": "1000",
    "RAY_health_check_timeout_ms": "1000",
    "RAY_health_check_failure_threshold": "3",
}


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _stat(pid: int) -> tuple[int, int] | None:
    """(parent pid, start time in clock ticks) of a live process, from /proc."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return int(fields[1]), int(fields[19])


def descendants(pid: int) -> dict[int, int]:
    """Every live process below `pid`: pid -> its start time (which tells a pid reused later
    from the process seen now)."""
    children: dict[int, list[tuple[int, int]]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            stat = _stat(int(entry.name))
            if stat is not None:
                children.setdefault(stat[0], []).append((int(entry.name), stat[1]))
    found: dict[int, int] = {}
    stack = [pid]
    while stack:
        for child, started in children.get(stack.pop(), []):
            found[child] = started
            stack.append(child)
    return found


@dataclass
class Node:
    name: str
    resources: dict[str, float]
    process: subprocess.Popen
    log: Path
    # processes seen below it (its raylet and its workers): pid -> start time
    family: dict[int, int] = field(default_factory=dict)

    def remember_family(self) -> None:
        self.family.update(descendants(self.process.pid))

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """The whole node at once, as when its machine dies: the `ray start` process, its
        session, and every process seen below it (a worker outlives its raylet for a moment,
        reparented; one is signalled only while it is the same process, by its start time)."""
        self.remember_family()
        with contextlib.suppress(ProcessLookupError):
            os.killpg(self.process.pid, sig)
        for pid, started in sorted(self.family.items()):
            stat = _stat(pid)
            if stat is not None and stat[1] == started:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.process.wait(timeout=30)


class LocalCluster:
    """Head + worker nodes on this machine. `env()` is what a driver needs to connect."""

    def __init__(self, root: Path):
        self.root = root
        self.temp_dir = root / "ray"
        self.token = root / "ray-token"
        root.mkdir(parents=True, exist_ok=True)
        self.token.write_text(secrets.token_hex(32))
        self.token.chmod(0o600)
        self.port = free_port()
        self.address = f"127.0.0.1:{self.port}"
        self.nodes: list[Node] = []

    def env(self) -> dict[str, str]:
        repo = str(Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env.pop("RAY_ADDRESS", None)
        env.update(
            RAY_AUTH_MODE="token",
            RAY_AUTH_TOKEN_PATH=str(self.token),
            RAY_USAGE_STATS_ENABLED="0",
            PYTHONPATH=repo + os.pathsep + env.get("PYTHONPATH", ""),
            HF_HUB_OFFLINE="1",
        )
        return env

    def _start(
        self, name: str, args: list[str], resources: dict[str, float], env: dict[str, str]
    ) -> Node:
        log = self.root / f"{name}.log"
        command = [
            str(RAY),
            "start",
            *args,
            "--node-ip-address=127.0.0.1",
            f"--resources={json.dumps(resources)}",
            f"--dashboard-agent-listen-port={free_port()}",
            "--disable-usage-stats",
            "--block",
        ]
        with log.open("wb") as out:
            process = subprocess.Popen(
                command, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
            )
        node = Node(name, resources, process, log)
        self.nodes.append(node)
        return node

    def start_head(self, resources: dict[str, float], num_cpus: int) -> Node:
        env = {**self.env(), **FAST_HEALTH_CHECKS}
        return self._start(
            "head",
            [
                "--head",
                f"--port={self.port}",
                f"--num-cpus={num_cpus}",
                f"--temp-dir={self.temp_dir}",
                "--include-dashboard=false",
                f"--dashboard-port={free_port()}",
            ],
            resources,
            env,
        )

    def add_node(self, name: str, resources: dict[str, float], num_cpus: int) -> Node:
        return self._start(
            name, [f"--address={self.address}", f"--num-cpus={num_cpus}"], resources, self.env()
        )

    def query_nodes(self, timeout_s: float = 120.0) -> list[dict]:
        """ray.nodes() as a driver on this cluster sees it (in a child process: this test
        process may hold another Ray session)."""
        script = (
            "import json, ray\n"
            f"ray.init(address={self.address!r}, log_to_driver=False)\n"
            "print('NODES ' + json.dumps([{k: n[k] for k in ('NodeID', 'Alive', 'Resources')} "
            "for n in ray.nodes()]))\n"
        )
        out = subprocess.run(
            [sys.executable, "-c", script],
            env=self.env(),
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
        for line in out.stdout.splitlines():
            if line.startswith("NODES "):
                return json.loads(line[len("NODES ") :])
        raise RuntimeError(f"could not list the cluster's nodes:\n{out.stdout}\n{out.stderr}")

    def wait_for_nodes(self, count: int, timeout_s: float = 180.0) -> dict[str, str]:
        """Blocks until `count` nodes are alive; returns resource name -> node id for the
        custom resources the nodes were started with."""
        deadline = time.monotonic() + timeout_s
        while True:
            for node in self.nodes:
                if node.process.poll() is not None:
                    raise RuntimeError(f"{node.name} exited:\n{node.log.read_text()[-3000:]}")
            try:
                nodes = [n for n in self.query_nodes() if n["Alive"]]
            except (RuntimeError, subprocess.TimeoutExpired):
                nodes = []
            if len(nodes) >= count:
                for node in self.nodes:
                    node.remember_family()
                return {
                    resource: n["NodeID"]
                    for n in nodes
                    for node in self.nodes
                    for resource in node.resources
                    if resource in n["Resources"]
                }
            if time.monotonic() > deadline:
                raise RuntimeError(f"{len(nodes)} of {count} Ray nodes up after {timeout_s:.0f} s")
            time.sleep(2)

    def stop(self) -> None:
        """Every node, the head last: SIGTERM, then SIGKILL to what is left."""
        for node in reversed(self.nodes):
            node.remember_family()
            if node.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(node.process.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        for node in self.nodes:
            with contextlib.suppress(subprocess.TimeoutExpired):
                node.process.wait(timeout=max(0.1, deadline - time.monotonic()))
        for node in reversed(self.nodes):
            node.kill()
        shutil.rmtree(self.temp_dir, ignore_errors=True)
