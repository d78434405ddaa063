"""Fixtures that start a real art-server on a loopback port and talk to it over HTTP."""

from __future__ import annotations

import asyncio
import importlib.util
import os
from pathlib import Path

import pytest

from client.local_server import ROOT, LocalServer, free_port  # noqa: F401  (ROOT, free_port: used by tests)

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


def pytest_configure(config):
    config.addinivalue_line("markers", "unit: needs no art-server process and no real model weights; "
                                       "`make test-fast` runs these first (`-m unit`), `make test-slow` the rest")
    if config.option.markexpr == "unit":
        _refuse_servers_and_weights()


_unit_guard = pytest.MonkeyPatch()


def _refuse_servers_and_weights() -> None:
    """The unit tier is fast because nothing in it starts art-server or loads a real model: a test
    marked `unit` that does fails, saying what it did, rather than slowing the tier down."""
    import tests.real_models as real_models

    def refuse(what: str):
        def refused(*args, **kwargs):
            raise RuntimeError(f"a test marked unit {what}: it belongs in `make test-slow` (drop its mark)")
        return refused

    _unit_guard.setattr(LocalServer, "start", refuse("started art-server"))
    for name in ("smollm2_gguf", "gemma3_gguf", "converted"):
        _unit_guard.setattr(real_models, name, refuse("asked for real model weights"))


def pytest_unconfigure(config):
    _unit_guard.undo()


class _StrayExceptionsLogged(asyncio.SelectorEventLoop):
    """An event loop that logs an exception no one awaited, as asyncio.run's loop does, where
    anyio's test runner would raise it in whichever test is running: an SDK client that the
    garbage collector closes during a later test (on that test's loop) is one, and not that test's."""

    def set_exception_handler(self, handler) -> None:
        super().set_exception_handler(None)


@pytest.fixture(scope="session", autouse=True)
def anyio_backend():
    """anyio's pytest plugin (installed with httpx in every test environment) runs each `async def`
    test on an asyncio loop of its own, as asyncio.run did (a module's async fixture keeps one loop
    for that module's tests). Autouse: every test asks for it, so a coroutine test needs no marker
    and an async fixture also serves a plain test."""
    return "asyncio", {"loop_factory": _StrayExceptionsLogged}


class ServerProcess(LocalServer):
    """`art-server` in a process of its own, as a user runs it (on the CPU): `python -m server.cli`,
    forked from this worker's fork server (tests/forkserver.py), which has done its imports already.
    ARTISAN_TEST_FORK=0 starts each one as a new interpreter instead."""

    def __init__(self, data_dir: Path, model: Path | None = None, api_key: str | None = None,
                 extra: list[str] | None = None, env: dict[str, str] | None = None, port: int | None = None):
        super().__init__(data_dir, model, api_key, ["--device", "cpu", *(extra or [])], env=env, port=port)

    def _spawn(self, cmd, env, listener):
        if os.environ.get("ARTISAN_TEST_FORK") == "0" or listener is None:
            return super()._spawn(cmd, env, listener)
        assert cmd[:3] == [self.python, "-m", "server.cli"] and cmd[3] == "--fd", cmd
        from tests import forkserver  # here: ART's environments have a `tests` package of their own

        return forkserver.shared(ROOT).spawn("server.cli", ["--fd", "{listener}", *cmd[5:]], env, ROOT,
                                             self._log.fileno(), listener.fileno())


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
