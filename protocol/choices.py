"""What the server attaches to every sampled turn, and the helpers that read it back.

A Choice as art-server returns it carries, beyond OpenAI's shape: `token_ids` (the sampled ids,
vLLM's `return_token_ids` convention), per-token logprobs at the sampling temperature in
`logprobs.content`, and `sampling` (a SamplingInfo). These are the training data (invariants 1-2).
"""

from __future__ import annotations

import math
from typing import Any, Union

from openai.types.chat.chat_completion import Choice
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from protocol.validation import first_problem

Message = dict[str, Any]
MessageOrChoice = Union[Choice, Message]
INT64 = 2**63 - 1
# Fields of an OpenAI assistant message that carry nothing a chat template or a judge reads.
_NOT_MESSAGE = {"refusal", "annotations", "audio", "function_call"}


class SamplingInfo(BaseModel):
    """How a choice was sampled, so the trainer can verify it later (invariants 1-2)."""

    model_config = ConfigDict(extra="allow")

    temperature: float = Field(ge=0, le=2, allow_inf_nan=False)
    top_p: float = Field(gt=0, le=1, allow_inf_nan=False)
    # Logprobs are of softmax(logits / logprob_temperature); equals temperature unless greedy.
    logprob_temperature: float = Field(gt=0, le=2, allow_inf_nan=False)
    policy: str = Field(max_length=200)  # the served name that produced it: base, run or run@step
    step: int = Field(ge=0, le=INT64)  # policy step (0 = the base model / untrained adapter)
    prompt_fingerprint: str = Field(max_length=64)  # sha256 of the prompt token ids, truncated
    prompt_len: int = Field(ge=0, le=INT64)
    model_fingerprint: str = Field(max_length=64)  # base weights + tokenizer; another model's choice is refused


def is_choice_dict(item: Any) -> bool:
    """A serialised Choice (as it travels over HTTP) has `message` and `finish_reason` keys."""
    return isinstance(item, dict) and "message" in item and "finish_reason" in item


def choice_token_ids(choice: Choice) -> list[int] | None:
    ids = getattr(choice, "token_ids", None)
    return list(ids) if ids is not None else None


def choice_logprobs(choice: Choice) -> list[float] | None:
    if choice.logprobs is None or choice.logprobs.content is None:
        return None
    return [t.logprob for t in choice.logprobs.content]


def choice_sampling(choice: Choice) -> SamplingInfo | None:
    raw = getattr(choice, "sampling", None)
    if raw is None:
        return None
    return raw if isinstance(raw, SamplingInfo) else SamplingInfo.model_validate(raw)


def malformed_tool_call(choice: Choice) -> bool:
    """The server saw a tool call it could not parse; the text stays in `content`."""
    return bool(getattr(choice, "malformed_tool_call", False))


def as_message(item: MessageOrChoice) -> Message:
    """A Choice as the plain assistant message a client sends back; a message dict unchanged."""
    if isinstance(item, Choice):
        return item.message.model_dump(exclude_none=True, exclude=_NOT_MESSAGE)
    return item


def check_choice_numbers(choice: Choice, where: str) -> None:
    """Shape checks that need no model: as many logprobs as ids, every logprob a finite log-probability."""
    if not isinstance(getattr(choice, "token_ids", None), (list, type(None))):  # an extra field: any JSON
        raise ValueError(f"{where}: token_ids must be a list of non-negative integers")
    ids, lps = choice_token_ids(choice), choice_logprobs(choice)
    if ids is not None and lps is not None and len(ids) != len(lps):
        raise ValueError(f"{where}: {len(ids)} token_ids but {len(lps)} logprobs")
    if lps is not None and any(not math.isfinite(lp) or lp > 1e-6 for lp in lps):
        raise ValueError(f"{where}: logprobs must be finite and <= 0")
    if ids is not None and any(not isinstance(t, int) or t < 0 or t > INT64 for t in ids):
        raise ValueError(f"{where}: token_ids must be non-negative integers")
    try:
        choice_sampling(choice)  # validates the record when present
    except ValidationError as e:  # one line naming the field, not pydantic's report
        field, why = first_problem(e)
        raise ValueError(f"{where}: {f'sampling.{field}' if field else 'sampling'}: {why}") from None
