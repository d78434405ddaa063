"""Connections that never send a request, against a real server: 22,000 idle one-byte connections
(more than the server has descriptors for) while a request with a key still answers within 2 s and
the log stays small; a cap per client address; a deadline for a request's headers. And overload:
requests past the soft caps (per address, and in all) answered 503 with Retry-After, never a reset
connection, up to the hard cap on one address's connections."""

from __future__ import annotations

import asyncio
import json
import os
import socket
import subprocess
import sys
import time

import httpx
import pytest

KEY = "k"

# A process that opens `n` connections from `source` (a loopback address of its own), sends one
# byte on each, reports, and holds them until its stdin closes.
_HOLDER = r"""
import json, socket, sys
host, port, n = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
sources = sys.argv[4].split(",")
held, failed = [], 0
for i in range(n):
    s = socket.socket()
    try:
        s.bind((sources[i % len(sources)], 0))
        s.settimeout(5)
        s.connect((host, port))
        s.send(b"G")
        held.append(s)
    except OSError:
        failed += 1
        s.close()
print(json.dumps({"opened": len(held), "failed": failed}), flush=True)
sys.stdin.read()
"""


def _hold(port: int, n: int, sources: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", _HOLDER, "127.0.0.1", str(port), str(n), ",".join(sources)],
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def _fd_limit(pid: int) -> int:
    for line in open(f"/proc/{pid}/limits"):
        if line.startswith("Max open files"):
            return int(line.split()[3])
    raise AssertionError("no fd limit")


def _settle(pid: int, timeout: float = 60) -> None:
    """Wait until the server has taken in what the kernel queued for it (its descriptors stop changing)."""
    deadline, last = time.monotonic() + timeout, -1
    while time.monotonic() < deadline and (now := _fds(pid)) != last:
        last = now
        time.sleep(1)


def _closed(sock: socket.socket) -> bool:
    """Whether the server closed the connection (waiting up to the socket's timeout)."""
    try:
        return sock.recv(100) == b""
    except ConnectionResetError:
        return True
    except TimeoutError:
        return False


def _timed_request(url: str) -> tuple[float, int]:
    start = time.monotonic()
    r = httpx.get(url + "/v1/runs", headers={"Authorization": f"Bearer {KEY}"}, timeout=30)
    return time.monotonic() - start, r.status_code


def test_22000_idle_connections_leave_room_for_a_request_with_a_key(fresh_server):
    # The headers' deadline is long here, so the connections stay open and the caps are what is tested.
    srv = fresh_server(api_key=KEY, extra=["--header-timeout", "120"])
    pid, limit = srv.proc.pid, _fd_limit(srv.proc.pid)
    assert limit < 22_000, f"the server may have {limit} descriptors: 22,000 connections would not exhaust them"
    log_before = srv.log_path.stat().st_size
    # 100 source addresses, 220 connections each: under the per-address cap, so only the cap on all
    # connections stands between them and the server's descriptor limit.
    sources = [f"127.0.1.{i}" for i in range(1, 101)]
    holders = [_hold(srv.port, 5_500, sources[i::4]) for i in range(4)]  # a process's own limit is 20,000
    try:
        reports = [json.loads(h.stdout.readline()) for h in holders]
        opened = sum(r["opened"] for r in reports)
        assert opened + sum(r["failed"] for r in reports) == 22_000
        _settle(pid)  # every connection is open and idle now, none still being accepted
        assert _fds(pid) < limit  # the server kept descriptors to spare
        for _ in range(3):
            took, status = _timed_request(srv.url)
            print(f"a request with a key, 22,000 connections held: {took:.3f} s")
            assert status == 200 and took < 2.0, (status, took)
        assert httpx.get(srv.url + "/health", timeout=5).json()["status"] == "ok"
    finally:
        for h in holders:
            h.stdin.close()
            h.wait(timeout=60)
    grown = srv.log_path.stat().st_size - log_before
    assert grown < 20_000, srv.log_path.read_text(errors="replace")[-2000:]
    assert _timed_request(srv.url)[1] == 200


def test_one_address_holds_only_so_many_connections(fresh_server):
    srv = fresh_server(api_key=KEY, extra=["--max-connections-per-ip", "50", "--header-timeout", "120"])
    before = _fds(srv.proc.pid)
    holder = _hold(srv.port, 300, ["127.0.0.3"])
    try:
        json.loads(holder.stdout.readline())
        time.sleep(0.5)
        held = _fds(srv.proc.pid) - before
        assert 45 <= held <= 55, held  # 50 kept, the other 250 closed at once
        took, status = _timed_request(srv.url)  # another address is not affected
        assert status == 200 and took < 2.0
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)


