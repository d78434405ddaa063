"""Exchanges that openpipe-art 0.5.23 captured on the client, as artisan trajectories.

ART 0.5.23 records every HTTP exchange made inside `with art.Trajectory()` (or `art.trajectory(...)`)
as it went over the wire: the request's JSON and the parsed response, per API, in
`trajectory.exchanges` (`chat_completions`, `responses`, `messages`), and leaves
`messages_and_choices` empty. art-server answers all three APIs with the sampled turn's
`token_ids`, `logprobs` and `sampling` record, so each exchange is one trainable turn; what is left
to do is to say which conversation it continued.

Each request becomes the chat messages art-server rendered it as (a chat request's own; for the
others the rules of server/api/translate.py, which a test holds this module to), and each
response the Choice it was sampled as. Which exchange continues which is the rule the server's
sessions use too (protocol/histories.py): an exchange whose conversation continues an earlier
one's (same tools, the earlier messages and turn as its start) extends that history, the earlier
turn staying a Choice, so a two-turn rollout is one sequence with both turns trained; any other
starts a history of its own (ART's `additional_histories`, artisan's History). A Responses
request that names an earlier response of the same trajectory with `previous_response_id`
continues that response's conversation, as the server does (one the trajectory did not capture
leaves the conversation without its start: the turn's prompt then differs from the one sampled,
and training counts it as a prompt mismatch rather than training on it).

What ART's capture could not keep, the server recovers: a streamed Messages turn arrives without
its sampling record (ART keeps only the fields it knows from `message_delta`), and training then
finds the turn in the server's own record of what it sampled (server/chat/sampled_turns.py).

Plain dicts in, plain dicts out; nothing here imports `art` or torch.
"""

from __future__ import annotations

import json
from typing import Any, Iterable

from protocol.histories import RecordedExchange, spliced
from protocol.histories import histories as histories_of

Message = dict[str, Any]


# ---- requests as the chat messages art-server rendered -----------------------------------------

def _text(parts: Any) -> str:
    if isinstance(parts, str):
        return parts
    return "".join(p.get("text", "") for p in parts or [])


def _call(call_id: str, name: str, arguments: str) -> Message:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


class _Builder:
    """Chat messages in order; consecutive pieces of one assistant turn make one message."""

    def __init__(self, previous: Iterable[Message] = ()):
        self.messages: list[Message] = [dict(m) for m in previous]
        self.turn: Message | None = None

    def add(self, message: Message) -> None:
        self.turn = None
        self.messages.append(message)

    def assistant(self) -> Message:
        if self.turn is None:
            self.turn = {"role": "assistant", "content": None}
            self.messages.append(self.turn)
        return self.turn

    def append(self, key: str, text: str) -> None:
        turn = self.assistant()
        turn[key] = (turn.get(key) or "") + text


def responses_history(request: dict[str, Any], previous: Iterable[Message] = ()) -> list[Message]:
    """A Responses request's conversation without its instructions (what a later
    `previous_response_id` continues)."""
    b = _Builder(previous)
    items = request["input"]
    for item in [{"role": "user", "content": items}] if isinstance(items, str) else items:
        kind = item.get("type", "message")
        if kind == "reasoning":
            b.append("reasoning_content", _text(item.get("content") or item.get("summary")))
        elif kind == "function_call":
            b.assistant().setdefault("tool_calls", []).append(_call(item["call_id"], item["name"], item["arguments"]))
        elif kind == "function_call_output":
            b.add({"role": "tool", "tool_call_id": item["call_id"], "content": _text(item["output"])})
        elif item["role"] == "assistant":
            b.append("content", _text(item["content"]))
        else:
            b.add({"role": "system" if item["role"] in ("system", "developer") else "user",
                   "content": _text(item["content"])})
    return b.messages


def responses_conversation(request: dict[str, Any], history: list[Message]) -> list[Message]:
    messages = list(history)
    if request.get("instructions"):
        if messages and messages[0]["role"] == "system":
            messages[0] = {"role": "system", "content": request["instructions"] + "\n\n" + messages[0]["content"]}
        else:
            messages.insert(0, {"role": "system", "content": request["instructions"]})
    return messages


def responses_tools(request: dict[str, Any]) -> list[Message] | None:
    if not request.get("tools"):
        return None
    out = []
    for t in request["tools"]:
        # the server's FunctionSpec, dumped: its fields first, then the extra ones, no nulls
        fn = {"name": t["name"], "description": t.get("description"), "parameters": t.get("parameters"),
              **{k: v for k, v in t.items() if k not in ("type", "strict", "name", "description", "parameters")}}
        out.append({"type": "function", "function": {k: v for k, v in fn.items() if v is not None}})
    return out


