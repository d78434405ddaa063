"""The vLLM engine (`art-server --engine vllm`): sampling on a vLLM server, under the same
token-exact contract as the torch engine.

art-server renders the prompt and sends vLLM its token ids (`/v1/completions` with a token-id
prompt, so vLLM never re-renders); vLLM streams back the sampled ids and their logprobs, which
end sequences through the same `record_token` as the torch engine. Each of a request's `n`
samples is its own vLLM request (seed + i, as the torch engine seeds its rows). At most `max_batch`
sequences decode at once, and one request takes at most half of them, so one large request cannot
shut the others out; the rest wait, up to `max_waiting`, then requests are refused (503) as on the
torch engine. A cancelled request closes its stream, which aborts it in vLLM.

Logprobs are invariant 2's by construction (vLLM runs in `processed_logprobs` mode, see
server/engine/vllm_process.py) for every setting this engine accepts; it refuses the ones where
vLLM reports another distribution: top_p < 1 (processed logprobs are renormalised over the
nucleus), constrained decoding (renormalised over the grammar's tokens) and temperatures below
vLLM's floor of 0.01 (it samples at 0.01 instead).

A run's step is served by writing its adapter as a PEFT directory and loading it into vLLM by
name at run time; requests already decoding keep the adapter they started on (serving.py leases).
"""

from __future__ import annotations

import asyncio
import json
import logging
import shutil
import threading
from pathlib import Path
from typing import Any

import httpx
from safetensors.torch import save_file

from server.engine.base import EngineError, EngineFull, GenRequest, DecodeSequence, Unsupported, record_token
from server.engine.sampling import SamplingParams
from server.engine.vllm_process import BASE_NAME, VllmServer
from server.model.host import ModelHost
from server.settings import Settings

log = logging.getLogger("artisan.vllm")
DTYPES = {"torch.float32": "float32", "torch.bfloat16": "bfloat16", "torch.float16": "float16"}
MIN_TEMPERATURE = 0.01  # vLLM raises any lower non-zero temperature to this, silently


