"""Iteration-level batching: one background thread decodes every running sequence together.

Each loop iteration admits waiting requests (prefilled in groups of equal prompt length, so no
padding is computed), then runs one decode step for all rows, then retires the finished ones.
New requests therefore join at the next step boundary instead of waiting for a batch to drain,
and 32 concurrent rollouts cost about one batched generate.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import torch

from server.engine.kv_cache import BatchKV
from server.engine.sampling import SamplingParams, sample
from server.model_host import ModelHost, Policy

log = logging.getLogger("artisan.engine")


class EngineFull(Exception):
    """The waiting queue is full; the API answers 503 with Retry-After."""


@dataclass
class Sequence:
    request: "GenRequest"
    index: int
    generator: torch.Generator | None
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None
    stop_text_end: int | None = None  # where the output text is cut when a stop string matched


@dataclass
class GenRequest:
    prompt_ids: list[int]
    params: SamplingParams
    policy: Policy
    n: int = 1
    # Called from the engine thread: ("token", seq), ("finished", seq) or ("error", exception).
    emit: Callable[[str, object], None] = lambda kind, payload: None
    stream: bool = False
    cancelled: bool = False
    sequences: list[Sequence] = field(default_factory=list)
    id: int = field(default_factory=itertools.count().__next__)


class Engine:
    def __init__(self, host: ModelHost, max_batch: int = 64, max_waiting: int = 512):
        self.host = host
        self.max_batch = max_batch
        self.max_waiting = max_waiting
        self._waiting: deque[GenRequest] = deque()
        self._rows: list[Sequence] = []
        self._kv: BatchKV | None = None
        self._cv = threading.Condition()
        self._stopped = False
        self._thread = threading.Thread(target=self._loop, name="artisan-engine", daemon=True)
        self.steps = 0
        self.tokens_generated = 0
        host.adapters_in_use = self._adapters_in_use
        cfg = host.config
        self._layers = cfg.num_hidden_layers
        self._kv_heads = getattr(cfg, "num_key_value_heads", cfg.num_attention_heads)
        self._head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads

    # ---- public ---------------------------------------------------------------------------
    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        with self._cv:
            self._stopped = True
            self._cv.notify_all()
        self._thread.join(timeout=10)

    def submit(self, req: GenRequest) -> None:
        with self._cv:
            waiting = sum(r.n for r in self._waiting)
            if waiting + req.n > self.max_waiting:
                raise EngineFull(f"{waiting} sequences are waiting (limit {self.max_waiting})")
            gens = []
            for i in range(req.n):
                g = None
                if req.params.seed is not None:
                    g = torch.Generator(device=self.host.device)
                    g.manual_seed((req.params.seed + i) % 2**64)  # torch takes [0, 2**64)
                gens.append(g)
            req.sequences = [Sequence(req, i, g) for i, g in enumerate(gens)]
            self._waiting.append(req)
            self._cv.notify_all()

    def _adapters_in_use(self) -> set[str]:
        with self._cv:
            reqs = [s.request for s in self._rows] + list(self._waiting)
        return {r.policy.adapter for r in reqs if r.policy.adapter}

    @property
    def load(self) -> dict[str, int]:
        return {"running": len(self._rows), "waiting": sum(r.n for r in self._waiting)}

    # ---- loop -----------------------------------------------------------------------------
    def _loop(self) -> None:
        while True:
            with self._cv:
                while not self._stopped and not self._waiting and not self._rows:
                    self._cv.wait()
                if self._stopped:
                    return
                admitted = self._admit()
            try:
                with self.host.lock, torch.inference_mode():
                    if admitted:
                        self._prefill(admitted)
                    self._drop_cancelled()
                    if self._rows:
                        self._decode_step()
            except Exception as exc:  # a failed forward fails its requests, not the server
                log.exception("engine step failed")
                for req in self._affected(admitted):
                    req.emit("error", exc)
                self._rows, self._kv = [], None

    def _affected(self, admitted: list[GenRequest]) -> list[GenRequest]:
        seen: dict[int, GenRequest] = {}
        for r in [s.request for s in self._rows] + admitted:
            seen[r.id] = r
        return list(seen.values())

    def _admit(self) -> list[GenRequest]:
        admitted = []
        free = self.max_batch - len(self._rows)
        while self._waiting and (self._waiting[0].n <= free or not self._rows and not admitted):
            req = self._waiting.popleft()
            if req.cancelled:
                continue
            free -= req.n
            admitted.append(req)
        return admitted

    def _prefill(self, requests: list[GenRequest]) -> None:
        by_length: dict[int, list[Sequence]] = {}
        for req in requests:
            by_length.setdefault(len(req.prompt_ids), []).extend(req.sequences)
        for length, seqs in by_length.items():
            ids = torch.tensor([s.request.prompt_ids for s in seqs], device=self.host.device)
            kv = BatchKV.empty(self._layers, len(seqs), self._kv_heads, self._head_dim, length + 64,
                               self.host.dtype, self.host.device)
            out = self.host.forward(
                ids, [s.request.policy.adapter for s in seqs],
                past_key_values=kv.cache(), use_cache=True,
                attention_mask=torch.ones_like(ids),
                position_ids=torch.arange(length, device=ids.device)[None, :].expand(len(seqs), -1),
                logits_to_keep=1,
            )
            kv.advance(length)
            self._accept(seqs, out.logits[:, -1, :])
            if self._kv is None:
                self._kv = kv
            else:
                self._kv.extend(kv)
            self._rows.extend(seqs)
        self._retire()

    def _decode_step(self) -> None:
        kv = self._kv
        assert kv is not None
        kv.ensure_capacity(1)
        ids = torch.tensor([[s.token_ids[-1]] for s in self._rows], device=self.host.device)
        positions = torch.tensor(kv.lengths, device=ids.device)[:, None]
        out = self.host.forward(
            ids, [s.request.policy.adapter for s in self._rows],
            past_key_values=kv.cache(), use_cache=True,
            attention_mask=kv.attention_mask(extra=1), position_ids=positions,
        )
        kv.advance(1)
        self.steps += 1
        self._accept(self._rows, out.logits[:, -1, :])
        self._retire()

    def _accept(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Sample one token per row, record it, and decide whether the row is done."""
        params = [s.request.params for s in seqs]
        k = max(p.top_logprobs for p in params)
        out = sample(logits, params, [s.generator for s in seqs], top_k=k)
        tokens, lps = out.tokens.tolist(), out.logprobs.tolist()
        tops_ids = out.top_ids.tolist() if out.top_ids is not None else None
        tops_lp = out.top_logprobs.tolist() if out.top_logprobs is not None else None
        eos = set(self.host.eos_ids)
        for i, s in enumerate(seqs):
            p = s.request.params
            s.token_ids.append(tokens[i])
            s.logprobs.append(lps[i])
            if p.top_logprobs and tops_ids is not None:
                s.top_logprobs.append(list(zip(tops_ids[i][: p.top_logprobs], tops_lp[i][: p.top_logprobs])))
            self.tokens_generated += 1
            if tokens[i] in eos and not p.ignore_eos:
                s.finish_reason = "stop"
            elif p.stop and self._hit_stop(s):
                s.finish_reason = "stop"
            elif len(s.token_ids) >= p.max_tokens:
                s.finish_reason = "length"
            if s.request.stream:
                s.request.emit("token", s)

    def _hit_stop(self, s: Sequence) -> bool:
        text = self.host.renderer.output_text(s.token_ids)  # the text stop_text_end indexes
        hits = [text.find(stop) for stop in s.request.params.stop if stop and stop in text]
        if hits:
            s.stop_text_end = min(hits)
            return True
        return False

    def _drop_cancelled(self) -> None:
        for s in self._rows:
            if s.request.cancelled and s.finish_reason is None:
                s.finish_reason = "cancelled"
        self._retire()

    def _retire(self) -> None:
        keep = [i for i, s in enumerate(self._rows) if s.finish_reason is None]
        if len(keep) == len(self._rows):
            return
        for s in self._rows:
            if s.finish_reason is not None:
                s.request.emit("finished", s)
        self._rows = [self._rows[i] for i in keep]
        if not self._rows:
            self._kv = None
        elif self._kv is not None:
            self._kv.keep(keep)
