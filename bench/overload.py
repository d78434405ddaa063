"""Overload from one address: 1,024 chat requests at once against art-server with its default flags.

Behind a reverse proxy every client has the proxy's address, so this is what a busy proxy sends.
Every request must be answered, 200 or 503 with Retry-After (past --max-requests-per-ip requests
in flight); none may find its connection reset or closed unanswered, which happens only past the
hard cap on one address's connections (--max-connections-per-ip, well above 1,024).

    python bench/overload.py                     # the embedded model, default flags
    python bench/overload.py --requests 2048 --max-tokens 4

Prints one JSON line: the counts of 200, 503 with Retry-After, other answers and resets, and the
seconds the burst took. Not run in CI (a minute or two on two cores).
"""

from __future__ import annotations

import asyncio
import json
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path

import httpx
import typer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from client.local_server import LocalServer  # noqa: E402

MODEL = "artisan-tiny"


def outcome(r: httpx.Response | BaseException) -> str:
    if isinstance(r, BaseException):
        return "reset"
    if r.status_code == 200:
        return "ok_200"
    if r.status_code == 503 and r.headers.get("retry-after", "").isdigit():
        return "overloaded_503_retry_after"
    return "other"


async def burst(url: str, requests: int, max_tokens: int) -> Counter:
    """`requests` chat requests sent together from 127.0.0.1, each on a connection of its own."""
    body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens,
            "ignore_eos": True}
    limits = httpx.Limits(max_connections=requests, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=url, timeout=600, limits=limits) as client:
        async def one() -> httpx.Response | BaseException:
            try:
                return await client.post("/v1/chat/completions", json=body)
            except httpx.TransportError as e:
                return e

        results = await asyncio.gather(*(one() for _ in range(requests)))
    return Counter(outcome(r) for r in results)


def main(requests: int = typer.Option(1024, help="Requests sent at once."),
         max_tokens: int = typer.Option(4, help="Tokens each request generates.")) -> None:
    with tempfile.TemporaryDirectory(prefix="overload-") as work:
        with LocalServer(Path(work) / "data") as server:  # default flags: the caps as shipped
            started = time.perf_counter()
            counts = asyncio.run(burst(server.url, requests, max_tokens))
            took = time.perf_counter() - started
    result = {"requests": requests, "max_tokens": max_tokens,
              **{k: counts.get(k, 0) for k in ("ok_200", "overloaded_503_retry_after", "other", "reset")},
              "seconds": round(took, 1)}
    print(json.dumps(result), flush=True)
    if result["other"] or result["reset"]:
        raise SystemExit(1)


if __name__ == "__main__":
    typer.run(main)
