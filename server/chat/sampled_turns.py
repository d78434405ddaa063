"""Which sampling an assistant message is: the one place a turn's identity is decided.

Every assistant turn this server samples is remembered by what a client echoes back (content,
reasoning, tool calls) with its exact ids and its sampling record. When a later request, or a
training job, carries that turn as a plain message, its ids come back from here: the next prompt
then contains exactly what the model produced (server/chat/render.py splices them in), and a
Choice that lost its ids on the way (a streamed or litellm-rebuilt choice) trains token-exactly.

Several rollouts of a group often write the same text ("The price is 12.") after different
prompts. The sampling a message is, is the one whose recorded prompt fingerprint is the prompt
this very conversation renders to before it.
"""

from __future__ import annotations

import hashlib
import json
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable, Sequence

from protocol.histories import turn_identity

if TYPE_CHECKING:
    from server.chat.render import RenderedPrompt, Renderer


def fingerprint(ids: Sequence[int]) -> str:
    """A prompt's identity, recorded with every choice and checked when training rebuilds it."""
    return hashlib.sha256(json.dumps(list(ids)).encode()).hexdigest()[:24]


class PrefixFingerprints:
    """`fingerprint(ids[:n])` for growing n at the cost of the tokens added since the last one:
    the hash is fed the same text json.dumps writes, so a long conversation's turns are checked in
    linear time, not each from its first token."""

    def __init__(self, ids: Sequence[int]):
        self.ids, self._fed, self._hash = ids, 0, hashlib.sha256(b"[")

    def of(self, n: int) -> str:
        if n < self._fed:
            return fingerprint(self.ids[:n])
        if n > self._fed:
            head = "" if self._fed == 0 else ", "
            self._hash.update((head + ", ".join(map(str, self.ids[self._fed:n]))).encode())
            self._fed = n
        done = self._hash.copy()
        done.update(b"]")
        return done.hexdigest()[:24]


@dataclass(frozen=True)
class SampledTurn:
    """An assistant turn exactly as sampled: the ids after the generation prompt."""

    token_ids: tuple[int, ...]
    record: dict[str, Any] | None = None  # the choice's logprobs and sampling record, when cached

    @property
    def prompt_fingerprint(self) -> str | None:
        return self.record["sampling"]["prompt_fingerprint"] if self.record else None

    @property
    def template_kwargs(self) -> dict[str, Any] | None:
        return self.record["sampling"].get("chat_template_kwargs") if self.record else None


def turn_key(message: dict[str, Any]) -> str:
    """Identity of an assistant turn by what a client echoes back: protocol/histories.py's, the one
    the client side chains histories by, hashed for the cache."""
    return hashlib.sha256(turn_identity({**message, "role": "assistant"}).encode()).hexdigest()


class TurnCache:
    """A turn's text keeps its few newest samplings, bounded overall (oldest texts go first)."""

    def __init__(self, capacity: int = 50_000, per_turn: int = 8):
        self.capacity, self.per_turn = capacity, per_turn
        self._items: OrderedDict[str, list[SampledTurn]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, message: dict[str, Any], turn: SampledTurn) -> None:
        key = turn_key(message)
        with self._lock:
            self._items[key] = [turn, *self._items.get(key, [])][: self.per_turn]
            self._items.move_to_end(key)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def samplings(self, message: dict[str, Any]) -> list[SampledTurn]:
        """The samplings this turn may be, newest first: the ids a client or a training job
        carries in the message itself, else what this server remembers."""
        ids = message.get("token_ids")
        if isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids):
            return [SampledTurn(tuple(ids))]
        with self._lock:
            return list(self._items.get(turn_key(message), []))


def identify(candidates: list[SampledTurn], prompt_ids: Callable[[SampledTurn], list[int]]) -> SampledTurn | None:
    """The candidate sampled after the prompt `prompt_ids` gives for it; the newest when none was
    (training's fingerprint check then refuses to train it). The prompt is rendered only when
    there is a choice to make."""
    if len(candidates) <= 1:
        return candidates[0] if candidates else None
    return next((c for c in candidates if c.prompt_fingerprint is not None
                 and c.prompt_fingerprint == fingerprint(prompt_ids(c))), candidates[0])


class SampledTurns:
    """The turn cache of one chat format, and the prompts it resolves earlier turns in."""

    def __init__(self, renderer: "Renderer", cache: TurnCache | None = None):
        self.renderer = renderer
        self.cache = cache or TurnCache()

    def remember(self, message: dict[str, Any], turn: SampledTurn) -> None:
        self.cache.put(message, turn)

    def resolve(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None,
                kwargs: dict[str, Any] | None = None) -> dict[int, SampledTurn]:
        """Which sampling each assistant message is, by its index, earliest first: a later turn's
        prompt splices the turns resolved before it."""
        turns: dict[int, SampledTurn] = {}
        for i, m in enumerate(messages):
            if m.get("role") != "assistant":
                continue
            prefix: list[list[int]] = []

            def prompt_ids(_: SampledTurn, i: int = i) -> list[int]:
                if not prefix:  # the same for every candidate: rendered once
                    prefix.append(self._render(messages[:i], tools, kwargs, turns).ids)
                return prefix[0]

            turn = identify(self.cache.samplings(m), prompt_ids)
            if turn is not None:
                turns[i] = turn
        return turns

    def prompt(self, messages: Sequence[dict[str, Any]], tools: Sequence[dict[str, Any]] | None,
               kwargs: dict[str, Any] | None = None) -> "RenderedPrompt":
        """The prompt a model samples from after `messages`, every earlier turn this server sampled
        spliced in as its exact ids."""
        return self._render(messages, tools, kwargs, self.resolve(messages, tools, kwargs))

    def recover(self, messages: Sequence[dict[str, Any]], index: int, tools: Sequence[dict[str, Any]] | None
                ) -> tuple[SampledTurn, "RenderedPrompt"] | None:
        """The sampling of `messages[index]`, an assistant turn that reached training without its
        ids, and the prompt rebuilt for it (with the template arguments it was sampled with)."""
        message = {k: v for k, v in messages[index].items() if k != "token_ids"}
        candidates = [c for c in self.cache.samplings(message) if c.record is not None]
        prompts: dict[str, RenderedPrompt] = {}

        def prompt_of(c: SampledTurn) -> RenderedPrompt:
            key = json.dumps(c.template_kwargs, sort_keys=True)
            if key not in prompts:
                prompts[key] = self.prompt(messages[:index], tools, c.template_kwargs)
            return prompts[key]

        turn = identify(candidates, lambda c: prompt_of(c).ids)
        return (turn, prompt_of(turn)) if turn is not None else None

    def _render(self, messages, tools, kwargs, turns: dict[int, SampledTurn]) -> "RenderedPrompt":
        return self.renderer.render(messages, tools, True, kwargs=kwargs,
                                    sampled_ids={i: t.token_ids for i, t in turns.items() if i < len(messages)})
