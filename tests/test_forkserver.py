"""The tests' fork server starts art-server as `python -m server.cli` would: with the caller's
environment and log, answering, and ending with the status a Popen would report."""

from __future__ import annotations

import os
import signal

import httpx

from tests import forkserver
from tests.conftest import ServerProcess


def test_a_forked_art_server_serves_and_its_end_reads_as_popen_would(tmp_path):
    # the key reaches the server only in its environment (ARTISAN_API_KEY), which the fork server's lacks
    assert "ARTISAN_API_KEY" not in os.environ
    server = ServerProcess(tmp_path / "data", api_key="k-forked").start()
    assert isinstance(server.proc, forkserver.ForkedProcess) and server.proc.pid != os.getpid()
    chat = {"model": "artisan-tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4}
    assert httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=60).status_code == 401
    reply = httpx.post(server.url + "/v1/chat/completions", json=chat, timeout=60,
                       headers={"Authorization": "Bearer k-forked"})
    assert reply.status_code == 200, reply.text
    server.proc.send_signal(signal.SIGKILL)
    assert server.proc.wait(timeout=30) == -signal.SIGKILL
    assert "killed by SIGKILL" in server.died()

    bad = ServerProcess(tmp_path / "bad", extra=["--no-such-option"])
    try:
        bad.start()
    except RuntimeError as e:
        assert "art-server exited with 2" in str(e) and "No such option: --no-such-option" in str(e)
    else:
        raise AssertionError("a bad option started a server")
