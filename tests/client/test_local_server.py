"""LocalServer's start errors quote the server's log, since the log may be in a scratch directory
that the caller removes as the error unwinds."""

from __future__ import annotations

import stat

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
