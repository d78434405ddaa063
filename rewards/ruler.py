"""RULER-style relative judging: an LLM judge scores the trajectories of one group against each other.

GRPO only uses the order of rewards inside a group, so a judge that compares the group's attempts
side by side is both cheaper and more consistent than one that scores each attempt alone.

Usage::

    group = await score_group(group, "openai/gpt-4o-mini")                   # any litellm model
    group = await score_group(group, "http://127.0.0.1:8000/v1#qwen-judge")  # OpenAI-compatible
    group = await score_group(group, JudgeConfig(model="judge", base_url="http://...", api_key="k"))

Judge spec strings: anything starting with ``http://`` or ``https://`` is ``<base_url>#<model>`` and
goes through the ``openai`` SDK (``api_key`` only via :class:`JudgeConfig`); anything else is a
litellm model string and goes through ``litellm.acompletion`` (credentials from the environment,
as litellm reads them).

Failure policy (DESIGN invariant 4): a judge that is down or never gives a valid answer raises
:class:`JudgeError`; it never turns into zero rewards. Whoever gathers groups (see
:func:`ruler_hook`) is responsible for turning that raised error into the group's exception
entries, with all of the group's trajectories excluded from training.

Groups with fewer than two distinct trajectories (after de-duplication) are returned unchanged
with a log line and no judge call: there is nothing to compare, and a constant score gives GRPO
no signal. Pass ``judge_single=True`` to have such a group judged anyway (an absolute score).
"""

from __future__ import annotations

import json
import math
import re
import time
from dataclasses import dataclass, field
from typing import Any, Awaitable, Callable, Literal

import openai
from pydantic import BaseModel, ConfigDict, Field, StrictFloat, ValidationError

from protocol.choices import Message, MessageOrChoice, as_message
from protocol.offline import import_litellm
from protocol.retry import RetryPolicy, is_transient, transient_status
from protocol.trajectory import Trajectory, TrajectoryGroup

__all__ = [
    "DEFAULT_RUBRIC",
    "JudgeConfig",
    "JudgeError",
    "JudgePrompt",
    "JudgeReply",
    "JudgeScore",
    "build_judge_prompt",
    "ruler_hook",
    "score_group",
]

DEFAULT_RUBRIC = """\
- A trajectory that achieves the user's goal must score higher than one that does not.
- Among trajectories that achieve the goal, prefer the ones that do it correctly, completely and
  efficiently (no unnecessary turns or tool calls).
- Penalise invented facts, ignored instructions, wrong or malformed tool use and unsafe actions.
- Partial progress toward the goal earns partial credit.
- Trajectories of equal quality get equal scores."""

_SYSTEM_TEMPLATE = """\
You are a careful, impartial judge of AI agent behaviour. You are shown several trajectories: \
attempts by an agent at the same task. All of them start from the shared context; each then \
continues in its own way. Score every trajectory from 0 to 1 according to the rubric below.

The scores are relative: compare the trajectories with each other. A better trajectory must get a \
higher score, equally good ones the same score; use the range where the differences warrant it.

Rubric:
{rubric}

Reply with only a JSON object of this form and no other text:
{{"scores": [{{"trajectory_id": "<id>", "explanation": "<one or two sentences>", "score": <number from 0 to 1>}}]}}
Give exactly one entry for each of these trajectory ids: {ids}."""


JUDGMENT_FIGURES = ("judged", "failed", "skipped", "attempts", "malformed")


def judgment(**counts: int) -> dict[str, int]:
    """A group's judge figures (its metadata["ruler"]): each of JUDGMENT_FIGURES, 0 unless given."""
    return {name: counts.get(name, 0) for name in JUDGMENT_FIGURES}


class JudgeError(Exception):
    """The judge could not produce a valid verdict (unreachable, or invalid replies to the end)."""

    def __init__(self, message: str, *, attempts: int = 0, model: str = "", malformed: int = 0) -> None:
        super().__init__(message)
        self.attempts = attempts
        self.model = model
        self.malformed = malformed  # of the attempts, replies that came back but were no valid verdict
        # What the gather keeps of the failed group (client/gather.py): the judge's figures, so a
        # step can count malformed replies of the judgments that failed too.
        self.group_metadata = {"ruler": judgment(failed=1, attempts=attempts, malformed=malformed)}


