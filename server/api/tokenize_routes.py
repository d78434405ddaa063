"""vLLM's `POST /tokenize` and `POST /detokenize`, with the base model's tokenizer.

A `prompt` is encoded as text (with the tokenizer's special tokens unless `add_special_tokens` is
false); `messages` are rendered exactly as a chat completion of them would be, earlier sampled turns
spliced in as their exact ids, so a client sees the ids the model would be prompted with.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Depends, Request
from fastapi.exceptions import RequestValidationError
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from server.api.auth import require_api_key
from server.api.deps import State
from server.api.errors import documented
from server.api.limits import GuardedRoute
from server.sampling import completions
from server.sampling.chat_request import (AddGenerationPrompt, ChatCompletionRequest, ContinueFinalMessage, Messages,
                                         refused)
from server.sampling.engine_requests import check_served, check_token_ids

router = APIRouter(dependencies=[Depends(require_api_key)], route_class=GuardedRoute,
                   responses=documented(401, 503))


class TokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")  # vLLM's multimodal and cache keys: nothing a text tokenizer reads

    model: str | None = Field(default=None, max_length=300)  # checked when given; the base model's tokenizer
    prompt: str | None = None
    messages: Messages | None = None
    tools: list[dict[str, Any]] | None = None
    chat_template_kwargs: dict[str, Any] | None = None
    add_special_tokens: bool | None = None  # vLLM's defaults: true for a prompt, false for messages
    return_token_strs: bool = False
    add_generation_prompt: AddGenerationPrompt = None
    continue_final_message: ContinueFinalMessage = None
    chat_template: refused(str | None, "chat_template is not supported per request: art-server renders with the "
                           "template it serves (art-server --chat-template)") = None

    @model_validator(mode="after")
    def _one(self) -> "TokenizeRequest":
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give a prompt or messages, one of them")
        if self.messages is not None and self.add_special_tokens:
            raise ValueError("add_special_tokens is not supported with messages: the template writes them")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="allow")

    model: str | None = Field(default=None, max_length=300)
    tokens: list[int] = Field(max_length=10_000_000)


@router.post("/tokenize", responses=documented(400, 404))
async def tokenize(body: TokenizeRequest, request: Request, state: State) -> dict[str, Any]:
    who, model = require_api_key(request), body.model or state.host.name
    if body.messages is None:
        await check_served(state, model, who)
        ids = state.host.tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens is not False)
    else:
        try:
            chat = ChatCompletionRequest.model_validate({
                "model": model, "messages": body.messages, "tools": body.tools,
                "chat_template_kwargs": body.chat_template_kwargs})
        except ValidationError as e:  # named as a field of this body, as any other 400
            raise RequestValidationError(e.errors())
        ids = await completions.prompt_ids(state, chat, who)
    out = {"count": len(ids), "max_model_len": state.host.context_window, "tokens": ids}
    if body.return_token_strs:
        out["token_strs"] = state.host.tokenizer.convert_ids_to_tokens(ids)
    return out


@router.post("/detokenize", responses=documented(400, 404))
async def detokenize(body: DetokenizeRequest, request: Request, state: State) -> dict[str, str]:
    await check_served(state, body.model or state.host.name, require_api_key(request))
    check_token_ids(state, body.tokens, "tokens")
    return {"prompt": state.host.tokenizer.decode(body.tokens)}
