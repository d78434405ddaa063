"""Assembly of long multi-turn histories, in-process on the embedded model's tokenizer and template:
each turn still trains on exactly the prompt it was sampled after, a history of n turns costs one
render (not n, which made 1,600 turns take minutes), and a job stopped mid-assembly stops at the
next turn."""

from __future__ import annotations

import random

import pytest
from transformers import AutoTokenizer

from conftest import ROOT
from protocol.trajectory import History
from server.chat.format import ChatFormat
from server.chat.sampled_turns import PrefixFingerprints, fingerprint
from server.training.assemble import Cancelled, assemble_history
from tests.helpers import sampled_choice

pytestmark = pytest.mark.unit

MODEL_DIR = ROOT / "server" / "embedded" / "model"


@pytest.fixture(scope="module")
def chat() -> ChatFormat:
    tok = AutoTokenizer.from_pretrained(MODEL_DIR)
    return ChatFormat.build(tok, eos_ids=[tok.eos_token_id])


def _conversation(chat: ChatFormat, turns: int, seed: int = 0) -> tuple[list, list[list[int]]]:
    """A system prompt, then `turns` times a user message and an assistant reply (as sampled ids)."""
    rng = random.Random(seed)
    stop = min(chat.stop_ids)
    messages: list = [{"role": "system", "content": "Answer in one word."}]
    replies = []
    for i in range(turns):
        messages.append({"role": "user", "content": f"word {i}: {rng.choice(['sun', 'rain', 'snow'])}?"})
        text = rng.choice(["yes", "no", "maybe so"])
        replies.append(chat.renderer.encode(text) + [stop])
        messages.append({"role": "assistant", "content": text, "token_ids": replies[-1]})
    return messages, replies


def _history(chat: ChatFormat, messages: list, replies: list[list[int]], fingerprints: list[str]) -> History:
    items, k = [], 0
    for m in messages:
        if m["role"] != "assistant":
            items.append(m)
            continue
        items.append(sampled_choice(m["content"], replies[k], prompt_fingerprint=fingerprints[k]))
        k += 1
    return History(messages_and_choices=items)


def test_prefix_fingerprints_are_the_fingerprints_of_prefixes():
    ids = [random.Random(1).randrange(50_000) for _ in range(300)]
    prefixes = PrefixFingerprints(ids)
    for n in (0, 1, 2, 2, 150, 299, 300, 7):  # growing, repeated, and one behind
        assert prefixes.of(n) == fingerprint(ids[:n])


def test_each_turn_trains_on_the_prompt_it_was_sampled_after(chat):
    """Fingerprints as the sampler records them, one render per turn; one turn's is wrong: that
    turn is context only, and every other is trained exactly where its prompt ends."""
    messages, replies = _conversation(chat, 30)
    at = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    prompts = [chat.turns.prompt(messages[:i], None).ids for i in at]
    fingerprints = [fingerprint(p) for p in prompts]
    fingerprints[17] = "0" * 24
    (seq,), stats = assemble_history(_history(chat, messages, replies, fingerprints), chat)
    assert (stats.choices, stats.trained_choices, stats.prompt_mismatches) == (30, 29, 1)
    assert stats.non_extending_turns == 0 and stats.sequences == 1
    trained = [i for i, m in enumerate(seq.mask) if m]
    expected = []
    for k, (prompt, reply) in enumerate(zip(prompts, replies)):
        assert seq.ids[: len(prompt)] == prompt
        assert seq.ids[len(prompt): len(prompt) + len(reply)] == reply
        if k != 17:
            expected += range(len(prompt), len(prompt) + len(reply))
    assert trained == expected
    assert seq.ids == prompts[-1] + replies[-1]


def _counting_renders(chat: ChatFormat, monkeypatch) -> list[int]:
    calls = []
    render = chat.template.render

    def counted(*args, **kwargs):
        calls.append(1)
        return render(*args, **kwargs)

    monkeypatch.setattr(chat.template, "render", counted)
    return calls


def _honest(chat: ChatFormat, turns: int) -> History:
    """A long history whose fingerprints are the sampler's, built from one render of the whole."""
    messages, replies = _conversation(chat, turns, seed=2)
    whole = chat.turns.prompt(messages, None)
    prefixes = PrefixFingerprints(whole.ids)
    at = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    return _history(chat, messages, replies, [prefixes.of(whole.offsets[i]) for i in at])


def test_a_history_of_2000_turns_is_rendered_once_not_per_turn(chat, monkeypatch):
    history = _honest(chat, 2000)
    renders = _counting_renders(chat, monkeypatch)
    (seq,), stats = assemble_history(history, chat)
    assert stats.trained_choices == 2000 and stats.prompt_mismatches == 0
    assert len(renders) <= 2  # the whole history, and its probe for where sampled turns go


def test_assembly_stops_at_the_next_turn_when_the_job_is_stopped(chat):
    history = _honest(chat, 200)
    asked = []

    def stop() -> bool:
        asked.append(1)
        return len(asked) > 50

    with pytest.raises(Cancelled):
        assemble_history(history, chat, should_stop=stop)
    assert len(asked) == 51


def test_context_after_the_last_trained_turn_is_not_kept(chat):
    """Turns whose prompts do not match are context only: after the last trained turn they would
    only make the forward pass longer."""
    messages, replies = _conversation(chat, 40)
    at = [i for i, m in enumerate(messages) if m["role"] == "assistant"]
    first = fingerprint(chat.turns.prompt(messages[: at[0]], None).ids)
    (seq,), stats = assemble_history(_history(chat, messages, replies, [first] + ["0" * 24] * 39), chat)
    assert (stats.trained_choices, stats.prompt_mismatches) == (1, 39)
    assert seq.ids == chat.turns.prompt(messages[: at[0]], None).ids + replies[0]
    assert seq.mask[-1] and len(seq.old_logprobs) == len(seq.temperatures) == len(seq.ids)
