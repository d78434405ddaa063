"""One engine replica as a Ray actor: its own ModelHost and TorchEngine on one CPU and one torch
thread, sampling prompt token ids for the server's ReplicatedEngine (server/engine/replicas.py).

The actor speaks in plain picklable values: a request's events come back from the `generate`
streaming generator as batches of `SeqEvent`, each carrying only what was sampled since the last
batch, so a non-streamed request costs one message per sequence and a streamed one a message per
batch of tokens that were ready together.
"""

from __future__ import annotations

import asyncio
import os
import uuid
from dataclasses import dataclass
from typing import Any, AsyncIterator

from server.engine.sampling import SamplingParams
from server.sampling.served_names import Policy
from server.settings import Settings


@dataclass
class SeqEvent:
    """What one sequence gained since the last event: ("token" or "finished"), or ("error", message)."""

    kind: str
    index: int = 0
    token_ids: tuple[int, ...] = ()
    logprobs: tuple[float, ...] = ()
    top_logprobs: tuple[list[tuple[int, float]], ...] = ()
    finish_reason: str | None = None
    stop_text_end: int | None = None
    message: str = ""


class ReplicaActor:
    """Decorated with ray.remote by the caller (Ray is imported only where replicas are asked for)."""

    def __init__(self, settings: Settings):
        import torch

        from server.model.host import load_model
        from server.engine.torch_engine import TorchEngine

        torch.set_num_threads(1)  # one core per replica: more threads would contend with the other replicas
        self.incarnation = uuid.uuid4().hex  # a restarted actor is a new one, with no adapters loaded
        self.host = load_model(settings)
        self.engine = TorchEngine.from_settings(self.host, settings)
        self.engine.start()
        self._requests: dict[str, Any] = {}
        self._adapters: set[str] = set()

    def info(self) -> dict[str, Any]:
        import ray  # only ever imported inside a Ray worker

        return {"incarnation": self.incarnation, "pid": os.getpid(), "node": ray.util.get_node_ip_address(),
                "alive": self.engine.alive,
                "adapters": sorted(self._adapters), **self.engine.load}

    async def load_adapter(self, name: str, lora_config: Any, state: dict[str, Any]) -> None:
        await asyncio.to_thread(self.engine.load_adapter, name, lora_config, state)
        self._adapters.add(name)

    async def unload_adapter(self, name: str) -> None:
        self._adapters.discard(name)
        await asyncio.to_thread(self.engine.unload_adapter, name)

    def cancel(self, request_id: str) -> None:
        req = self._requests.get(request_id)
        if req is not None:
            req.cancelled = True

    async def generate(self, request_id: str, prompt_ids: list[int], params: SamplingParams, adapter: str | None,
                       n: int, stream: bool) -> AsyncIterator[list[SeqEvent]]:
        """Batches of events until every sequence has finished or the request failed."""
        from server.engine.base import EngineFull, GenRequest

        loop = asyncio.get_running_loop()
        events: asyncio.Queue = asyncio.Queue()
        req = GenRequest(prompt_ids=prompt_ids, params=params, policy=Policy(adapter or "", adapter, None, 0), n=n,
                         stream=stream,
                         emit=lambda kind, payload: loop.call_soon_threadsafe(events.put_nowait, (kind, payload)))
        if adapter is not None and adapter not in self._adapters:
            # Unknown to this replica (a restart the server has not seen yet): refused here, since
            # decoding it would fail every request in the batch.
            yield [SeqEvent("error", message=f"adapter {adapter} is not loaded on this replica; retry the request")]
            return
        sent = [0] * n  # tokens of each sequence already sent
        self._requests[request_id] = req
        try:
            try:
                self.engine.submit(req)
            except EngineFull as e:
                yield [SeqEvent("full", message=str(e))]
                return
            finished = 0
            while finished < n:
                batch = [await events.get()]
                while not events.empty():
                    batch.append(events.get_nowait())
                out = []
                for kind, payload in batch:
                    if kind == "error":
                        out.append(SeqEvent("error", message=str(payload)))
                        break
                    out.append(_delta(kind, payload, sent))
                    finished += kind == "finished"
                yield out
                if out[-1].kind == "error":
                    return
        finally:
            req.cancelled = True  # a caller that went away stops its rows at the next step
            self._requests.pop(request_id, None)


def _delta(kind: str, seq: Any, sent: list[int]) -> SeqEvent:
    """The tokens `seq` sampled since the last event about it. A sequence's lists only grow, and
    the engine thread appends ids, then logprobs, then top logprobs: the shortest list read here
    bounds what is complete."""
    start, end = sent[seq.index], len(seq.logprobs)
    if seq.request.params.top_logprobs:
        end = min(end, len(seq.top_logprobs))
    sent[seq.index] = end
    tops = tuple(seq.top_logprobs[start:end])
    return SeqEvent(kind, seq.index, tuple(seq.token_ids[start:end]), tuple(seq.logprobs[start:end]), tops,
                    seq.finish_reason if kind == "finished" else None,
                    seq.stop_text_end if kind == "finished" else None)

