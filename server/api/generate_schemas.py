"""The token-in request of `POST /inference/v1/generate`, as vLLM takes it and verifiers' train
client (`renderers.client.generate`) sends it: prompt token ids the client rendered itself, and
vLLM's sampling params.

Sampling keys art-server has no use for (`skip_special_tokens`, `logprobs`: the sampled token's
logprob always comes back) are accepted and ignored. Keys that would change the distribution
sampled from are refused unless neutral: art-server samples with temperature and top-p only, and a
choice whose logprobs are not of the distribution it was drawn from would train wrong. Structured
outputs are honoured, as on the OpenAI routes (server/sampling/chat_request.py's VLLMSampling).
"""

from __future__ import annotations

from typing import Annotated, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator

from protocol.choices import INT64
from server.sampling.chat_request import Stops, VLLMSampling


def _nulls_dropped(data: Any) -> Any:
    # null means vLLM's default, as vLLM reads it.
    return {k: v for k, v in data.items() if v is not None} if isinstance(data, dict) else data


class GenerateSamplingParams(VLLMSampling):
    model_config = ConfigDict(extra="allow")

    temperature: float = Field(default=1.0, ge=0, le=2, allow_inf_nan=False)
    top_p: float = Field(default=1.0, gt=0, le=1, allow_inf_nan=False)
    max_tokens: int | None = Field(default=None, ge=1, le=INT64)  # absent: whatever the context window leaves
    seed: int | None = Field(default=None, ge=-(2**63), le=INT64)
    stop: Stops = Field(default=None, validate_default=True)
    stop_token_ids: list[Annotated[int, Field(ge=0, le=INT64)]] = Field(default_factory=list, max_length=64)
    ignore_eos: bool = False
    n: int | None = None

    @model_validator(mode="before")
    @classmethod
    def _defaults_for_nulls(cls, data: Any) -> Any:
        return _nulls_dropped(data)

    @field_validator("n")
    @classmethod
    def _one(cls, v: int | None) -> int | None:
        if v not in (None, 1):
            raise ValueError("one choice per request: send the request again for another")
        return v


class GenerateRequest(BaseModel):
    # Unknown keys (vLLM's `priority`, a client's bookkeeping) are accepted and ignored.
    model_config = ConfigDict(extra="allow")

    model: str = Field(max_length=300)
    token_ids: list[Annotated[int, Field(ge=0, le=INT64)]] = Field(min_length=1)
    sampling_params: GenerateSamplingParams = Field(default_factory=GenerateSamplingParams)
    # vLLM's prefix-cache isolation: the engines here keep no prefix cache shared across requests.
    cache_salt: str | None = Field(default=None, max_length=1000)
    content_parts: Any = None
    features: Any = None

    @field_validator("content_parts", "features")
    @classmethod
    def _no_images(cls, v: Any, info: ValidationInfo) -> None:
        if v is not None:
            raise ValueError("art-server serves text models; multimodal input (images, video) is not supported")
        return None