def anthropic_conversation(request: dict[str, Any]) -> list[Message]:
    b = _Builder()
    if request.get("system"):
        b.add({"role": "system", "content": _text(request["system"])})
    for m in request["messages"]:
        content = m["content"]
        if isinstance(content, str):
            if m["role"] == "assistant":
                b.append("content", content)
            else:
                b.add({"role": "user", "content": content})
            continue
        if m["role"] == "assistant":
            b.assistant()
            for block in content:
                if block["type"] == "text":
                    b.append("content", block["text"])
                elif block["type"] == "thinking":
                    b.append("reasoning_content", block["thinking"])
                elif block["type"] == "tool_use":
                    b.assistant().setdefault("tool_calls", []).append(
                        _call(block["id"], block["name"], json.dumps(block["input"], ensure_ascii=False)))
            continue
        texts = []
        for block in content:
            if block["type"] == "tool_result":
                b.add({"role": "tool", "tool_call_id": block["tool_use_id"], "content": _text(block.get("content", ""))})
            elif block["type"] == "text":
                texts.append(block["text"])
        if texts or not content:
            b.add({"role": "user", "content": "".join(texts)})
        b.turn = None
    return b.messages


def anthropic_tools(request: dict[str, Any]) -> list[Message] | None:
    if not request.get("tools"):
        return None
    return [{"type": "function", "function": {"name": t["name"], **({"description": t["description"]}
                                                                    if t.get("description") else {}),
                                              "parameters": t["input_schema"]}} for t in request["tools"]]


# ---- responses as the Choice that was sampled ---------------------------------------------------

def _logprobs(raw: Any) -> dict[str, Any] | None:
    """Chat's logprobs shape from a Responses answer (chat's own) or a Messages answer (one
    number per token, what ART reads)."""
    if isinstance(raw, dict):
        return raw
    if isinstance(raw, list):
        return {"content": [{"token": "", "logprob": lp, "top_logprobs": []} for lp in raw]}
    return None


def _choice(message: Message, finish: str, response: dict[str, Any]) -> dict[str, Any]:
    choice: dict[str, Any] = {"index": 0, "finish_reason": finish, "message": message,
                              "logprobs": _logprobs(response.get("logprobs"))}
    for key in ("token_ids", "sampling", "malformed_tool_call"):
        if response.get(key) is not None:
            choice[key] = response[key]
    return choice


def responses_choice(response: dict[str, Any]) -> dict[str, Any]:
    message: Message = {"role": "assistant", "content": None}
    for item in response.get("output") or []:
        if item["type"] == "reasoning":
            message["reasoning_content"] = _text(item.get("content") or item.get("summary"))
        elif item["type"] == "message":
            message["content"] = _text(item["content"])
        elif item["type"] == "function_call":
            message.setdefault("tool_calls", []).append(_call(item["call_id"], item["name"], item["arguments"]))
    finish = ("length" if response.get("status") == "incomplete"
              else "tool_calls" if message.get("tool_calls") else "stop")
    return _choice(message, finish, response)


def anthropic_choice(response: dict[str, Any]) -> dict[str, Any]:
    message: Message = {"role": "assistant", "content": None}
    for block in response.get("content") or []:
        if block["type"] == "thinking":
            message["reasoning_content"] = block["thinking"]
        elif block["type"] == "text":
            message["content"] = (message["content"] or "") + block["text"]
        elif block["type"] == "tool_use":
            message.setdefault("tool_calls", []).append(
                _call(block["id"], block["name"], json.dumps(block["input"], ensure_ascii=False)))
    finish = {"max_tokens": "length", "tool_use": "tool_calls"}.get(response.get("stop_reason") or "", "stop")
    return _choice(message, finish, response)


# ---- exchanges into histories -------------------------------------------------------------------

def recorded_exchanges(exchanges: Any) -> list[RecordedExchange]:
    """Every Chat Completions, Responses and Messages exchange as (conversation, tools, choice), in
    the order they were made. `exchanges` is ART's TrajectoryExchanges dumped to JSON."""
    found = []
    for ex in exchanges.get("chat_completions") or []:
        req = ex["request"]
        for choice in ex["response"]["choices"]:  # n > 1: branches of one prompt
            found.append((ex["start_time"], list(req["messages"]), req.get("tools"), choice))
    by_id: dict[str, list[Message]] = {}  # response id -> its conversation and answer, without instructions
    for ex in sorted(exchanges.get("responses") or [], key=lambda e: e["start_time"]):
        req, resp = ex["request"], ex["response"]
        previous = by_id.get(req.get("previous_response_id") or "", [])
        history = responses_history(req, previous)
        choice = responses_choice(resp)
        if resp.get("id"):
            by_id[resp["id"]] = [*history, choice["message"]]
        found.append((ex["start_time"], responses_conversation(req, history), responses_tools(req), choice))
    for ex in exchanges.get("messages") or []:
        req = ex["request"]
        found.append((ex["start_time"], anthropic_conversation(req), anthropic_tools(req),
                      anthropic_choice(ex["response"])))
    found.sort(key=lambda f: f[0])
    return [RecordedExchange(messages=messages, tools=tools, choice=choice) for _, messages, tools, choice in found]


def histories(exchanges: Any) -> list[dict[str, Any]]:
    """The conversations a trajectory's exchanges held, by the one history rule
    (protocol/histories.py), each as `{"messages_and_choices": [...], "tools": ...}` with its
    sampled turns as Choice dicts, the one the trajectory ended in first."""
    recorded = recorded_exchanges(exchanges)
    choices = [r.choice for r in recorded]
    return [{"messages_and_choices": spliced(recorded, chain, choices), "tools": recorded[chain[-1]].tools}
            for chain in histories_of(recorded)]
