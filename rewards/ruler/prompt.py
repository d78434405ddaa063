"""The judge's prompt: a group's shared context once, then each distinct remainder under its own id."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

from protocol.choices import Message, MessageOrChoice, as_message
from protocol.trajectory import Trajectory, TrajectoryGroup

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