class JudgeConfig(BaseModel):
    """Which judge to call and how.

    backend "auto": an explicit ``base_url`` means an OpenAI-compatible endpoint (openai SDK);
    no ``base_url`` means a litellm model string. Use backend="litellm" with ``base_url`` to send a
    litellm model (e.g. "openai/judge") to a custom ``api_base``.
    """

    model_config = ConfigDict(extra="forbid")

    model: str
    base_url: str | None = None
    api_key: str | None = None
    backend: Literal["auto", "litellm", "openai"] = "auto"
    temperature: float | None = None  # None: the provider's default (some reasoning models refuse others)
    max_tokens: int | None = None
    timeout_s: float = Field(default=120.0, gt=0)
    # Ask for the reply's JSON schema as response_format (ids as an enum, scores in [0, 1]); an
    # endpoint that constrains decoding (art-server, vLLM) then cannot answer out of shape.
    # Switched off for the rest of a call if the endpoint refuses it with a 400.
    json_mode: bool = True
    extra: dict[str, Any] = Field(default_factory=dict)  # passed through to the completion call

    @classmethod
    def parse(cls, judge: "str | JudgeConfig") -> "JudgeConfig":
        if isinstance(judge, JudgeConfig):
            return judge
        if judge.startswith(("http://", "https://")):
            base_url, sep, model = judge.partition("#")
            if not sep or not model:
                raise ValueError(f"judge URL {judge!r} needs the model after '#', e.g. http://host:8000/v1#my-model")
            return cls(model=model, base_url=base_url, backend="openai")
        return cls(model=judge, backend="litellm")

    @property
    def uses_openai_sdk(self) -> bool:
        return self.backend == "openai" or (self.backend == "auto" and self.base_url is not None)


class JudgeScore(BaseModel):
    trajectory_id: str
    explanation: str | None = ""
    # Strict: a bool or a string like "high" is a malformed reply, not a number to coerce.
    score: StrictFloat


class JudgeReply(BaseModel):
    scores: list[JudgeScore]


# ----------------------------------------------------------------------------------------------
# Rendering trajectories into a prompt


def _text_of(content: Any) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    if isinstance(content, list):  # multimodal parts: keep the text, name the rest
        parts = []
        for part in content:
            if isinstance(part, dict) and part.get("type") == "text":
                parts.append(str(part.get("text", "")))
            elif isinstance(part, dict):
                parts.append(f"[{part.get('type', 'part')}]")
            else:
                parts.append(str(part))
        return "\n".join(parts)
    return json.dumps(content, ensure_ascii=False, default=str)


def _plain_tool_calls(raw: Any) -> list[dict[str, str]]:
    calls = []
    for call in raw or []:
        if not isinstance(call, dict):
            call = call.model_dump()
        fn = call.get("function") or {}
        args = fn.get("arguments", "")
        calls.append({
            "id": str(call.get("id") or ""),
            "name": str(fn.get("name", "")),
            "arguments": args if isinstance(args, str) else json.dumps(args, ensure_ascii=False),
        })
    return calls


def _plain_message(item: MessageOrChoice) -> Message:
    """Only what a judge needs: logprobs, token ids and sampling info never leave the client."""
    msg = as_message(item)
    out: Message = {"role": str(msg.get("role")), "content": _text_of(msg.get("content"))}
    if msg.get("tool_calls"):
        out["tool_calls"] = _plain_tool_calls(msg["tool_calls"])
    if msg.get("tool_call_id") is not None:
        out["tool_call_id"] = str(msg["tool_call_id"])
    if msg.get("name"):
        out["name"] = str(msg["name"])
    return out


def _comparable(message: Message) -> Message:
    # Tool call ids are random per rollout; two identical behaviours must compare equal.
    calls = [{"name": c["name"], "arguments": c["arguments"]} for c in message.get("tool_calls") or []]
    return {**{k: v for k, v in message.items() if k not in ("tool_calls", "tool_call_id")}, "tool_calls": calls}


def shorten(text: str, limit: int) -> str:
    """Keep the head and tail of `text` (the start and the outcome matter most), drop the middle."""
    if limit <= 0 or len(text) <= limit:
        return text
    head = limit // 2
    tail = limit - head
    omitted = len(text) - head - tail
    return f"{text[:head]}\n[... {omitted} chars omitted ...]\n{text[-tail:] if tail else ''}"


