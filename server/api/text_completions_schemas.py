"""The request of `POST /v1/completions`, OpenAI's legacy text completion as vLLM serves it: a prompt
as text or token ids (or a batch of either), continued without a chat template, sampled as a chat
completion is (server/sampling/chat_request.py's OpenAISampling: its bounds and refusals)."""

from __future__ import annotations

from typing import Annotated, Any, Union

from pydantic import Field, field_validator, model_validator

from protocol.choices import INT64
from protocol.logprobs import MAX_TOP_K
from server.request_errors import ParamError
from server.sampling.chat_request import OpenAISampling

TokenIds = list[Annotated[int, Field(ge=0, le=INT64)]]


class TextCompletionRequest(OpenAISampling):
    prompt: Union[str, TokenIds, list[str], list[TokenIds]]
    # OpenAI's and vLLM's default; 0 only with echo (the prompt's logprobs, as lm-eval asks for them).
    max_tokens: int | None = Field(default=16, ge=0, le=INT64)
    logprobs: int | None = Field(default=None, ge=0, le=MAX_TOP_K)  # the k likeliest beside each token
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None

    @field_validator("prompt")
    @classmethod
    def _not_empty(cls, v: Any) -> Any:
        if isinstance(v, list) and (not v or any(isinstance(p, list) and not p for p in v)):
            raise ValueError("a prompt needs at least one token")
        return v

    @field_validator("suffix")
    @classmethod
    def _no_suffix(cls, v: str | None) -> None:
        if v:
            raise ValueError("suffix (insertion) is not supported: the model continues the prompt only")
        return None

    @model_validator(mode="after")
    def _check(self) -> "TextCompletionRequest":
        if self.best_of not in (None, self.n):
            raise ParamError("best_of", "best_of is not supported: every sample is returned (use n)")
        if self.max_tokens == 0 and not self.echo:
            raise ParamError("max_tokens", "max_tokens 0 generates nothing; it is only meaningful with echo")
        if self.stream and len(self.prompts()) > 1:
            raise ParamError("prompt", "a streamed request takes one prompt; send the others as requests of their own")
        return self

    def prompts(self) -> list[str | list[int]]:
        """The batch, one prompt (text or token ids) per entry."""
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)
