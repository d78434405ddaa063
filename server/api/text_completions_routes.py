"""`POST /v1/completions`: OpenAI's legacy text completion, as vLLM serves it to clients that
continue raw text (lm-eval's `local-completions`, a base model's evaluations, `litellm.text_completion`).

The prompt is continued as sent, with no chat template: text is encoded with the tokenizer's special
tokens (a BOS where the model adds one), token ids are taken as they are. A batch of prompts gives
`n` choices per prompt, prompt by prompt. Besides OpenAI's shape each choice carries `token_ids`,
`prompt_token_ids` and its `sampling` record, as a chat choice does. `logprobs: k` gives the legacy
logprobs object (each token, its logprob at the sampling temperature, the k likeliest beside it and
its offset in `text`); with `echo` the prompt comes back in front of the text, and with both, each
prompt token's logprob given the tokens before it (the first has none), as lm-eval scores a
continuation. `max_tokens: 0` with `echo` samples nothing and only scores the prompt.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, AsyncIterator

from fastapi import APIRouter, Depends, Request
from fastapi.responses import StreamingResponse

from server.api.auth import require_api_key
from server.api.deps import State
from server.api.errors import documented
from server.api.limits import GuardedRoute
from server.api.logprobs_routes import scorable
from server.api.text_completions_schemas import TextCompletionRequest
from server.engine.base import DecodeSequence
from server.engine.constraints import Constraint
from server.engine.sampling import SamplingParams
from server.model import scoring
from server.request_errors import APIError
from server.sampling.choices import output_text, sampling_info, token_name
from server.sampling.engine_requests import (Disconnected, acquire_policy, check_params, check_token_ids,
                                             engine_events, output_constraint, room, submit, wait_finished)
from server.sampling.served_names import Policy
from server.sampling.streaming import sendable, sse, stream_failure
from server.state import ServerState

router = APIRouter(dependencies=[Depends(require_api_key)], route_class=GuardedRoute,
                   responses=documented(401, 503))

Logprobs = dict[str, list[Any]]  # the legacy object: tokens, token_logprobs, top_logprobs, text_offset


def _token_ids(state: ServerState, prompt: str | list[int], param: str) -> list[int]:
    ids = state.host.tokenizer.encode(prompt) if isinstance(prompt, str) else prompt
    if not ids:
        raise APIError(400, f"{param} is empty: there is nothing to continue", param=param, code="invalid_value")
    check_token_ids(state, ids, param)
    return ids


def _sampling_params(state: ServerState, body: TextCompletionRequest, prompt_len: int, param: str,
                     constraint: Constraint | None) -> SamplingParams:
    max_tokens = room(state, prompt_len, param, body.max_tokens)
    params = SamplingParams(temperature=body.temperature, top_p=body.top_p, max_tokens=max_tokens, stop=body.stop,
                            seed=body.seed, top_logprobs=body.logprobs or 0, constraint=constraint)
    if max_tokens:
        check_params(state, params)
    return params


class TextOffsets:
    """Where each token starts in a choice's text, token after token (a stream's chunks, an echoed
    prompt before the sampled text). A character split across byte tokens starts where its first
    token does and counts once its last has come; each token's length is told apart from the few
    before it (a tokenizer that trims the first token's space trims both decodes alike), so the text
    before is decoded once, not at every token."""

    CONTEXT = 6  # a UTF-8 character is at most 4 byte tokens

    def __init__(self, tok: Any, before: list[int]):
        self.tok = tok
        self.window, self.at = before[-self.CONTEXT:], self._length(before)

    def _length(self, ids: list[int]) -> int:  # an incomplete character at the end decodes as U+FFFD: not yet
        return len(self.tok.decode(ids, skip_special_tokens=True).rstrip("\ufffd"))

    def of(self, ids: list[int]) -> list[int]:
        offsets = []
        for t in ids:
            offsets.append(self.at)
            self.at += self._length(self.window + [t]) - self._length(self.window)
            self.window = (self.window + [t])[-self.CONTEXT:]
        return offsets


def _legacy_logprobs(tok: Any, ids: list[int], logprobs: list[float | None],
                     tops: list[list[tuple[int, float]] | None] | None, offsets: TextOffsets,
                     as_ids: bool = False) -> Logprobs:
    """Each token's name (its text, or "token_id:<id>"), logprob, likeliest alternatives (the token
    itself among them, as vLLM and lm-eval's greedy check read them) and offset in the choice's text."""
    names = [token_name(t, tok.decode([t]), as_ids) for t in ids]
    top = [None if lp is None else {**{token_name(i, tok.decode([i]), as_ids): v for i, v in k or []}, name: lp}
           for name, lp, k in zip(names, logprobs, tops or [None] * len(ids))]
    return {"tokens": names, "token_logprobs": list(logprobs), "top_logprobs": top, "text_offset": offsets.of(ids)}


def _usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def _merged(a: Logprobs | None, b: Logprobs) -> Logprobs:
    return b if a is None else {k: a[k] + b[k] for k in b}


async def _prompt_logprobs(state: ServerState, policy: Policy, ids: list[int], params: SamplingParams,
                           k: int, as_ids: bool) -> Logprobs:
    """The echoed prompt's logprobs, each token given those before it, at the sampling temperature."""
    scorable(state, policy)
    lps: list[float | None] = [None]
    tops: list[list[tuple[int, float]] | None] = [None]
    if len(ids) > 1:
        temperatures = [[params.logprob_temperature] * (len(ids) - 1)]
        [scored] = await asyncio.to_thread(scoring.score, state.host, policy.adapter, [(ids, 1)], k, 8192,
                                           temperatures)
        lps += scored.logprobs
        tops += scored.top or [None] * len(scored.logprobs)
    return _legacy_logprobs(state.host.tokenizer, ids, lps, tops, TextOffsets(state.host.tokenizer, []), as_ids)


class _Prompt:
    """One prompt of the batch: its ids and sampling, and what its echo puts before each choice."""

    def __init__(self, state: ServerState, body: TextCompletionRequest, prompt: str | list[int], param: str,
                 constraint: Constraint | None):
        self.ids = _token_ids(state, prompt, param)
        self.params = _sampling_params(state, body, len(self.ids), param, constraint)
        self.echo_ids = self.ids if body.echo else []
        text = prompt if isinstance(prompt, str) else state.host.tokenizer.decode(self.ids, skip_special_tokens=True)
        self.echo_text = text if body.echo else ""
        self.echo_logprobs: Logprobs | None = None

    async def echo(self, state: ServerState, policy: Policy, body: TextCompletionRequest) -> None:
        if body.echo and body.logprobs is not None:
            self.echo_logprobs = await _prompt_logprobs(state, policy, self.ids, self.params, body.logprobs,
                                                        body.return_tokens_as_token_ids)


def _choice(state: ServerState, body: TextCompletionRequest, p: _Prompt, index: int, seq: DecodeSequence | None,
            sampling: dict[str, Any]) -> dict[str, Any]:
    tok = state.host.tokenizer
    ids = list(seq.token_ids) if seq else []
    logprobs = None
    if body.logprobs is not None:
        sampled = _legacy_logprobs(tok, ids, seq.logprobs if seq else [], seq.top_logprobs if seq else None,
                                   TextOffsets(tok, p.echo_ids), body.return_tokens_as_token_ids)
        logprobs = _merged(p.echo_logprobs, sampled)
    return {"index": index, "text": p.echo_text + (output_text(state.host.chat, seq) if seq else ""),
            "logprobs": logprobs, "finish_reason": (seq.finish_reason or "stop") if seq else "length",
            "token_ids": ids, "prompt_token_ids": p.ids, "sampling": sampling}


async def _sequences(state: ServerState, policy: Policy, p: _Prompt, n: int,
                     disconnected: Disconnected) -> list[DecodeSequence | None]:
    if not p.params.max_tokens:  # echo alone: the prompt is scored, nothing sampled
        return [None] * n
    gen, events = submit(state, policy, p.ids, p.params, n=n)
    await wait_finished(gen, events, disconnected)
    return list(gen.sequences)


@router.post("/v1/completions", responses=documented(404, 409))
async def completions(body: TextCompletionRequest, request: Request, state: State):
    policy = await acquire_policy(state, body.model, require_api_key(request))
    batch = body.prompts()
    try:
        # compiled once for the batch: every prompt's rows follow the same grammar
        constraint = output_constraint(state, structured=body.structured_outputs) if body.structured_outputs else None
        prompts = [_Prompt(state, body, prompt, "prompt" if len(batch) == 1 else f"prompt[{i}]", constraint)
                   for i, prompt in enumerate(batch)]
        for p in prompts:
            await p.echo(state, policy, body)
        head = {"id": "cmpl-" + uuid.uuid4().hex, "object": "text_completion", "created": int(time.time()),
                "model": body.model}
        if body.stream:
            released, policy = policy, None  # the stream gives it back when it ends
            return StreamingResponse(_stream(state, body, prompts[0], released, head, request.is_disconnected),
                                     media_type="text/event-stream")
        choices, completion_tokens = [], 0
        for i, p in enumerate(prompts):
            sampling = sampling_info(state.host, policy, p.params, p.ids, None)
            for seq in await _sequences(state, policy, p, body.n, request.is_disconnected):
                choices.append(_choice(state, body, p, len(choices), seq, sampling))
                completion_tokens += len(seq.token_ids) if seq else 0
    finally:
        if policy is not None:
            state.runs.release(policy)
    return {**head, "choices": choices, "usage": _usage(sum(len(p.ids) for p in prompts), completion_tokens)}


async def _stream(state: ServerState, body: TextCompletionRequest, p: _Prompt, policy: Policy, head: dict[str, Any],
                  disconnected: Disconnected) -> AsyncIterator[str]:
    """Text deltas per choice; a stop string's first characters are held back until they are known
    not to start one. The lease on the policy is given back when the stream ends, however it ends."""
    sampling = sampling_info(state.host, policy, p.params, p.ids, None)
    tok = state.host.tokenizer
    sent_text, sent_tokens = [""] * body.n, [0] * body.n
    offsets = [TextOffsets(tok, p.echo_ids) for _ in range(body.n)]

    def chunk(index: int, text: str, finish: str | None = None, **extra: Any) -> str:
        return sse({**head, "choices": [{"index": index, "text": text, "finish_reason": finish, **extra}]})

    def delta(seq: DecodeSequence, final: bool) -> dict[str, Any]:
        # The engine thread may be appending to `seq`: only tokens whose every list is complete.
        i, sent = seq.index, sent_tokens[seq.index]
        end = len(seq.token_ids) if final else len(seq.top_logprobs) if body.logprobs else len(seq.logprobs)
        text = (output_text(state.host.chat, seq) if final
                else sendable(state.host.chat.text(seq.token_ids[:end]), body.stop))
        ids = list(seq.token_ids[sent:end])
        out: dict[str, Any] = {"text": text[len(sent_text[i]):] if text.startswith(sent_text[i]) else "",
                               "token_ids": ids, "logprobs": None}
        if body.logprobs is not None:
            out["logprobs"] = _legacy_logprobs(tok, ids, seq.logprobs[sent:end], seq.top_logprobs[sent:end],
                                               offsets[i], body.return_tokens_as_token_ids)
        sent_text[i] += out["text"]
        sent_tokens[i] = end
        return out

    finished, gen = 0, None
    try:
        for i in range(body.n):
            if body.echo:
                yield chunk(i, p.echo_text, logprobs=p.echo_logprobs, prompt_token_ids=p.ids)
        if not p.params.max_tokens:
            for i in range(body.n):
                yield chunk(i, "", "length", token_ids=[], sampling=sampling)
            finished = body.n
        else:
            gen, events = submit(state, policy, p.ids, p.params, n=body.n, stream=True)
            async for kind, seq in engine_events(gen, events, disconnected):
                if kind == "error":
                    yield sse(stream_failure(seq))
                    return
                if kind == "token":
                    if seq.finish_reason is None and (d := delta(seq, final=False))["token_ids"]:
                        yield chunk(seq.index, **d)
                    continue
                finished += 1
                yield chunk(seq.index, finish=seq.finish_reason or "stop", sampling=sampling, **delta(seq, final=True))
                if finished == body.n:
                    break
            else:
                return  # the client went away
        if (body.stream_options or {}).get("include_usage"):
            yield sse({**head, "choices": [], "usage": _usage(len(p.ids), sum(sent_tokens))})
        yield "data: [DONE]\n\n"
    finally:
        if gen is not None and finished < body.n:
            gen.cancelled = True
        state.runs.release(policy)
