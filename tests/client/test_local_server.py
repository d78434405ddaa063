"""LocalServer's start errors, and a server's death while in use, quote the server's log, since the log
may be in a scratch directory that the caller removes as the error unwinds; a port another process took
first is no error."""

from __future__ import annotations

import re
import socket
import stat
import sys

import httpx
import pytest

from client.local_server import LocalServer


def test_a_server_that_exits_at_start_is_reported_with_its_log(tmp_path):
    server = LocalServer(tmp_path / "data", extra=["--no-such-flag"])
    with pytest.raises(RuntimeError, match="(?s)art-server exited with 2:.*No such option: --no-such-flag"):
        server.start(timeout=60)


def test_a_server_that_never_answers_is_stopped_and_reported_with_its_log(tmp_path):
    silent = tmp_path / "silent-python"  # stands in for the interpreter: logs a line, never serves
    silent.write_text("#!/bin/sh\necho 'still loading the model'\nexec sleep 60\n")
    silent.chmod(silent.stat().st_mode | stat.S_IXUSR)
    server = LocalServer(tmp_path / "data", python=str(silent))
    with pytest.raises(RuntimeError, match="(?s)did not answer /health within 1s:.*still loading the model"):
        server.start(timeout=1)
    assert server.proc.poll() is not None


def health_only_python(path, serve: str):
    """A stand-in for the interpreter that answers /health on the socket it is given, `serve` being
    how long: `handle_request()` (once, then it prints a line and exits 3) or `serve_forever()`."""
    path.write_text("#!/bin/sh\n"
                    "echo 'loaded the model'\n"
                    f"exec {sys.executable} -c \"\n"
                    "import http.server, socket, sys\n"
                    "class H(http.server.BaseHTTPRequestHandler):\n"
                    "    def do_GET(self):\n"
                    "        self.send_response(200); self.end_headers()\n"
                    "served = http.server.HTTPServer(None, H, bind_and_activate=False)\n"
                    "served.socket = socket.socket(fileno=int(sys.argv[sys.argv.index('--fd') + 1]))\n"
                    f"served.{serve}\n"
                    "print('out of patience', flush=True)\n"
                    "sys.exit(3)\n"
                    "\" \"$@\"\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_a_server_that_dies_while_in_use_is_reported_with_its_cause_and_log_when_stopped(tmp_path, capsys):
    flaky = health_only_python(tmp_path / "flaky-python", "handle_request()")
    with LocalServer(tmp_path / "data", python=flaky) as server:
        server.proc.wait(timeout=30)
        assert "art-server exited with 3 while in use" in server.died()
    assert re.search("(?s)art-server exited with 3 while in use; the end of its log:.*loaded the model"
                     ".*out of patience", capsys.readouterr().err)


def test_a_server_killed_by_its_caller_or_stopped_cleanly_is_not_reported(tmp_path, capsys):
    serving = health_only_python(tmp_path / "serving-python", "serve_forever()")
    with LocalServer(tmp_path / "a", python=serving) as server:
        server.kill()
        assert server.died() is None
    with LocalServer(tmp_path / "b", python=serving) as server:
        assert server.died() is None
    assert "art-server" not in capsys.readouterr().err


def test_a_port_another_process_took_before_the_start_is_traded_for_a_free_one(tmp_path):
    serving = health_only_python(tmp_path / "serving-python", "serve_forever()")
    server = LocalServer(tmp_path / "data", python=serving)
    with socket.create_server(("127.0.0.1", server.port)):  # a server started beside it, first
        taken = server.port
        with server:
            assert server.port != taken
            assert httpx.get(server.url + "/health", timeout=10).status_code == 200
