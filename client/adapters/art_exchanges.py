"""Exchanges that openpipe-art 0.5.23 captured on the client, as artisan trajectories.

ART 0.5.23 records every HTTP exchange made inside `with art.Trajectory()` (or `art.trajectory(...)`)
as it went over the wire: the request's JSON and the parsed response, per API, in
`trajectory.exchanges` (`chat_completions`, `responses`, `messages`), and leaves
`messages_and_choices` empty. art-server answers all three APIs with the sampled turn's
`token_ids`, `logprobs` and `sampling` record, so each exchange is one trainable turn; what is left
to do is to say which conversation it continued.

Each request becomes the chat messages art-server rendered it as (a chat request's own; for the
others by the rules the server translates by, protocol/translation.py), and each response the
Choice it was sampled as. Which exchange continues which is the rule the server's
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

from typing import Any, Iterable

from protocol import translation
from protocol.histories import RecordedExchange, spliced
from protocol.histories import histories as histories_of

Message = dict[str, Any]


# ---- requests as the chat messages art-server rendered -----------------------------------------

def responses_prompt(request: dict[str, Any], previous: Iterable[Message] = ()
                     ) -> tuple[list[Message], list[Message], list[Message] | None]:
    """A Responses request as (its conversation without the instructions, what a later
    `previous_response_id` continues; the conversation it was sampled after; its tools)."""
    history = translation.responses_history(request["input"], list(previous))
    conversation = translation.responses_conversation(request.get("instructions"), history)
    return history.messages, conversation.messages, translation.responses_tools(request.get("tools"))


def messages_prompt(request: dict[str, Any]) -> tuple[list[Message], list[Message] | None]:
    """A Messages request as (the conversation it was sampled after, its tools)."""
    conversation = translation.anthropic_conversation(request.get("system"), request["messages"])
    return conversation.messages, translation.anthropic_tools(request.get("tools"))


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
            message["reasoning_content"] = translation.reasoning_text(item)
        elif item["type"] == "message":
            message["content"] = translation.text_of(item["content"])
        elif item["type"] == "function_call":
            message.setdefault("tool_calls", []).append(translation.responses_call(item))
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
            message.setdefault("tool_calls", []).append(translation.anthropic_call(block))
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
        history, conversation, tools = responses_prompt(req, previous)
        choice = responses_choice(resp)
        if resp.get("id"):
            by_id[resp["id"]] = [*history, choice["message"]]
        found.append((ex["start_time"], conversation, tools, choice))
    for ex in exchanges.get("messages") or []:
        conversation, tools = messages_prompt(ex["request"])
        found.append((ex["start_time"], conversation, tools, anthropic_choice(ex["response"])))
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
