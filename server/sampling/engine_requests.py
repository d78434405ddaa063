"""A prompt's token ids handed to the engine with the policy its model name holds, shared by every
route that samples (chat completions, the token-in generate route, logprobs).

A request acquires its policy from the runs (server/runs/facade.py), its one door to them, and holds
it until it is done, so the adapter it started on is never unloaded under it: whoever acquires
releases (a streamed answer when its stream ends).
"""

from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator, Awaitable, Callable

from protocol.names import run_of
from server.engine.base import EngineFull, GenRequest, ReplicaLost, Unsupported
from server.engine.constraints import Constraint, ConstraintError, constraint_for
from server.engine.sampling import SamplingParams
from server.request_errors import APIError, other_model
from server.runs.facade import NotServed, OtherBaseModel
from server.runs.ownership import Caller
from server.sampling.served_names import Policy
from server.state import ServerState

Disconnected = Callable[[], Awaitable[bool]]  # whether the client went away: the HTTP request's is_disconnected


def served_names(state: ServerState, who: Caller) -> list[str]:
    """The names the caller may sample from: the base model's, and its runs' (another tenant's runs
    are not named)."""
    return [n for n in state.served.names() if n == state.host.name or state.runs.owners.visible(who, run_of(n))]


async def acquire_policy(state: ServerState, model: str, who: Caller) -> Policy:
    """The policy `model` names, held loaded until `state.runs.release(policy)`: a 404 for a name
    `who` cannot see (another tenant's run too), a 409 for a run of another base model."""
    held = asyncio.ensure_future(asyncio.to_thread(state.runs.acquire, model, who))  # an older step loads from disk
    try:
        return await asyncio.shield(held)
    except asyncio.CancelledError:  # the thread still holds the policy: it is let go once it has it
        held.add_done_callback(lambda f: f.cancelled() or f.exception() or state.runs.release(f.result()))
        raise
    except OtherBaseModel as e:
        raise other_model(str(e))
    except NotServed:
        raise APIError(404, f"model {model!r} does not exist; served: {', '.join(served_names(state, who))}",
                       param="model", code="model_not_found")


async def check_served(state: ServerState, model: str, who: Caller) -> None:
    """`model` is a name `who` may sample from: a 404 (or 403) as a sampling request would get."""
    state.runs.release(await acquire_policy(state, model, who))


def check_token_ids(state: ServerState, ids: list[int], param: str) -> None:
    """A 400 naming `param` for an id outside this model's vocabulary (a negative one included: the
    tokenizer's Rust side overflows on it, a 500)."""
    vocab = state.host.vocab_size
    bad = next((t for t in ids if not 0 <= t < vocab), None)
    if bad is not None:
        raise APIError(400, f"{param}: {bad} is not a token id of this model (its vocabulary has {vocab})",
                       param=param, code="invalid_token_ids")


def room(state: ServerState, prompt_len: int, param: str, budget: int | None = None) -> int:
    """How many tokens may be generated after a prompt of `prompt_len`: `budget`, or without one
    (vLLM's default) the rest of the context window. A budget past the window is clamped, not
    refused: the choice then ends with "length". A 400 naming `param` when not even one token fits."""
    window = state.host.context_window
    left = window - prompt_len
    if left <= 0:
        raise APIError(400, f"the prompt is {prompt_len} tokens, {prompt_len - window + 1} more than fit in this "
                            f"model's context window of {window} (with room for one generated token)",
                       param=param, code="context_length_exceeded")
    return left if budget is None else min(budget, left)


def output_constraint(state: ServerState, where: str = "", **request: Any) -> Constraint | None:
    """The grammar a request's output must follow (constraint_for's keywords), or a 400 naming what
    cannot be honoured for this model, as a field of `where` (the token-in route's sampling_params)."""
    try:
        return constraint_for(state.host.chat, **request)
    except ConstraintError as e:
        raise APIError(400, where + str(e), param=where + e.param, code="unsupported_constraint")


def check_params(state: ServerState, params: SamplingParams) -> None:
    try:
        state.engine.check(params)
    except Unsupported as e:
        raise APIError(400, str(e), param=e.param, code="unsupported_by_engine")


def submit(state: ServerState, policy: Policy, prompt_ids: list[int], params: SamplingParams, n: int = 1,
           stream: bool = False) -> tuple[GenRequest, asyncio.Queue]:
    """Queue the prompt on the engine, decoding with `policy` (which the caller holds until it is
    done), with the queue the engine's events arrive on; a 503 when the engine is full."""
    loop = asyncio.get_running_loop()
    events: asyncio.Queue = asyncio.Queue()
    gen = GenRequest(prompt_ids=prompt_ids, params=params, policy=policy, n=n, stream=stream,
                     emit=lambda kind, payload: loop.call_soon_threadsafe(events.put_nowait, (kind, payload)))
    try:
        state.engine.submit(gen)
    except EngineFull as e:
        raise APIError(503, f"server is at capacity ({e}); retry shortly", code="overloaded", headers={"Retry-After": "1"})
    return gen, events


async def engine_events(gen: GenRequest, events: asyncio.Queue,
                        disconnected: Disconnected) -> AsyncIterator[tuple[str, Any]]:
    """The engine's events for `gen` as they come; they end, and `gen` is cancelled, when the client
    has gone away (asked each second the engine is silent)."""
    while True:
        try:
            yield await asyncio.wait_for(events.get(), timeout=1.0)
        except asyncio.TimeoutError:
            if await disconnected():
                gen.cancelled = True
                return


async def wait_finished(gen: GenRequest, events: asyncio.Queue, disconnected: Disconnected) -> None:
    """Until every sequence of `gen` is finished; a client that went away cancels it."""
    finished = 0
    async for kind, payload in engine_events(gen, events, disconnected):
        if kind == "error":
            gen.cancelled = True
            if isinstance(payload, ReplicaLost):  # nothing was answered yet: the same request may simply be sent again
                raise APIError(503, f"generation failed: {payload}", code="replica_lost", headers={"Retry-After": "1"})
            raise APIError(500, f"generation failed: {payload}", code="generation_failed")
        finished += kind == "finished"
        if finished == gen.n:
            return
    raise APIError(499, "client disconnected")
