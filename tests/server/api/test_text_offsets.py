"""Where each token starts in a legacy completion's text (`text_offset`), on the embedded model's
byte-level tokenizer: characters split across byte tokens, and a text offset in pieces (a stream's
chunks, an echoed prompt before the sampled text) that agrees with the whole."""

from __future__ import annotations

import pytest
from transformers import AutoTokenizer

from conftest import ROOT
from server.api.text_completions_routes import TextOffsets

pytestmark = pytest.mark.unit
TEXT = "Café ☕, naïve 日本 and plain words after them"


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(ROOT / "server" / "embedded" / "model")


def test_whole_tokens_start_where_their_text_does(tok):
    ids = tok.encode(TEXT)
    offsets = TextOffsets(tok, []).of(ids)
    assert offsets == sorted(offsets) and offsets[0] == 0 and offsets[-1] < len(TEXT)
    pieces = [tok.decode([t]) for t in ids]
    assert any("\ufffd" in p for p in pieces)  # the text does split characters across tokens
    assert all(TEXT[o:o + len(p)] == p for o, p in zip(offsets, pieces) if "\ufffd" not in p)


@pytest.mark.parametrize("cut", range(1, 16))
def test_offsets_in_pieces_agree_with_the_whole(tok, cut):
    ids = tok.encode(TEXT)
    whole = TextOffsets(tok, []).of(ids)[cut:]
    assert TextOffsets(tok, ids[:cut]).of(ids[cut:]) == whole  # the text before decoded at once
    streamed = TextOffsets(tok, ids[:cut])
    assert streamed.of(ids[cut:cut + 3]) + streamed.of(ids[cut + 3:]) == whole  # then chunk by chunk