@dataclass
class _CallNumbers:
    """Renumbers tool calls 1, 2, ... per trajectory so random call ids never reach the prompt."""

    by_id: dict[str, int] = field(default_factory=dict)
    names: dict[int, str] = field(default_factory=dict)

    def add(self, call_id: str, name: str) -> int:
        number = len(self.names) + 1
        if call_id:
            self.by_id.setdefault(call_id, number)
        self.names[number] = name
        return number


def _render_message(message: Message, calls: _CallNumbers, max_tool_chars: int) -> str:
    role = message["role"]
    if role == "tool":
        number = calls.by_id.get(message.get("tool_call_id", ""))
        label = f"tool result #{number}: {calls.names[number]}" if number else f"tool result: {message.get('name', '?')}"
        return f"[{label}]\n{shorten(message['content'], max_tool_chars)}"
    lines = [f"[{role}]"] if message["content"] or not message.get("tool_calls") else []
    if message["content"]:
        lines.append(message["content"])
    for call in message.get("tool_calls") or []:
        number = calls.add(call["id"], call["name"])
        lines.append(f"[{role} calls tool #{number}] {call['name']}({call['arguments']})")
    return "\n".join(lines)


def _render(messages: list[Message], calls: _CallNumbers, max_tool_chars: int) -> str:
    return "\n\n".join(_render_message(m, calls, max_tool_chars) for m in messages)


def _common_prefix_len(conversations: list[list[Message]]) -> int:
    comparable = [[_comparable(m) for m in conv] for conv in conversations]
    n = min(len(c) for c in comparable)
    for i in range(n):
        if any(c[i] != comparable[0][i] for c in comparable[1:]):
            return i
    return n


def _render_tools(trajectories: list[Trajectory], max_description_chars: int = 300) -> str:
    seen: dict[str, str] = {}
    for traj in trajectories:
        for tool in traj.tools or []:
            fn = tool.get("function", tool) if isinstance(tool, dict) else {}
            name = str(fn.get("name", ""))
            if not name or name in seen:
                continue
            params = list(((fn.get("parameters") or {}).get("properties") or {}).keys())
            description = shorten(" ".join(str(fn.get("description", "")).split()), max_description_chars)
            seen[name] = f"- {name}({', '.join(params)})" + (f": {description}" if description else "")
    return "\n".join(seen.values())


@dataclass
class JudgePrompt:
    messages: list[Message]
    ids: list[str]  # the ids the judge must answer for, in prompt order
    id_of: list[str]  # for each trajectory of the group, the id whose score it receives


def build_judge_prompt(
    group: TrajectoryGroup,
    rubric: str = DEFAULT_RUBRIC,
    *,
    max_tool_output_chars: int = 2000,
    max_trajectory_chars: int = 20000,
) -> JudgePrompt:
    """The judge's messages: shared context once, each distinct remainder once under its own id."""
    conversations = [[_plain_message(i) for i in t.messages_and_choices] for t in group.trajectories]
    prefix_len = _common_prefix_len(conversations) if conversations else 0

    remainders: dict[str, str] = {}  # comparable key -> rendered remainder
    key_to_id: dict[str, str] = {}
    id_of: list[str] = []
    prefix_text = ""
    for conv in conversations:
        calls = _CallNumbers()
        # Prefix first so call numbers in the remainder continue from those in the shared context.
        prefix_text = _render(conv[:prefix_len], calls, max_tool_output_chars)
        rest = conv[prefix_len:]
        key = json.dumps([_comparable(m) for m in rest], sort_keys=True, ensure_ascii=False)
        if key not in key_to_id:
            key_to_id[key] = f"t{len(key_to_id) + 1}"
            remainders[key] = _render(rest, calls, max_tool_output_chars)
        id_of.append(key_to_id[key])

    sections = []
    tools = _render_tools(group.trajectories)
    if tools:
        sections.append(f"<tools>\n{tools}\n</tools>")
    sections.append(f"<shared_context>\n{shorten(prefix_text, max_trajectory_chars) or '(none)'}\n</shared_context>")
    for key, tid in key_to_id.items():
        body = shorten(remainders[key], max_trajectory_chars) or "(no messages beyond the shared context)"
        sections.append(f'<trajectory id="{tid}">\n{body}\n</trajectory>')

    ids = list(key_to_id.values())
    system = _SYSTEM_TEMPLATE.format(rubric=rubric.strip(), ids=", ".join(ids))
    return JudgePrompt(
        messages=[{"role": "system", "content": system}, {"role": "user", "content": "\n\n".join(sections)}],
        ids=ids,
        id_of=id_of,
    )


