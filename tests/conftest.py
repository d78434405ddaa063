"""Fixtures that start a real art-server on a loopback port and talk to it over HTTP."""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class ServerProcess:
    """`art-server` in a subprocess, as a user runs it."""

    def __init__(self, data_dir: Path, model: Path | None = None, api_key: str | None = None, extra: list[str] | None = None):
        self.data_dir, self.model, self.api_key, self.extra = data_dir, model, api_key, extra or []
        self.port = free_port()
        self.proc: subprocess.Popen | None = None
        self.log_path = data_dir / f"server-{self.port}.log"

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 120) -> "ServerProcess":
        cmd = [sys.executable, "-m", "server.cli", "--port", str(self.port), "--data-dir", str(self.data_dir),
               "--device", "cpu", "--log-level", "warning", *self.extra]
        if self.model:
            cmd += ["--model", str(self.model)]
        env = dict(os.environ)
        env.pop("ARTISAN_API_KEY", None)
        if self.api_key:
            env["ARTISAN_API_KEY"] = self.api_key
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self.proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=open(self.log_path, "ab"), stderr=subprocess.STDOUT)
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"art-server exited with {self.proc.returncode}:\n{self.log_path.read_text()[-3000:]}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        raise RuntimeError("art-server did not come up")

    def kill(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait()

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """One shared server on the embedded model for the read-mostly tests."""
    srv = ServerProcess(tmp_path_factory.mktemp("shared-server")).start()
    yield srv
    srv.stop()


@pytest.fixture
def fresh_server(tmp_path):
    """A server of the test's own (for tests that kill it or change its state)."""
    servers: list[ServerProcess] = []

    def make(**kw) -> ServerProcess:
        srv = ServerProcess(kw.pop("data_dir", tmp_path / f"data{len(servers)}"), **kw)
        servers.append(srv)
        return srv.start()

    yield make
    for s in servers:
        s.stop()
