"""What every inference engine takes and gives: prompt token ids in, sampled ids and logprobs out.

artisan renders prompts and parses outputs itself (server/chat); an engine only samples, so the
token-exact contract (invariants 1-2) does not depend on which engine runs. An engine also holds
the served LoRA adapters: a request names its policy's adapter and decodes with it.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass, field
from typing import Any, Callable, Collection, Protocol

from server.engine.sampling import SamplingParams
from server.sampling.served_names import Policy


class EngineFull(Exception):
    """The waiting queue is full; the API answers 503 with Retry-After."""


class EngineError(Exception):
    """Sampling failed for one request (the server keeps serving the others)."""


class ReplicaLost(EngineError):
    """The engine replica sampling the request died or became unreachable: the same request sent
    again is served by another (a 503 with Retry-After, or an error event that says so)."""


class Unsupported(ValueError):
    """A request this engine cannot sample under the token-exact contract (a 400 naming `param`)."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass
class DecodeSequence:
    """One of a request's `n` samples, filled in as it decodes."""

    request: "GenRequest"
    index: int
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top_logprobs: list[list[tuple[int, float]]] = field(default_factory=list)
    finish_reason: str | None = None  # stop, length, cancelled, error
    stop_text_end: int | None = None  # where the output text is cut when a stop string matched
    generator: Any = None  # the engine's per-row random state (seeded requests)
    constraint: Any = None  # its progress through the request's grammar (server/engine/constraints.py)


Emit = Callable[[str, object], None]


@dataclass
class GenRequest:
    prompt_ids: list[int]
    params: SamplingParams
    policy: Policy
    n: int = 1
    # Called from the engine's thread: ("token", seq), ("finished", seq) or ("error", exception).
    emit: Emit = lambda kind, payload: None
    stream: bool = False
    cancelled: bool = False
    sequences: list[DecodeSequence] = field(default_factory=list)
    id: int = field(default_factory=itertools.count().__next__)


def record_token(seq: DecodeSequence, token: int, logprob: float, top: list[tuple[int, float]] | None,
                 stop_ids: Collection[int], text_of: Callable[[list[int]], str]) -> None:
    """Append one sampled token to `seq` and decide whether it is done: a stop token (unless
    ignore_eos), a stop string in the decoded text, or max_tokens. Both engines end sequences
    here, so a choice ends the same way whichever engine sampled it."""
    p = seq.request.params
    seq.token_ids.append(token)  # ids first: a streaming reader sends only tokens whose lists are complete
    seq.logprobs.append(logprob)
    if p.top_logprobs and top is not None:
        seq.top_logprobs.append(top[: p.top_logprobs])
    if token in stop_ids and not p.ignore_eos:
        seq.finish_reason = "stop"
    elif p.stop and _hit_stop(seq, text_of):
        seq.finish_reason = "stop"
    elif len(seq.token_ids) >= p.max_tokens:
        seq.finish_reason = "length"


def _hit_stop(seq: DecodeSequence, text_of: Callable[[list[int]], str]) -> bool:
    text = text_of(seq.token_ids)  # the text stop_text_end indexes
    hits = [text.find(stop) for stop in seq.request.params.stop if stop and stop in text]
    if hits:
        seq.stop_text_end = min(hits)
        return True
    return False


class Engine(Protocol):
    max_lora_rank: int | None  # the largest LoRA rank it can serve (None: any)

    def start(self) -> None: ...

    def stop(self) -> None: ...

    def check(self, params: SamplingParams) -> None:
        """Raise Unsupported for sampling settings this engine cannot honour token-exactly."""

    def submit(self, request: GenRequest) -> None:
        """Queue a request; raises EngineFull when the queue is at its limit."""

    def load_adapter(self, name: str, lora_config: Any, state: dict[str, Any]) -> None:
        """Serve LoRA weights under `name` (a new step's snapshot)."""

    def unload_adapter(self, name: str) -> None: ...

    @property
    def load(self) -> dict[str, int]:
        """Rows decoding and sequences waiting, for /health."""

    @property
    def alive(self) -> bool:
        """False once the engine can no longer sample (its decode thread or vLLM process is gone)."""
