"""A demonstration's SFT targets: every assistant turn, but for those of weight 0 (OpenAI's
fine-tuning format), which stay in the sequence as context."""

from __future__ import annotations

import pytest
from pydantic import ValidationError
from transformers import AutoTokenizer

from conftest import ROOT
from protocol.trajectory import Conversation
from server.chat.format import ChatFormat
from server.training.assemble import assemble_sft

TOKENIZER = AutoTokenizer.from_pretrained(ROOT / "server" / "embedded" / "model")
FORMAT = ChatFormat.build(TOKENIZER)
MISTAKE, MENDED = "Sunday, I think.", "Monday: Sunday is a holiday."


def _conversation(weight: int | None) -> Conversation:
    mistake = {"role": "assistant", "content": MISTAKE} | ({} if weight is None else {"weight": weight})
    return Conversation(messages=[{"role": "user", "content": "When does the shop open?"}, mistake,
                                  {"role": "user", "content": "It is closed on Sundays."},
                                  {"role": "assistant", "content": MENDED}])


def _trained_text(conversation: Conversation) -> str:
    return "".join(TOKENIZER.decode([t for t, m in zip(s.ids, s.mask) if m])
                   for s in assemble_sft(conversation, FORMAT))


@pytest.mark.unit
def test_a_turn_of_weight_0_is_context_and_the_others_are_trained():
    both, mended = _trained_text(_conversation(None)), _trained_text(_conversation(0))
    assert MISTAKE in both and MENDED in both
    assert MISTAKE not in mended and MENDED in mended
    assert _trained_text(_conversation(1)) == both
    # the mistake is still in the mended turn's context: one sequence, the same tokens
    (weighted,), (plain,) = assemble_sft(_conversation(0), FORMAT), assemble_sft(_conversation(None), FORMAT)
    assert weighted.ids == plain.ids and sum(weighted.mask) < sum(plain.mask)


@pytest.mark.unit
@pytest.mark.parametrize("messages, words", [
    ([{"role": "user", "content": "hi", "weight": 0}, {"role": "assistant", "content": "hello"}], "only on an assistant"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello", "weight": 0.5}], "weight is 0 or 1"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello", "weight": True}], "weight is 0 or 1"),
    ([{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello", "weight": 0}], "of weight 1"),
])
def test_a_weight_is_0_or_1_on_an_assistant_turn_and_one_turn_is_trained(messages, words):
    with pytest.raises(ValidationError, match=words):
        Conversation(messages=messages)