class VllmEngine:
    def __init__(self, host: ModelHost, settings: Settings):
        self.host = host
        self.max_batch, self.max_waiting = settings.max_batch, settings.max_waiting
        self.rows_per_request = max(1, settings.max_batch // 2)
        self.max_lora_rank = settings.vllm_max_lora_rank
        self.start_timeout = settings.vllm_start_timeout
        self.adapters_dir = Path(settings.data_dir) / "vllm-adapters"
        self.server = VllmServer.for_settings(settings, host.model_dir, DTYPES[str(host.dtype)], host.context_window,
                                              on_gpu=host.device.type == "cuda")
        self.text_of = host.chat.text  # the text stop strings are matched in
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="artisan-vllm", daemon=True)
        self._client: httpx.AsyncClient | None = None
        self._loaded: set[str] = set()
        self._lock = threading.Lock()
        self._waiting = 0
        self._running = 0
        self._rows = asyncio.Semaphore(self.max_batch)  # rows across all requests

    # ---- Engine ---------------------------------------------------------------------------------
    def start(self) -> None:
        shutil.rmtree(self.adapters_dir, ignore_errors=True)  # a new vLLM has none of them loaded
        self.server.start(self.start_timeout)
        self._thread.start()
        limits = httpx.Limits(max_connections=self.max_batch + self.max_waiting)
        self._client = asyncio.run_coroutine_threadsafe(self._make_client(limits), self._loop).result()

    async def _make_client(self, limits: httpx.Limits) -> httpx.AsyncClient:
        return httpx.AsyncClient(base_url=self.server.url, timeout=httpx.Timeout(None, connect=30), limits=limits)

    def stop(self) -> None:
        if self._client is not None:
            asyncio.run_coroutine_threadsafe(self._client.aclose(), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self.server.stop()

    def check(self, params: SamplingParams) -> None:
        if params.top_p < 1:
            raise Unsupported("top_p < 1 is not supported on the vLLM engine: vLLM reports logprobs renormalised "
                              "over the nucleus, which the trainer cannot reproduce. Use top_p=1, or the torch "
                              "engine.", "top_p")
        if params.constraint is not None:
            raise Unsupported(f"{params.constraint.what} is not supported on the vLLM engine: vLLM reports logprobs "
                              f"renormalised over the grammar's tokens, which the trainer cannot reproduce. Use the "
                              f"torch engine.", params.constraint.what)
        if 0 < params.temperature < MIN_TEMPERATURE:
            raise Unsupported(f"temperature {params.temperature} is below vLLM's floor of {MIN_TEMPERATURE}: vLLM "
                              f"would sample at {MIN_TEMPERATURE} and the trainer would score another distribution. "
                              f"Use 0 (greedy) or at least {MIN_TEMPERATURE}.", "temperature")

    def submit(self, req: GenRequest) -> None:
        with self._lock:
            if self._waiting + req.n > self.max_waiting:
                raise EngineFull(f"{self._waiting} sequences are waiting (limit {self.max_waiting})")
            self._waiting += req.n
        req.sequences = [DecodeSequence(req, i) for i in range(req.n)]
        asyncio.run_coroutine_threadsafe(self._request(req), self._loop)

    @property
    def load(self) -> dict[str, int]:
        return {"running": self._running, "waiting": self._waiting}

    @property
    def alive(self) -> bool:
        return self.server.alive

    # ---- adapters -------------------------------------------------------------------------------
    def load_adapter(self, name: str, lora_config: Any, state: dict[str, Any]) -> None:
        """Written as a PEFT adapter directory, then loaded into vLLM under `name`."""
        if name in self._loaded:
            self.unload_adapter(name)
        path = self.adapters_dir / name
        shutil.rmtree(path, ignore_errors=True)
        lora_config.save_pretrained(str(path))
        save_file({k: v.detach().contiguous().cpu() for k, v in state.items()}, str(path / "adapter_model.safetensors"))
        self._admin("/v1/load_lora_adapter", {"lora_name": name, "lora_path": str(path)})
        self._loaded.add(name)

    def unload_adapter(self, name: str) -> None:
        if name in self._loaded:
            self._admin("/v1/unload_lora_adapter", {"lora_name": name})
            self._loaded.discard(name)
        shutil.rmtree(self.adapters_dir / name, ignore_errors=True)

    def _admin(self, path: str, body: dict[str, Any]) -> None:
        resp = httpx.post(self.server.url + path, json=body, timeout=300)
        if resp.status_code != 200:
            raise EngineError(f"vLLM refused {path} for {body['lora_name']}: {resp.status_code} {resp.text[:300]}")

    # ---- sampling -------------------------------------------------------------------------------
    async def _request(self, req: GenRequest) -> None:
        own_rows = asyncio.Semaphore(self.rows_per_request)
        await asyncio.gather(*(self._sequence(req, seq, own_rows) for seq in req.sequences))

    async def _sequence(self, req: GenRequest, seq: DecodeSequence, own_rows: asyncio.Semaphore) -> None:
        async with own_rows, self._rows:
            with self._lock:
                self._waiting -= 1
                self._running += 1
            try:
                if req.cancelled:  # while it waited for a row
                    seq.finish_reason = "cancelled"
                else:
                    await self._until_cancelled(req, seq, self._stream(req, seq))
                    if seq.finish_reason is None:  # a stream cut short must not train as a finished turn
                        raise EngineError("vLLM ended the stream before the sequence finished")
            except Exception as exc:  # vLLM refused or went away: this request fails, the server goes on
                log.warning("vLLM request failed: %s", exc)
                req.cancelled = True
                req.emit("error", exc if isinstance(exc, EngineError) else EngineError(f"vLLM: {exc}"))
                return
            finally:
                with self._lock:
                    self._running -= 1
        req.emit("finished", seq)

    @staticmethod
    async def _until_cancelled(req: GenRequest, seq: DecodeSequence, stream: Any) -> None:
        """Run the stream, closing it as soon as the request is cancelled (even before vLLM has
        sent its first token): vLLM aborts a request whose connection closes."""
        task = asyncio.ensure_future(stream)
        while not task.done():
            await asyncio.wait({task}, timeout=0.5)
            if req.cancelled and not task.done():
                task.cancel()
                seq.finish_reason = "cancelled"
        if not task.cancelled():
            task.result()

    def _body(self, req: GenRequest, seq: DecodeSequence) -> dict[str, Any]:
        p = req.params
        body = {"model": req.policy.adapter or BASE_NAME, "prompt": req.prompt_ids, "max_tokens": p.max_tokens,
                "temperature": p.temperature, "top_p": 1.0, "top_k": -1, "min_p": 0.0, "repetition_penalty": 1.0,
                "logprobs": max(1, p.top_logprobs), "return_token_ids": True, "return_tokens_as_token_ids": True,
                "skip_special_tokens": False, "ignore_eos": p.ignore_eos, "stream": True}
        if p.seed is not None:
            body["seed"] = (p.seed + seq.index) % 2**63
        if not p.ignore_eos:  # stop strings are matched here, in the text art-server decodes
            body["stop_token_ids"] = sorted(self.host.chat.stop_ids)
        return body

    async def _stream(self, req: GenRequest, seq: DecodeSequence) -> None:
        assert self._client is not None
        async with self._client.stream("POST", "/v1/completions", json=self._body(req, seq)) as resp:
            if resp.status_code != 200:
                raise EngineError(f"vLLM answered {resp.status_code}: {(await resp.aread()).decode()[:500]}")
            async for line in resp.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise EngineError(f"vLLM: {chunk['error']}")
                for choice in chunk.get("choices", []):
                    if self._accept(req, seq, choice):
                        return  # closing the stream early (a stop string) aborts the rest in vLLM

    def _accept(self, req: GenRequest, seq: DecodeSequence, choice: dict[str, Any]) -> bool:
        """Record one chunk's tokens; True once the sequence is done."""
        ids = choice.get("token_ids") or []
        lp = choice.get("logprobs") or {}
        logprobs, tops = lp.get("token_logprobs") or [], lp.get("top_logprobs") or [None] * len(ids)
        if len(logprobs) != len(ids):
            raise EngineError(f"vLLM sent {len(ids)} token ids but {len(logprobs)} logprobs")
        for token, logprob, top in zip(ids, logprobs, tops):
            record_token(seq, token, logprob, _top(top), self.host.chat.stop_ids, self.text_of)
            if req.stream:
                req.emit("token", seq)
            if seq.finish_reason is not None:
                return True
        if choice.get("finish_reason") is not None:
            seq.finish_reason = "length" if choice["finish_reason"] == "length" else "stop"
            return True
        return False


def _top(entries: dict[str, float] | None) -> list[tuple[int, float]] | None:
    """vLLM's top logprobs ({"token_id:17": -0.1, ...}, the sampled token among them) as (id, logprob)
    pairs, best first."""
    if not entries:
        return None
    pairs = [(int(k.removeprefix("token_id:")), v) for k, v in entries.items()]
    return sorted(pairs, key=lambda kv: -kv[1])