def test_headers_not_sent_in_time_close_the_connection(fresh_server):
    srv = fresh_server(api_key=KEY, extra=["--header-timeout", "1"])
    idle, slow = socket.create_connection(("127.0.0.1", srv.port)), socket.create_connection(("127.0.0.1", srv.port))
    idle.send(b"G")
    start = time.monotonic()
    for byte in b"GET /health HTTP/1.1\r\n":  # a byte at a time: data alone does not extend the deadline
        try:
            slow.send(bytes([byte]))
        except OSError:
            break
        time.sleep(0.1)
    idle.settimeout(10)
    slow.settimeout(10)
    assert _closed(idle) and _closed(slow)
    assert time.monotonic() - start < 5
    # A request sent in time is answered, on a connection that then serves another.
    with httpx.Client(base_url=srv.url, headers={"Authorization": f"Bearer {KEY}"}) as c:
        assert c.get("/health").status_code == 200
        time.sleep(1.5)  # idle between requests: that is the keep-alive timeout's business, not this one
        assert c.get("/v1/runs").status_code == 200


@pytest.mark.unit
def test_a_repeated_warning_is_logged_a_few_times_then_counted():
    import io
    import logging

    from server.log_limits import CollapseRepeats

    now = [0.0]  # the filter's clock, moved by hand: a loaded machine cannot stretch the window
    out = io.StringIO()
    handler = logging.StreamHandler(out)
    handler.addFilter(CollapseRepeats(first=3, window=0.5, clock=lambda: now[0]))
    logger = logging.getLogger("test.collapse")
    logger.addHandler(handler)
    logger.propagate = False
    logger.setLevel(logging.INFO)
    try:
        for i in range(10_000):
            logger.error("socket.accept() out of system resource (%d)", i)
            logger.info("GET /health %d", i)  # below WARNING: every one is logged
            now[0] += 0.4 / 10_000
        logger.warning("another message")
        now[0] = 0.6
        logger.error("socket.accept() out of system resource (%d)", 10_000)
    finally:
        logger.removeHandler(handler)
    lines = out.getvalue().splitlines()
    repeated = [line for line in lines if "out of system resource" in line]
    assert len(repeated) == 4  # 3, then the first of the next window with the count of the rest
    assert "repeated 9997 more times" in repeated[-1]
    assert sum("GET /health" in line for line in lines) == 10_000
    assert "another message" in lines


# ---- overload: 503 with Retry-After past the soft caps, a closed connection only past the hard one --------

CHAT = {"model": "artisan-tiny", "messages": [{"role": "user", "content": "hi"}], "ignore_eos": True}


async def _chat_at_once(url: str, n: int, max_tokens: int, sources: tuple[str, ...] = ("127.0.0.1",)) -> list:
    """`n` chat requests sent together, from `sources` in turn, each on a connection of its own: the
    responses, or the transport error a request got instead (a reset or closed connection)."""
    limits = httpx.Limits(max_connections=n, max_keepalive_connections=0)
    clients = [httpx.AsyncClient(base_url=url, timeout=300, headers={"Authorization": f"Bearer {KEY}"},
                                 transport=httpx.AsyncHTTPTransport(local_address=source, limits=limits))
               for source in sources]

    async def one(i: int) -> httpx.Response | Exception:
        try:
            return await clients[i % len(clients)].post("/v1/chat/completions", json={**CHAT, "max_tokens": max_tokens})
        except httpx.TransportError as e:
            return e

    try:
        return await asyncio.gather(*(one(i) for i in range(n)))
    finally:
        for c in clients:
            await c.aclose()


