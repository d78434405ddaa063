"""`POST /inference/v1/generate`: token ids in, token ids and logprobs out (vLLM's token-in route,
which verifiers' train client calls; it renders prompts itself and decodes the answer itself).

The prompt is sampled exactly as sent. Its sampling record fingerprints those ids, so a choice
from here trains like a chat choice: training re-renders the conversation with art-server's own
template and counts a prompt mismatch when the client rendered it otherwise, never training on it
silently.

Stop tokens: the model's turn ends where art-server's stop set says (its EOS ids and the
template's turn end), whatever the request lists, because that set is what training and the
splicing of sampled turns read as the end of a turn. A listed id outside that set is refused: the
server would sample past the point where the client thinks the turn ends.
"""

from __future__ import annotations

import uuid
from typing import Any

from fastapi import APIRouter, Depends, Request

from server.api.auth import require_api_key
from server.api.deps import State
from server.api.errors import documented
from server.api.generate_schemas import GenerateRequest
from server.api.limits import GuardedRoute
from server.engine.base import DecodeSequence
from server.engine.sampling import SamplingParams
from server.request_errors import APIError
from server.sampling.choices import sampling_info
from server.sampling.engine_requests import (acquire_policy, check_params, check_token_ids, output_constraint,
                                             room, submit, wait_finished)
from server.state import ServerState

router = APIRouter(dependencies=[Depends(require_api_key)], route_class=GuardedRoute,
                   responses=documented(401, 503))


def _sampling_params(state: ServerState, body: GenerateRequest) -> SamplingParams:
    check_token_ids(state, body.token_ids, "token_ids")
    sp = body.sampling_params
    stop_ids = state.host.chat.stop_ids
    foreign = sorted(set(sp.stop_token_ids) - stop_ids)
    if foreign:
        raise APIError(400, f"sampling_params.stop_token_ids: {foreign} are not among the ids this model's turns "
                            f"end on ({sorted(stop_ids)}); art-server would not stop there",
                       param="sampling_params.stop_token_ids", code="unsupported_stop_token_ids")
    max_tokens = room(state, len(body.token_ids), "token_ids", sp.max_tokens)
    constraint = (output_constraint(state, "sampling_params.", structured=sp.structured_outputs)
                  if sp.structured_outputs else None)
    params = SamplingParams(temperature=sp.temperature, top_p=sp.top_p, max_tokens=max_tokens, stop=sp.stop,
                            seed=sp.seed, ignore_eos=sp.ignore_eos, constraint=constraint)
    check_params(state, params)
    return params


def _choice(seq: DecodeSequence, sampling: dict[str, Any]) -> dict[str, Any]:
    # vLLM names a token "token_id:<id>" in this route's logprobs: the client decodes, not the server.
    return {"index": seq.index, "finish_reason": seq.finish_reason or "stop", "token_ids": list(seq.token_ids),
            "logprobs": {"content": [{"token": f"token_id:{t}", "logprob": lp}
                                     for t, lp in zip(seq.token_ids, seq.logprobs)]},
            "sampling": sampling}


@router.post("/inference/v1/generate", responses=documented(404, 409))
async def generate(body: GenerateRequest, request: Request, state: State) -> dict[str, Any]:
    policy = await acquire_policy(state, body.model, require_api_key(request))
    try:
        params = _sampling_params(state, body)
        gen, events = submit(state, policy, body.token_ids, params)
        await wait_finished(gen, events, request.is_disconnected)
    finally:
        state.runs.release(policy)
    sampling = sampling_info(state.host, policy, params, body.token_ids, None)
    completion_tokens = sum(len(s.token_ids) for s in gen.sequences)
    return {"request_id": "gen-" + uuid.uuid4().hex, "model": body.model,
            "choices": [_choice(s, sampling) for s in gen.sequences],
            "prompt_token_ids": body.token_ids,
            "usage": {"prompt_tokens": len(body.token_ids), "completion_tokens": completion_tokens,
                      "total_tokens": len(body.token_ids) + completion_tokens}}
