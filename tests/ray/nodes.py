"""A Ray cluster of two nodes on this one machine: each node in a network namespace of its own,
with its own address, the two joined by a virtual switch that the test process (in the machine's
own namespace) is plugged into as well.

    switch (bridge) 10.77.0.254: this process
      ├── head    10.77.0.1: the Ray head; art-server and client.train run here too
      └── worker  10.77.0.2: a Ray worker node

Ray sees two machines: each node's processes bind and advertise its own address, and traffic
between them crosses the link, never loopback. Killing every process in the worker's namespace
is a node lost. It needs root (`ip netns`); `make test-ray-nodes` runs it.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time

from client.local_server import ROOT

VENV_BIN = ROOT / ".venv" / "bin"
SUBNET = "10.77.0"
SWITCH_ADDRESS = f"{SUBNET}.254"
RAY_PORT = 6379


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


def can_make_nodes() -> str | None:
    """Why this machine cannot make the two nodes, or None when it can."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "the `ip` command (iproute2) is not installed"
    probe = f"artisan-probe-{os.getpid()}"
    try:
        _ip("netns", "add", probe)
    except subprocess.CalledProcessError as exc:
        return f"cannot create a network namespace: {exc.stderr.strip()}"
    _ip("netns", "del", probe)
    return None


class TwoNodes:
    """`with TwoNodes(cpus=6) as nodes:` the cluster up, torn down whole on exit."""

    def __init__(self, cpus: int):
        self.cpus = cpus  # logical CPUs per node: Ray schedules by them; the real cores are shared
        tag = f"{os.getpid() % 10000}"
        self.switch = f"artbr{tag}"
        self.namespaces = {"head": f"art-head-{tag}", "worker": f"art-worker-{tag}"}
        self.addresses = {"head": f"{SUBNET}.1", "worker": f"{SUBNET}.2"}
        self.ray_address = f"{self.addresses['head']}:{RAY_PORT}"
        # Short: Ray's sockets live under it, and a Unix socket path has at most 107 characters.
        self.temp = tempfile.mkdtemp(prefix="ray2n-")
        # RAY_worker_niceness: as the README's `ray start` lines set it
        self.env = {**os.environ, "RAY_AUTH_MODE": "disabled", "OMP_WAIT_POLICY": "PASSIVE",
                    "RAY_USAGE_STATS_ENABLED": "0", "RAY_worker_niceness": "0"}

    def on(self, node: str) -> list[str]:
        """The command prefix that runs a command on `node`."""
        return ["ip", "netns", "exec", self.namespaces[node]]

    def __enter__(self) -> "TwoNodes":
        try:
            self._link()
            self._ray("head", "--head", "--port", str(RAY_PORT), "--include-dashboard", "false")
            self._ray("worker", "--address", self.ray_address)
            self.wait_for_nodes(2)
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        for node in ("worker", "head"):
            self.kill(node)
        for node, ns in self.namespaces.items():
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
            subprocess.run(["ip", "link", "del", self._port(node)], capture_output=True)
        subprocess.run(["ip", "link", "del", self.switch], capture_output=True)
        shutil.rmtree(self.temp, ignore_errors=True)

    def _link(self) -> None:
        _ip("link", "add", self.switch, "type", "bridge")
        _ip("addr", "add", f"{SWITCH_ADDRESS}/24", "dev", self.switch)
        _ip("link", "set", self.switch, "up")
        for node, ns in self.namespaces.items():
            port = self._port(node)
            _ip("netns", "add", ns)
            _ip("link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", ns)
            _ip("link", "set", port, "master", self.switch, "up")
            _ip("-n", ns, "addr", "add", f"{self.addresses[node]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            _ip("-n", ns, "route", "add", "default", "via", SWITCH_ADDRESS)

    def _port(self, node: str) -> str:
        """The switch's end of `node`'s link."""
        return f"{self.switch}{node[0]}"

    def _ray(self, node: str, *args: str) -> None:
        cmd = [*self.on(node), str(VENV_BIN / "ray"), "start", "--node-ip-address", self.addresses[node],
               "--num-cpus", str(self.cpus), "--temp-dir", self.temp, "--disable-usage-stats", *args]
        proc = subprocess.run(cmd, env=self.env, capture_output=True, text=True, timeout=180)
        if proc.returncode != 0:
            raise RuntimeError(f"ray start on {node} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")

    def run(self, node: str, code: str, timeout: float = 120) -> object:
        """A Python snippet run as a Ray driver on `node`; what it prints last, as JSON."""
        proc = subprocess.run([*self.on(node), str(VENV_BIN / "python"), "-c", code], env=self.env, cwd=ROOT,
                              capture_output=True, text=True, timeout=timeout)
        if proc.returncode != 0:
            raise RuntimeError(f"on {node}: {proc.stderr[-3000:]}")
        return json.loads(proc.stdout.strip().splitlines()[-1])

    def alive_nodes(self) -> list[str]:
        return self.run("head", f"""
import json, ray
ray.init(address={self.ray_address!r}, log_to_driver=False)
print(json.dumps(sorted(n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"])))""")

    def wait_for_nodes(self, count: int, timeout: float = 120) -> None:
        deadline = time.monotonic() + timeout
        while len(alive := self.alive_nodes()) != count:
            if time.monotonic() > deadline:
                raise RuntimeError(f"{count} live Ray nodes wanted, {alive} after {timeout:.0f} s")
            time.sleep(2)

    def pids(self, node: str) -> list[int]:
        out = subprocess.run(["ip", "netns", "pids", self.namespaces[node]], capture_output=True, text=True)
        return [int(p) for p in out.stdout.split()]

    def kill(self, node: str) -> int:
        """SIGKILL every process on `node`, as a machine that loses power; how many there were."""
        pids = self.pids(node)
        for pid in pids:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        return len(pids)