def _outcome(r: httpx.Response | Exception) -> str:
    if isinstance(r, Exception):
        return "reset"
    if r.status_code == 503 and int(r.headers.get("retry-after", "0")) >= 1:
        return "503"
    return str(r.status_code)


def _tally(responses: list) -> dict[str, int]:
    tally: dict[str, int] = {}
    for r in responses:
        tally[_outcome(r)] = tally.get(_outcome(r), 0) + 1
    return tally


def _shed(responses: list) -> list[dict]:
    """The errors of the requests answered 503, each checked to be the API's error shape."""
    errors = []
    for r in responses:
        if _outcome(r) == "503":
            assert r.headers["content-type"].startswith("application/json") and r.headers["connection"] == "close"
            body = r.json()
            assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}, body
            assert body["error"]["code"] == "overloaded" and body["error"]["type"] == "server_overloaded", body
            errors.append(body["error"])
    return errors


async def test_300_requests_at_once_from_one_address_are_answered_not_reset(fresh_server):
    # Default flags: more than the 256 connections one address could hold before.
    srv = fresh_server(api_key=KEY)
    tally = _tally(await _chat_at_once(srv.url, 300, max_tokens=1))
    assert set(tally) <= {"200", "503"} and tally.get("200", 0) >= 1, tally


async def test_requests_past_one_addresses_soft_cap_get_503_with_retry_after(fresh_server):
    srv = fresh_server(api_key=KEY, extra=["--max-requests-per-ip", "2"])
    responses = await _chat_at_once(srv.url, 16, max_tokens=24)
    tally = _tally(responses)
    assert set(tally) == {"200", "503"}, tally  # both, and nothing else: no reset, no other status
    assert all("--max-requests-per-ip" in e["message"] for e in _shed(responses))
    # The cap counts requests in flight: once they are answered, the address is served again.
    [again] = await _chat_at_once(srv.url, 1, max_tokens=1)
    assert _outcome(again) == "200"


async def test_requests_past_the_servers_soft_cap_get_503_from_every_address(fresh_server):
    srv = fresh_server(api_key=KEY, extra=["--max-requests", "3"])
    responses = await _chat_at_once(srv.url, 16, max_tokens=24, sources=tuple(f"127.0.4.{i}" for i in range(1, 9)))
    tally = _tally(responses)
    assert set(tally) == {"200", "503"}, tally
    assert all("--max-requests" in e["message"] and "-per-ip" not in e["message"] for e in _shed(responses))


async def test_connections_past_one_addresses_hard_cap_are_closed_unanswered(fresh_server):
    srv = fresh_server(api_key=KEY, extra=["--max-requests-per-ip", "2", "--max-connections-per-ip", "6",
                                           "--header-timeout", "120"])
    holder = _hold(srv.port, 6, ["127.0.0.9"])  # six connections waiting for their headers: the cap
    try:
        assert json.loads(holder.stdout.readline()) == {"opened": 6, "failed": 0}
        time.sleep(0.5)
        [over] = await _chat_at_once(srv.url, 1, max_tokens=1, sources=("127.0.0.9",))
        assert _outcome(over) == "reset", over
        [other] = await _chat_at_once(srv.url, 1, max_tokens=1, sources=("127.0.0.10",))
        assert _outcome(other) == "200"
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    time.sleep(0.5)
    [after] = await _chat_at_once(srv.url, 1, max_tokens=1, sources=("127.0.0.9",))
    assert _outcome(after) == "200"  # the held connections gone, the address is served again
