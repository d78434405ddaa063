"""art-server processes for the tests, forked from one process that has imported the server already.

A server's start here is mostly imports (torch, transformers and its model classes, the server's
own modules), and `make test-slow` starts some 125 servers: 16.5 s each on average, 2,066 s of its
two workers' 5,340 s (measured on stop 56's code). A forked one answers /health in about 1 s.
One fork server per test worker does those imports once; each server is then a fork of it that runs
`python -m server.cli ARGS` as a fresh interpreter would: its own environment, working directory,
log file as stdout and stderr, and the listening socket its caller made. Nothing is shared between
servers: the fork server itself never loads a model, starts a thread or touches torch's thread pools.

Protocol, over a Unix socket: the caller sends one JSON request (module, argv, env, cwd) with two
file descriptors (log, listener); the fork server answers the child's pid, then, on the same
connection, its exit status when it ends (`subprocess`'s convention: -N for signal N).
"""

from __future__ import annotations

import atexit
import json
import os
import runpy
import select
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from pathlib import Path
from typing import Any

PRELOAD = ("server.app", "uvicorn", "transformers.models.qwen2.modeling_qwen2",
           "transformers.models.llama.modeling_llama", "transformers.models.gemma3.modeling_gemma3")
_HEADER = struct.Struct("!I")


def _send(conn: socket.socket, payload: dict[str, Any], fds: list[int]) -> None:
    data = json.dumps(payload).encode()
    socket.send_fds(conn, [_HEADER.pack(len(data)) + data], fds)


def _receive(conn: socket.socket) -> tuple[dict[str, Any], list[int]]:
    data, fds, _, _ = socket.recv_fds(conn, 1 << 16, 4)
    (size,) = _HEADER.unpack_from(data)
    while len(data) < _HEADER.size + size:
        more = conn.recv(1 << 16)
        if not more:
            raise EOFError("the request ended early")
        data += more
    return json.loads(data[_HEADER.size:]), list(fds)


def _run_child(request: dict[str, Any], fds: list[int]) -> None:
    """In the forked child: become `python -m MODULE ARGV` and never return."""
    code = 1
    try:
        signal.signal(signal.SIGTERM, signal.SIG_DFL)
        signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGTERM])
        log, listener = fds
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        os.set_inheritable(listener, True)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.argv = [request["module"], *(str(listener) if a == "{listener}" else a for a in request["argv"])]
        runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        if isinstance(e.code, str):
            print(e.code, file=sys.stderr)
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:
        traceback.print_exc()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:
                pass
        os._exit(code)


def serve(path: str, parent: int) -> None:
    """The fork server's loop, until the test worker that started it is gone. Single-threaded: a
    fork copies only the calling thread, and a lock another thread held would stay held forever."""
    for name in PRELOAD:
        __import__(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # its caller waits for this name: ready once it appears
    children: dict[int, socket.socket] = {}
    # close()'s SIGTERM only ends the loop: raised from a handler, it could land between a fork and
    # the child's entry in `children`, and that server would outlive the fork server
    stopping = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stopping.set())
    try:
        while os.getppid() == parent and not stopping.is_set():
            readable, _, _ = select.select([listener], [], [], 0.2)
            _report_exits(children)
            if readable:
                _fork(listener, children)
    finally:
        for pid in children:  # servers a test left running: a failed test's, or a killed worker's
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        for pid in children:  # reaped here: a container's init may never reap an orphan's zombie
            try:
                os.waitpid(pid, 0)
            except ChildProcessError:
                pass


def _report_exits(children: dict[int, socket.socket]) -> None:
    while children:
        pid, status = os.waitpid(-1, os.WNOHANG)
        if pid == 0:
            return
        conn = children.pop(pid)
        try:
            conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
        except OSError:
            pass  # its caller is gone
        conn.close()


