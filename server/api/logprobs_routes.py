"""`POST /v1/logprobs`: a served model's logprobs of given token ids (protocol/logprobs.py), the
teacher's side of on-policy distillation, computed by server/model/scoring.py."""

from __future__ import annotations

import asyncio

from fastapi import APIRouter, Depends, Request

from protocol.logprobs import LogprobsRequest, LogprobsResponse, SequenceLogprobs
from server.api.auth import require_api_key
from server.api.deps import State
from server.api.errors import documented
from server.api.limits import GuardedRoute
from server.model import scoring
from server.request_errors import APIError
from server.sampling.engine_requests import acquire_policy, check_token_ids
from server.sampling.served_names import Policy
from server.state import ServerState

router = APIRouter(dependencies=[Depends(require_api_key)], route_class=GuardedRoute,
                   responses=documented(401, 503))


def scorable(state: ServerState, policy: Policy) -> None:
    if not scoring.adapter_here(state.host, policy.adapter):
        raise APIError(409, scoring.elsewhere(policy.name), param="model", code="not_scorable_here")


@router.post("/v1/logprobs", responses=documented(404, 409))
async def logprobs(body: LogprobsRequest, request: Request, state: State) -> LogprobsResponse:
    window = state.host.context_window
    for i, s in enumerate(body.sequences):
        check_token_ids(state, s.token_ids, f"sequences[{i}].token_ids")
        if len(s.token_ids) > window:
            raise APIError(400, f"sequences[{i}] is {len(s.token_ids)} tokens, more than this model's context "
                                f"window of {window}", param=f"sequences[{i}].token_ids",
                           code="context_length_exceeded")
    policy = await acquire_policy(state, body.model, require_api_key(request))  # loaded while it scores
    try:
        scorable(state, policy)
        scored = await asyncio.to_thread(scoring.score, state.host, policy.adapter,
                                         [(s.token_ids, s.start) for s in body.sequences], body.top_k)
    finally:
        state.runs.release(policy)
    return LogprobsResponse(model=body.model, data=[SequenceLogprobs(logprobs=s.logprobs, top=s.top, rest=s.rest)
                                                    for s in scored])
