"""The tests' fork server starts art-server as `python -m server.cli` would: with the caller's
environment and log, answering, and ending with the status a Popen would report."""

from __future__ import annotations

import os
import signal
import socket
import time

import httpx

from tests import forkserver
from tests.conftest import ROOT


def test_a_forked_art_server_serves_and_its_end_reads_as_popen_would(fresh_server):
    # the key reaches the server only in its environment (ARTISAN_API_KEY), which the fork server's lacks
    assert "ARTISAN_API_KEY" not in os.environ
    server = fresh_server(api_key="k-forked")
    assert isinstance(server.proc, forkserver.ForkedProcess) and server.proc.pid != os.getpid()
    chat = {"model": "artisan-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    assert httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=60).status_code == 401
    reply = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=60,
                       headers={"Authorization": "Bearer k-forked"})
    assert reply.status_code == 200, reply.text
    server.proc.send_signal(signal.SIGKILL)
    assert server.proc.wait(timeout=30) == -signal.SIGKILL
    assert "killed by SIGKILL" in server.died()

    try:
        fresh_server(extra=["--no-such-option"])
    except RuntimeError as e:
        assert "art-server exited with 2" in str(e) and "No such option: --no-such-option" in str(e)
    else:
        raise AssertionError("a bad option started a server")


def test_a_server_a_test_left_running_ends_with_its_fork_server(tmp_path):
    fork = forkserver.ForkServer(ROOT)
    listener = socket.create_server(("127.0.0.1", 0))
    with open(tmp_path / "log", "ab") as log:
        proc = fork.spawn("server.cli", ["--fd", "{listener}", "--data-dir", str(tmp_path / "data"), "--device", "cpu"],
                          dict(os.environ), ROOT, log.fileno(), listener.fileno())
    listener.close()
    assert proc.poll() is None
    fork.close()
    deadline = time.time() + 60
    while time.time() < deadline:
        try:
            os.kill(proc.pid, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    state = open(f"/proc/{proc.pid}/stat").read()
    os.kill(proc.pid, signal.SIGKILL)
    raise AssertionError(f"the server outlived its fork server by 60 s: {state[:120]}")
