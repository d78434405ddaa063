"""One path from a chat request to sampled choices, shared by every API face.

Chat Completions, Responses and Anthropic Messages all arrive here as a ChatCompletionRequest
(the two other faces translate theirs, server/api/translate.py): the model resolves to a policy,
the prompt is rendered through the model's template with earlier sampled turns spliced in as their
exact ids, the engine samples while a lease is held on the policy, and each finished sequence
becomes a chat choice that is remembered in the turn cache and, inside a session, recorded
(server/harness/sessions.py). The faces differ only in how they dress the choice up.

A request with `tools` to a model whose template cannot show them is refused (unless the operator
passed --allow-unrendered-tools): the model would answer without ever seeing the tools, and an
agent trained that way cannot learn to call them.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any, AsyncIterator

from server.chat.render import RenderedPrompt
from server.chat.template import TemplateError
from server.chat.validate import RenderError, validate_messages
from server.engine.sampling import SamplingParams
from server.harness.sessions import Recording, SessionError
from server.request_errors import APIError, session_error
from server.runs.ownership import Caller
from server.sampling.chat_request import ChatCompletionRequest
from server.sampling.choices import build_choice, sampling_info
from server.sampling.engine_requests import (Disconnected, acquire_policy, check_params, check_served,
                                             output_constraint, room, submit, wait_finished)
from server.sampling.streaming import Completion, chunk_stream
from server.state import ServerState

Recorder = Recording  # a session's, for a request under /v1/sessions/{id}/


def unrendered_tools_message(model: str) -> str:
    return (f"model {model}: its chat template does not render tools, so the model would never see them; "
            f"restart art-server with --chat-template FILE (a template that renders tools), "
            f"or with --allow-unrendered-tools to accept them unseen")


def _prompt(state: ServerState, body: ChatCompletionRequest) -> RenderedPrompt:
    try:
        validate_messages(body.messages)
    except RenderError as e:
        raise APIError(400, str(e), param="messages", code="invalid_messages")
    vocab = state.host.vocab_size
    for i, m in enumerate(body.messages):
        ids = m.get("token_ids")
        if ids is not None and (not isinstance(ids, list) or not all(isinstance(t, int) and 0 <= t < vocab for t in ids)):
            raise APIError(400, f"messages[{i}].token_ids must be token ids below {vocab}", param=f"messages[{i}].token_ids")
    if body.tools and not state.host.chat.template.renders_tools and not state.settings.allow_unrendered_tools:
        raise APIError(400, unrendered_tools_message(state.host.name), param="tools", code="tools_not_rendered")
    try:
        return state.host.chat.turns.prompt(body.messages, body.tool_dicts(), body.chat_template_kwargs)
    except TemplateError as e:
        raise APIError(400, str(e), param="messages", code="invalid_messages")


def _sampling_params(state: ServerState, body: ChatCompletionRequest, prompt_len: int) -> SamplingParams:
    max_tokens = room(state, prompt_len, "messages", body.token_budget())
    constraint = output_constraint(state, response_format=body.response_format, tool_choice=body.tool_choice,
                                   tools=body.tools, parallel_tool_calls=body.parallel_tool_calls,
                                   structured=body.structured_outputs)
    params = SamplingParams(temperature=body.temperature, top_p=body.top_p, max_tokens=max_tokens, stop=body.stop,
                            seed=body.seed, top_logprobs=body.top_logprobs or 0, ignore_eos=body.ignore_eos,
                            constraint=constraint)
    check_params(state, params)
    return params


async def prompt_ids(state: ServerState, body: ChatCompletionRequest, who: Caller) -> list[int]:
    """The request's prompt as `start` would render it for `body.model` (a name `who` may sample
    from), sampling nothing: Anthropic's count_tokens, vLLM's tokenize."""
    await check_served(state, body.model, who)
    return _prompt(state, body).ids


async def start(state: ServerState, body: ChatCompletionRequest, who: Caller,
                record: Recorder | None = None) -> Completion:
    """The request rendered, checked and handed to the engine, holding its policy until `release`
    is called (by `finish` or at the end of a stream); `who` may sample only from the base model
    and its own runs."""
    policy = await acquire_policy(state, body.model, who)
    begun = False
    try:
        prompt = _prompt(state, body)
        params = _sampling_params(state, body, len(prompt.ids))
        if record is not None:  # only now: a request refused above leaves no trace in the session
            _begin(record, body)
            begun = True
        gen, events = submit(state, policy, prompt.ids, params, n=body.n, stream=body.stream)
    except BaseException:
        state.runs.release(policy)
        if begun:
            record.end()
        raise

    def release() -> None:
        state.runs.release(policy)
        if record is not None:
            record.end()

    return Completion(gen, events, "chatcmpl-" + uuid.uuid4().hex, int(time.time()), body.model, prompt.ids,
                      sampling_info(state.host, policy, params, prompt.ids, body.chat_template_kwargs),
                      body.callable_tools(), body.stop, bool((body.stream_options or {}).get("include_usage")),
                      body.return_tokens_as_token_ids, release=release, on_choice=record)


def _begin(record: Recorder, body: ChatCompletionRequest) -> None:
    """The session takes one more exchange, or the request is refused before it is sampled."""
    try:
        record.begin(body.messages, body.tool_dicts())
    except SessionError as e:
        raise session_error(e)


async def finish(state: ServerState, c: Completion, disconnected: Disconnected) -> list[dict[str, Any]]:
    """Every choice of a request that does not stream, in index order; a client gone cancels it."""
    try:
        await wait_finished(c.gen, c.events, disconnected)
        choices = [build_choice(state.host, s, c.sampling, c.tools, c.tokens_as_ids) for s in c.gen.sequences]
        if c.on_choice is not None:  # stored before the answer and the release (which ends the exchange)
            for choice in choices:
                await asyncio.to_thread(c.on_choice, choice)  # a large exchange takes a while to write
    finally:
        c.release()
    return choices


def stream(state: ServerState, c: Completion, disconnected: Disconnected) -> AsyncIterator[dict[str, Any]]:
    """Chat chunks as dicts, each choice complete in `c.choices` once its last chunk is out."""
    return chunk_stream(state.host, c, disconnected)


def usage(c: Completion) -> tuple[int, int]:
    """(prompt tokens, completion tokens) of a finished request."""
    return len(c.prompt_ids), sum(len(s.token_ids) for s in c.gen.sequences)