def _fork(listener: socket.socket, children: dict[int, socket.socket]) -> None:
    conn, _ = listener.accept()
    try:
        request, fds = _receive(conn)
    except (OSError, EOFError, ValueError):
        conn.close()
        return
    sys.stdout.flush()
    sys.stderr.flush()
    # a SIGTERM for the child before it restores SIGTERM's default would only set the flag of its
    # copy of the loop: blocked across the fork, it waits in the child until _run_child unblocks it
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGTERM])
    pid = os.fork()
    if pid == 0:
        listener.close()
        for other in [conn, *children.values()]:
            other.close()
        _run_child(request, fds)
    children[pid] = conn
    signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGTERM])
    for fd in fds:
        os.close(fd)
    try:
        conn.sendall(f"{pid}\n".encode())
    except OSError:
        pass  # its caller is gone; the child's exit has nowhere to go either, and that is harmless


class ForkedProcess:
    """What LocalServer asks of a `subprocess.Popen`, for a server the fork server started: the
    exit status arrives on the connection the request went out on."""

    def __init__(self, conn: socket.socket, pid: int, args: list[str], pending: bytes = b""):
        self._conn, self.pid, self.args = conn, pid, args
        self._pending = pending  # what arrived with the pid: the exit status of a child that ended at once
        self.returncode: int | None = None

    def _read_exit(self, timeout: float | None) -> bool:
        while not self._pending.endswith(b"\n"):
            if not select.select([self._conn], [], [], timeout)[0]:
                return False
            more = self._conn.recv(64)
            if not more:
                raise RuntimeError(f"the tests' fork server ended before art-server {self.pid} did")
            self._pending += more
        self.returncode = int(self._pending)
        self._conn.close()
        return True

    def poll(self) -> int | None:
        if self.returncode is None:
            self._read_exit(0)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None and not self._read_exit(timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass  # it ended a moment ago; its status is on the way

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class ForkServer:
    """This test worker's fork server, started on first use (its imports take the one slow start)."""

    def __init__(self, root: Path):
        self.root = root
        self._dir = tempfile.mkdtemp(prefix="artisan-forkserver-")
        self._path = os.path.join(self._dir, "socket")
        self._proc: subprocess.Popen | None = None

    def _started(self, timeout: float = 300) -> str:
        if self._proc is None:
            log = open(os.path.join(self._dir, "log"), "ab")
            self._proc = subprocess.Popen(
                [sys.executable, "-c", f"from tests.forkserver import serve; serve({self._path!r}, {os.getpid()})"],
                cwd=self.root, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
            log.close()
        deadline = time.time() + timeout
        while not os.path.exists(self._path):
            if self._proc.poll() is not None or time.time() > deadline:
                log = Path(self._dir, "log").read_text(errors="replace")[-3000:]
                raise RuntimeError(f"the tests' fork server did not start:\n{log}")
            time.sleep(0.1)
        return self._path

    def spawn(self, module: str, argv: list[str], env: dict[str, str], cwd: Path, log: int,
              listener: int) -> ForkedProcess:
        """`python -m MODULE ARGV`, forked; "{listener}" in ARGV stands for the listener's number there."""
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self._started())
        _send(conn, {"module": module, "argv": argv, "env": env, "cwd": str(cwd)}, [log, listener])
        reply = b""
        while b"\n" not in reply:
            more = conn.recv(64)
            if not more:
                raise RuntimeError("the tests' fork server closed the connection without starting art-server")
            reply += more
        pid, pending = reply.split(b"\n", 1)
        return ForkedProcess(conn, int(pid), [module, *argv], pending)

    def close(self) -> None:
        if self._proc is not None and self._proc.poll() is None:
            self._proc.terminate()
            try:
                self._proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._proc.kill()
                self._proc.wait()
        shutil.rmtree(self._dir, ignore_errors=True)


_shared: ForkServer | None = None


def shared(root: Path) -> ForkServer:
    """This process's fork server (one, however many copies of conftest.py pytest has imported)."""
    global _shared
    if _shared is None:
        _shared = ForkServer(root)
        atexit.register(_shared.close)
    return _shared
