"""Calling the judge model (openai SDK or litellm), with retries until it gives a valid verdict."""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import openai

from protocol.choices import Message
from protocol.offline import import_litellm
from protocol.retry import RetryPolicy, is_transient, transient_status
from rewards.ruler.config import JudgeConfig, JudgeError
from rewards.ruler.prompt import JudgePrompt, shorten
from rewards.ruler.reply import InvalidReply, JudgeScore, parse_reply, reply_format


class _DropJsonMode(Exception):
    """The endpoint refused response_format; try again without it."""


def _is_transient(exc: BaseException) -> bool:
    # An invalid reply is worth another try too: the judge is shown what was wrong with it.
    if isinstance(exc, (InvalidReply, _DropJsonMode)) or is_transient(exc):
        return True
    return transient_status(getattr(exc, "status_code", None), extra=frozenset({409}))


@dataclass
class JudgeUsage:
    """What one judgment took: its attempts, malformed replies, time, tokens and cost."""

    attempts: int = 0
    malformed: int = 0  # replies that came back but did not parse as a verdict for every id
    latency_s: float = 0.0
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cost_usd: float | None = None

    def add(self, response: Any, cost: float | None) -> None:
        usage = getattr(response, "usage", None)
        for name in ("prompt_tokens", "completion_tokens"):
            value = getattr(usage, name, None)
            if isinstance(value, int):
                setattr(self, name, (getattr(self, name) or 0) + value)
        if cost is not None:
            self.cost_usd = (self.cost_usd or 0.0) + cost


def _request_options(judge: JudgeConfig, ids: list[str] | None) -> dict[str, Any]:
    """What a judge call sends besides model and messages, whichever client sends it."""
    kwargs: dict[str, Any] = dict(judge.extra)
    if judge.temperature is not None:
        kwargs["temperature"] = judge.temperature
    if judge.max_tokens is not None:
        kwargs["max_tokens"] = judge.max_tokens
    if ids is not None:
        kwargs["response_format"] = reply_format(ids)
    return kwargs


async def _call_openai(judge: JudgeConfig, messages: list[Message], ids: list[str] | None) -> tuple[Any, float | None]:
    from openai import AsyncOpenAI

    # A custom endpoint never receives the user's OPENAI_API_KEY by accident.
    api_key = judge.api_key or (None if judge.base_url is None else "EMPTY")
    kwargs = _request_options(judge, ids)
    # max_retries=0: tenacity is the only retry layer, so attempts don't multiply.
    async with AsyncOpenAI(base_url=judge.base_url, api_key=api_key, timeout=judge.timeout_s, max_retries=0) as client:
        response = await client.chat.completions.create(model=judge.model, messages=messages, **kwargs)
    # A self-hosted endpoint has no list price; a name collision would report a bogus cost.
    return response, _list_price(judge.model, response) if judge.base_url is None else None


def _list_price(model: str, response: Any) -> float | None:
    try:
        usage = response.usage
        prompt_cost, completion_cost = import_litellm().cost_per_token(
            model=model, prompt_tokens=usage.prompt_tokens, completion_tokens=usage.completion_tokens
        )
        return float(prompt_cost + completion_cost)
    except Exception:  # unknown model or no usage: cost is optional
        return None


async def _call_litellm(judge: JudgeConfig, messages: list[Message], ids: list[str] | None) -> tuple[Any, float | None]:
    litellm = import_litellm()
    kwargs = _request_options(judge, ids)
    if judge.base_url is not None:
        kwargs["api_base"] = judge.base_url
    if judge.api_key is not None:
        kwargs["api_key"] = judge.api_key
    response = await litellm.acompletion(
        model=judge.model,
        messages=messages,
        timeout=judge.timeout_s,
        drop_params=True,  # providers without response_format support just don't get it
        num_retries=0,
        max_retries=0,
        **kwargs,
    )
    try:
        cost: float | None = float(litellm.completion_cost(completion_response=response, model=judge.model))
    except Exception:  # litellm doesn't know this model's price
        cost = None
    return response, cost


def _reply_text(response: Any) -> str | None:
    try:
        return response.choices[0].message.content
    except (AttributeError, IndexError):
        return None


async def ask_judge(
    judge: JudgeConfig, prompt: JudgePrompt, *, max_retries: int, backoff_s: float, backoff_max_s: float
) -> tuple[dict[str, JudgeScore], JudgeUsage]:
    usage = JudgeUsage()
    json_mode = judge.json_mode
    feedback: list[Message] = []
    call = _call_openai if judge.uses_openai_sdk else _call_litellm

    async def attempt() -> dict[str, JudgeScore]:
        nonlocal json_mode, feedback
        usage.attempts += 1
        started = time.perf_counter()
        try:
            response, cost = await call(judge, prompt.messages + feedback, prompt.ids if json_mode else None)
        except openai.BadRequestError:
            if not json_mode:
                raise
            json_mode = False
            raise _DropJsonMode() from None
        finally:
            usage.latency_s += time.perf_counter() - started
        usage.add(response, cost)
        text = _reply_text(response)
        try:
            return parse_reply(text, prompt.ids)
        except InvalidReply as exc:
            usage.malformed += 1
            # Show the judge its own reply and what was wrong; only the latest mistake matters.
            feedback = [
                {"role": "assistant", "content": shorten(text or "", 4000)},
                {"role": "user", "content": f"That reply was invalid: {exc}. Reply again with only the JSON object, "
                 f"with exactly one entry for each of these ids: {', '.join(prompt.ids)}; scores between 0 and 1."},
            ]
            raise

    policy = RetryPolicy(attempts=max_retries + 1, initial_wait=backoff_s, max_wait=backoff_max_s,
                         transient=_is_transient)
    try:
        scores = await policy.call(attempt)
    except Exception as exc:
        what = str(exc) or type(exc).__name__
        raise JudgeError(
            f"RULER judge {judge.model!r} gave no valid verdict after {usage.attempts} attempt(s) "
            f"({usage.malformed} malformed): {what}",
            attempts=usage.attempts,
            model=judge.model,
            malformed=usage.malformed,
        ) from exc
    return scores, usage
