"""One question about the mailbox: search, read, answer with the ids of the messages it rests on."""

from __future__ import annotations

from typing import Any

from examples.email.answers import exact_match
from examples.email.mailbox import OWNER, Mailbox, SearchError
from rollouts.env import Environment, Message, Score, Task, ToolError

SYSTEM_PROMPT = f"""You are an email assistant for {OWNER[0]} <{OWNER[1]}>. Answer the user's question about their \
inbox (messages from 2024) by searching it with the tools.
1. Call search_inbox with a few keywords from the question (names, shops, items, topics, invoice numbers).
2. Call read_email with the message_id of the result that fits.
3. Call answer with the short answer (an amount, a date, a place, a number or code) and the message ids it comes from.
Keep the answer short and take it from the email, never guess."""

# The schemas are strict (no other keys, ids and dates by pattern, bounded strings): a model
# that decodes tool calls constrained to them (tool_choice "required" on art-server or vLLM) can
# only make calls of this shape; the tools check the same things for any other model.
MESSAGE_ID = {"type": "string", "pattern": "^m[0-9]{4}$", "description": "a message_id from search_inbox"}
DAY = {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"}
TOOLS: list[dict[str, Any]] = [
    {"type": "function", "function": {
        "name": "search_inbox",
        "description": "Full-text search of the inbox. Returns up to max_results messages (best match first) with "
                       "their message_id, sender, date, subject and a snippet.",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["keywords"], "properties": {
            "keywords": {"type": "string", "maxLength": 80,
                         "description": "Words to look for, e.g. 'Parcel Peak desk lamp order'."},
            "sender": {"type": "string", "maxLength": 40,
                       "description": "Only messages whose sender name or address contains this."},
            "sent_after": {**DAY, "description": "Only messages sent on or after this date (YYYY-MM-DD)."},
            "sent_before": {**DAY, "description": "Only messages sent on or before this date (YYYY-MM-DD)."},
            "max_results": {"type": "integer", "minimum": 1, "maximum": 50,
                            "description": "At most this many results (default 5)."},
        }}}},
    {"type": "function", "function": {
        "name": "read_email",
        "description": "The whole message with this id: sender, date, subject and body.",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["message_id"],
                       "properties": {"message_id": MESSAGE_ID}}}},
    {"type": "function", "function": {
        "name": "answer",
        "description": "Give the final answer and the ids of the messages it comes from. Ends the conversation.",
        "parameters": {"type": "object", "additionalProperties": False, "required": ["answer", "sources"],
                       "properties": {
                           "answer": {"type": "string", "maxLength": 80, "description": "The short answer."},
                           "sources": {"type": "array", "items": MESSAGE_ID, "maxItems": 5,
                                       "description": "ids of the messages the answer comes from"},
                       }}}},
]


class EmailEnv(Environment):
    tools = TOOLS

    def __init__(self, task: Task, mailbox: Mailbox):
        self.task, self.mailbox = task, mailbox
        self.kind, self.reference, self.source = task.data["kind"], task.data["answer"], task.data["message_id"]
        self.final: dict[str, Any] | None = None  # what the answer tool was given
        self.searches = self.reads = self.tool_errors = 0
        self.read_ids: set[str] = set()

    def initial_messages(self) -> list[Message]:
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": self.task.data["question"]}]

    def finished(self) -> bool:
        return self.final is not None

    async def call_tool(self, name: str, arguments: dict[str, Any]) -> Any:
        try:
            return self._call(name, arguments)
        except ToolError:
            self.tool_errors += 1
            raise

    def _call(self, name: str, args: dict[str, Any]) -> Any:
        if self.final is not None:
            raise ToolError("the question is already answered")
        allowed = {t["function"]["name"]: set(t["function"]["parameters"]["properties"]) for t in TOOLS}
        if name not in allowed:
            raise ToolError(f"unknown tool {name!r}; the tools are {', '.join(allowed)}")
        unknown = set(args) - allowed[name]
        if unknown:
            raise ToolError(f"{name} takes no argument {', '.join(sorted(unknown))}; it takes {', '.join(sorted(allowed[name]))}")
        try:
            if name == "search_inbox":
                self.searches += 1
                results = self.mailbox.search(args.get("keywords"), args.get("sender"), args.get("sent_after"),
                                              args.get("sent_before"), args.get("max_results", 5))
                return results or "No messages match. Try other or fewer keywords."
            if name == "read_email":
                if "message_id" not in args:
                    raise ToolError("read_email needs message_id")
                message = self.mailbox.read(args["message_id"])
                self.reads += 1
                self.read_ids.add(message["message_id"])
                return message
        except SearchError as exc:
            raise ToolError(str(exc)) from None
        answer, sources = args.get("answer"), args.get("sources", [])
        if not isinstance(answer, str) or not answer.strip():
            raise ToolError("answer needs the answer as text")
        if isinstance(sources, str):
            sources = [sources]
        if not isinstance(sources, list) or not all(isinstance(s, str) for s in sources):
            raise ToolError("sources must be a list of message ids, e.g. ['m0042']")
        self.final = {"answer": answer, "sources": [s.strip() for s in sources]}
        return "Answer recorded."

    async def score(self, messages: list[Message]) -> Score:
        """Exact match of the answer's fact (normalised); a plain-text final reply counts as the
        answer, without sources. Citing and reading the source message are metrics, not reward."""
        last = messages[-1] if messages else {}
        text = self.final["answer"] if self.final else (last.get("content") if last.get("role") == "assistant" else None)
        sources = self.final["sources"] if self.final else []
        exact = exact_match(self.kind, text, self.reference)
        return Score(
            reward=1.0 if exact else 0.0,
            metrics={"exact_match": exact, "answered_with_tool": self.final is not None,
                     "cited_source": self.source in sources, "read_source": self.source in self.read_ids,
                     "sources_cited": len(sources), "searches": self.searches, "reads": self.reads,
                     "tool_errors": self.tool_errors},
            logs=[f"answer {text!r} vs reference {self.reference!r} ({self.kind}, message {self.source}): "
                  f"{'match' if exact else 'no match'}; cited {sources}"])
