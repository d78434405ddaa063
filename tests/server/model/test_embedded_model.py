"""The embedded model: built offline, tokenized as it is served, small enough to ship."""

from pathlib import Path

import pytest
from transformers import AutoTokenizer

from server.embedded.template import CHAT_TEMPLATE
from examples.demo.pretrain import build_tokenizer, corpus
from server.settings import DEFAULT_MODEL_DIR

pytestmark = pytest.mark.unit


def test_tokenizer_trains_offline_and_reloads_identically(tmp_path):
    built = build_tokenizer(vocab_size=512, seed=3)
    built.save_pretrained(tmp_path)
    loaded = AutoTokenizer.from_pretrained(tmp_path)
    for text in corpus(30, seed=11):
        assert loaded.encode(text, add_special_tokens=False) == built.encode(text, add_special_tokens=False)
    # numbers are split into digits, as Qwen2 does, so copying a number is copying digits
    digits = [loaded.decode([i]) for i in loaded.encode("is 518", add_special_tokens=False)]
    assert digits[-3:] == ["5", "1", "8"]


def test_shipped_model_is_small_and_carries_its_template():
    files = list(Path(DEFAULT_MODEL_DIR).iterdir())
    assert sum(f.stat().st_size for f in files) <= 50 * 1024 * 1024
    tok = AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR)
    assert tok.chat_template == CHAT_TEMPLATE
    assert tok.convert_tokens_to_ids("<|im_end|>") == tok.eos_token_id
