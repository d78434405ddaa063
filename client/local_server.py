"""Start an `art-server` on this machine, in a subprocess on a free loopback port.

For scripts, demos, benchmarks and tests that want a real server without a GPU box. The server
is a separate process exactly as in production; nothing here imports torch.
"""

from __future__ import annotations

import errno
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import IO, Sequence

import httpx

ROOT = Path(__file__).resolve().parents[1]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class LocalServer:
    def __init__(self, data_dir: Path, model: Path | str | None = None, api_key: str | None = None,
                 extra: Sequence[str] = (), log: Path | None = None, port: int | None = None,
                 env: dict[str, str] | None = None, python: str | None = None, host: str = "127.0.0.1",
                 launcher: Sequence[str] = ()):
        """`launcher`: a command the server runs under (`ip netns exec NODE`, `taskset -c 0`); `host`
        the address it binds, and `url`'s."""
        self.data_dir, self.model, self.api_key, self.extra = Path(data_dir), model, api_key, list(extra)
        self.host, self.launcher = host, list(launcher)
        self.env = env or {}
        self.python = python or sys.executable  # a client-only environment points at the server's own
        self.port = port or free_port()
        self._port_is_ours = port is None  # ours to change if another process holds it at start
        self.log_path = log or self.data_dir / f"server-{self.port}.log"
        self.proc: subprocess.Popen | None = None
        self._log: IO[bytes] | None = None
        self._killed = False  # by kill(): a crash the caller provoked, not one to report

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"

    def start(self, timeout: float = 180) -> "LocalServer":
        # A launcher may run the server in another network namespace, where this process cannot bind.
        listener = None if self.launcher else self._listener()
        where = ["--fd", str(listener.fileno())] if listener else ["--host", self.host, "--port", str(self.port)]
        cmd = [*self.launcher, self.python, "-m", "server.cli", *where, "--data-dir", str(self.data_dir),
               "--log-level", "warning", *self.extra]
        if self.model:
            cmd += ["--model", str(self.model)]
        env = {**os.environ, **self.env}
        env.pop("ARTISAN_API_KEY", None)
        if self.api_key:
            env["ARTISAN_API_KEY"] = self.api_key
        self.data_dir.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        self.proc = self._spawn(cmd, env, listener)
        if listener:
            listener.close()  # the server holds its own copy
        deadline = time.time() + timeout
        while time.time() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"art-server exited with {self.proc.returncode}:\n{self._log_tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=1).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"art-server did not answer /health within {timeout:.0f}s:\n{self._log_tail()}")

    def _spawn(self, cmd: list[str], env: dict[str, str], listener: socket.socket | None) -> subprocess.Popen:
        assert self._log is not None
        return subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                pass_fds=[listener.fileno()] if listener else ())

    def _listener(self) -> socket.socket:
        """The server's socket, listening already, for it to inherit. A port only named on the command
        line stays free until the server binds it, seconds later, after its imports; another process
        (a server started beside this one) can take it in between. This one is held from the start.
        (create_server sets SO_REUSEADDR: a restart binds the port its predecessor left in TIME_WAIT.)"""
        family = socket.AF_INET6 if ":" in self.host else socket.AF_INET
        try:
            return socket.create_server((self.host, self.port), family=family)
        except OSError as e:
            if e.errno != errno.EADDRINUSE or not self._port_is_ours:
                raise
        sock = socket.create_server((self.host, 0), family=family)
        self.port = sock.getsockname()[1]
        return sock

    def _log_tail(self) -> str:
        # Quoted, not pointed to: the log may be in a scratch directory that is removed next.
        return self.log_path.read_text(errors="replace")[-3000:]

    def wait_exit(self, timeout: float = 120) -> int:
        """Wait for the server to end on its own (a crash the test provoked)."""
        assert self.proc is not None
        return self.proc.wait(timeout=timeout)

    def kill(self) -> None:
        """SIGKILL: no shutdown code runs, as in a crash."""
        if self.proc and self.proc.poll() is None:
            self._killed = True
            self.proc.kill()
            self.proc.wait()

    def died(self) -> str | None:
        """Why the server stopped on its own while it was in use, with the end of its log; None if it
        is running, stopped cleanly, or was stopped by this object. A client sees only refused
        connections when its server dies (the kernel's out-of-memory killer sends SIGKILL)."""
        code = self.proc.poll() if self.proc else None
        if code in (None, 0) or self._killed:
            return None
        how = f"was killed by {signal.Signals(-code).name}" if code < 0 else f"exited with {code}"
        oom = (" (SIGKILL from outside is most often the kernel's out-of-memory killer)"
               if code == -signal.SIGKILL else "")
        return f"art-server {how} while in use{oom}; the end of its log:\n{self._log_tail()}"

    def stop(self) -> None:
        if (cause := self.died()) is not None:
            print(cause, file=sys.stderr, flush=True)
        if self.proc and self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=15)
            except subprocess.TimeoutExpired:
                self.kill()
        if self._log:
            self._log.close()
            self._log = None

    def __enter__(self) -> "LocalServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