# ----------------------------------------------------------------------------------------------
# Parsing and validating the judge's reply


class _InvalidReply(Exception):
    """A reply we can't use; the message is shown to the judge on the retry."""


_FENCE = re.compile(r"^```[a-zA-Z0-9_-]*\s*\n?(.*?)\n?```\s*$", re.DOTALL)


def _loads_tolerant(text: str) -> Any:
    text = text.strip()
    fenced = _FENCE.match(text)
    if fenced:
        text = fenced.group(1).strip()
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        pass
    # Some models wrap the object in prose; take the outermost braces.
    start, end = text.find("{"), text.rfind("}")
    if start != -1 and end > start:
        try:
            return json.loads(text[start : end + 1])
        except json.JSONDecodeError:
            pass
    raise _InvalidReply("the reply is not valid JSON")


def parse_reply(text: str | None, ids: list[str]) -> dict[str, JudgeScore]:
    """Scores keyed by trajectory id; raises _InvalidReply on anything we should not train on."""
    if not text or not text.strip():
        raise _InvalidReply("the reply was empty")
    try:
        reply = JudgeReply.model_validate(_loads_tolerant(text))
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc']))}: {e['msg']}" for e in exc.errors()[:5])
        raise _InvalidReply(f"the JSON does not match the required shape ({problems})") from None
    got = [s.trajectory_id for s in reply.scores]
    problems = []
    duplicates = sorted({i for i in got if got.count(i) > 1})
    missing = [i for i in ids if i not in got]
    extra = sorted(set(got) - set(ids))
    if duplicates:
        problems.append(f"duplicate ids {', '.join(duplicates)}")
    if missing:
        problems.append(f"missing ids {', '.join(missing)}")
    if extra:
        problems.append(f"unknown ids {', '.join(extra)}")
    bad = [f"{s.trajectory_id}={s.score}" for s in reply.scores if not (math.isfinite(s.score) and 0.0 <= s.score <= 1.0)]
    if bad:
        problems.append(f"scores outside [0, 1]: {', '.join(bad)}")
    if problems:
        raise _InvalidReply("; ".join(problems))
    return {s.trajectory_id: s for s in reply.scores}


# ----------------------------------------------------------------------------------------------
# Calling the judge


class _DropJsonMode(Exception):
    """The endpoint refused response_format; try again without it."""


def _is_transient(exc: BaseException) -> bool:
    # An invalid reply is worth another try too: the judge is shown what was wrong with it.
    if isinstance(exc, (_InvalidReply, _DropJsonMode)) or is_transient(exc):
        return True
    return transient_status(getattr(exc, "status_code", None), extra=frozenset({409}))


@dataclass
class _Usage:
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


def reply_format(ids: list[str]) -> dict[str, Any]:
    """The judge's reply as an OpenAI `json_schema` response_format."""
    entry = {"type": "object", "additionalProperties": False, "required": ["trajectory_id", "explanation", "score"],
             "properties": {"trajectory_id": {"type": "string", "enum": ids},
                            "explanation": {"type": "string", "maxLength": 240},
                            "score": {"type": "number", "minimum": 0, "maximum": 1}}}
    schema = {"type": "object", "additionalProperties": False, "required": ["scores"],
              "properties": {"scores": {"type": "array", "items": entry, "minItems": len(ids), "maxItems": len(ids)}}}
    return {"type": "json_schema", "json_schema": {"name": "ruler_scores", "schema": schema}}


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


async def _judge(
    judge: JudgeConfig, prompt: JudgePrompt, *, max_retries: int, backoff_s: float, backoff_max_s: float
) -> tuple[dict[str, JudgeScore], _Usage]:
    usage = _Usage()
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
        except _InvalidReply as exc:
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


