"""Fixtures that start a real art-server on a loopback port and talk to it over HTTP."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import threading
import time
from pathlib import Path

import pytest

from client.local_server import ROOT, LocalServer, free_port  # noqa: F401  (free_port: used by tests)

# ART's client lives in an environment of its own (`make test-art`); the main suite leaves it out.
# vLLM runs from an environment of its own too (`make test-vllm` names its Python), and so do
# verifiers and reasoning-gym (`make test-verifiers`), and tau2-bench (`make test-tau2`).
# The SmolLM2 learning regression test trains for minutes: `make test-learn` runs it on its own.
collect_ignore = ([] if importlib.util.find_spec("art") else ["art_client"]) + \
    ([] if os.environ.get("ARTISAN_VLLM_PYTHON") else ["vllm_engine"]) + \
    ([] if importlib.util.find_spec("verifiers") else ["verifiers_env"]) + \
    ([] if importlib.util.find_spec("tau2") else ["tau2_env"]) + \
    ([] if os.environ.get("ARTISAN_LEARNING_TESTS") else ["learning"]) + \
    ([] if os.environ.get("ARTISAN_RAY_TESTS") else ["ray"])

os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
# Passive OpenMP waits: tests run torch in-process beside server subprocesses on 2 cores.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


@contextlib.contextmanager
def serve_in_thread(app):
    """`app` served by uvicorn in this process on a free loopback port (for tests that reach into
    the server's own objects); yields the port."""
    import uvicorn

    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="critical"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(timeout=30)


class ServerProcess(LocalServer):
    """`art-server` in a subprocess, as a user runs it (on the CPU)."""

    def __init__(self, data_dir: Path, model: Path | None = None, api_key: str | None = None,
                 extra: list[str] | None = None, env: dict[str, str] | None = None, port: int | None = None):
        super().__init__(data_dir, model, api_key, ["--device", "cpu", *(extra or [])], env=env, port=port)


@pytest.fixture(scope="session")
def server(tmp_path_factory):
    """One shared server on the embedded model for the read-mostly tests."""
    srv = ServerProcess(tmp_path_factory.mktemp("shared-server")).start()
    yield srv
    srv.stop()


def _server_factory(root: Path):
    servers: list[ServerProcess] = []

    def make(**kw) -> ServerProcess:
        srv = ServerProcess(kw.pop("data_dir", root / f"data{len(servers)}"), **kw)
        servers.append(srv)
        return srv.start()

    return make, servers


@pytest.fixture
def fresh_server(tmp_path):
    """A server of the test's own (for tests that kill it or change its state)."""
    make, servers = _server_factory(tmp_path)
    yield make
    for s in servers:
        s.stop()


@pytest.fixture(scope="module")
def fresh_server_module(tmp_path_factory):
    """Servers of a test module's own."""
    make, servers = _server_factory(tmp_path_factory.mktemp("module-servers"))
    yield make
    for s in servers:
        s.stop()