# ----------------------------------------------------------------------------------------------
# Public API


def _skip(group: TrajectoryGroup, reason: str) -> TrajectoryGroup:
    out = group.model_copy(deep=True)
    for traj in out.trajectories:
        traj.logs.append(f"RULER: not judged ({reason})")
    out.metadata["ruler"] = judgment(skipped=1)
    return out


async def score_group(
    group: TrajectoryGroup,
    judge: str | JudgeConfig,
    rubric: str = DEFAULT_RUBRIC,
    *,
    weight: float = 1.0,
    max_retries: int = 3,
    backoff_s: float = 1.0,
    backoff_max_s: float = 30.0,
    judge_single: bool = False,
    max_tool_output_chars: int = 2000,
    max_trajectory_chars: int = 20000,
) -> TrajectoryGroup:
    """Score a group relative to itself; returns a new group (the input is never mutated).

    Each trajectory gets ``metrics["independent_reward"]`` (its reward before), ``metrics["ruler_score"]``,
    the judge's explanation in ``logs`` and ``reward = weight * ruler_score + (1 - weight) * independent``.
    The ``ruler_*`` call figures (latency_s, prompt/completion tokens, cost_usd when litellm knows the
    price, attempts, malformed replies) describe the one judge call of the whole group, repeated on
    each trajectory: sum them over groups, not over trajectories. The group's ``metadata["ruler"]``
    counts the judgment once (judged, or skipped with nothing to compare; attempts; malformed
    replies), and a :class:`JudgeError` carries the same for a judgment that failed (``group_metadata``).

    ``max_retries`` is the number of retries after the first attempt (invalid replies and transient
    errors alike); then :class:`JudgeError` is raised.
    """
    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"weight must be in [0, 1], got {weight}")
    if max_retries < 0:
        raise ValueError("max_retries must be >= 0")
    config = JudgeConfig.parse(judge)
    if len(group.trajectories) < 2 and not judge_single:
        return _skip(group, f"{len(group.trajectories)} trajectories in the group, nothing to compare")

    prompt = build_judge_prompt(
        group, rubric, max_tool_output_chars=max_tool_output_chars, max_trajectory_chars=max_trajectory_chars
    )
    if len(prompt.ids) < 2 and not judge_single:
        return _skip(group, "all trajectories are identical, nothing to compare")

    scores, usage = await _judge(config, prompt, max_retries=max_retries, backoff_s=backoff_s, backoff_max_s=backoff_max_s)

    out = group.model_copy(deep=True)
    for traj, tid in zip(out.trajectories, prompt.id_of):
        verdict = scores[tid]
        independent = traj.reward
        traj.metrics.update({
            "independent_reward": independent,
            "ruler_score": verdict.score,
            "ruler_latency_s": usage.latency_s,
            "ruler_attempts": usage.attempts,
            "ruler_malformed": usage.malformed,
            "ruler_unique_trajectories": len(prompt.ids),
        })
        for name in ("prompt_tokens", "completion_tokens", "cost_usd"):
            if getattr(usage, name) is not None:
                traj.metrics[f"ruler_{name}"] = getattr(usage, name)
        traj.reward = weight * verdict.score + (1.0 - weight) * independent
        traj.logs.append(f"RULER [{tid}] score={verdict.score:.3f} (judge {config.model}): {verdict.explanation or ''}")
    out.metadata["ruler"] = judgment(judged=1, attempts=usage.attempts, malformed=usage.malformed)
    return out


def ruler_hook(
    judge: str | JudgeConfig, rubric: str = DEFAULT_RUBRIC, **kw: Any
) -> Callable[[TrajectoryGroup], Awaitable[TrajectoryGroup]]:
    """A per-group hook for a gather function, so each group is judged as soon as its rollouts finish.

    The hook raises :class:`JudgeError` when the judge fails. The gather must catch it and record
    the group as failed (its trajectories excluded, the error in ``exceptions``), never as zero
    rewards. ``kw`` goes to :func:`score_group`.
    """
    config = JudgeConfig.parse(judge)  # fail on a malformed spec now, not after the rollouts

    async def hook(group: TrajectoryGroup) -> TrajectoryGroup:
        return await score_group(group, config, rubric, **kw)

    return hook
