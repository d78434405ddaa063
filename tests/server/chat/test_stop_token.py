"""`--stop-token`: a token's text that ends every generation, for a base model served with a
plain-text template (examples/reasoning_gym's BASE_MODEL_TEMPLATE ends each answer at a newline).
It joins the ids the engines stop on, the sampled text drops it as it drops an EOS, and a text
that is not one token is refused in one line before anything is served."""

from __future__ import annotations

import pytest
import typer.main
from transformers import AutoTokenizer

from server import cli as server_cli
from server.chat.format import ChatFormat, StopTokenError
from tests.families import tokenizer_dir

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory):
    return AutoTokenizer.from_pretrained(tokenizer_dir("qwen2_5", tmp_path_factory.mktemp("stop")))


def test_a_stop_token_joins_the_ids_a_turn_ends_on_and_leaves_the_text(tokenizer):
    newline = tokenizer.encode("\n", add_special_tokens=False)
    assert len(newline) == 1
    plain, stopping = ChatFormat.build(tokenizer), ChatFormat.build(tokenizer, stop_tokens=["\n"])
    assert newline[0] not in plain.stop_ids
    assert stopping.stop_ids == plain.stop_ids | set(newline)
    answer = tokenizer.encode("42", add_special_tokens=False)
    assert stopping.text(answer + newline) == "42"
    assert plain.text(answer + newline) == "42\n"


def test_a_stop_token_of_several_tokens_is_refused_in_one_line(tokenizer):
    with pytest.raises(StopTokenError) as e:
        ChatFormat.build(tokenizer, stop_tokens=["Question: why"])
    message = str(e.value)
    assert len(message.splitlines()) == 1
    assert message.startswith("--stop-token 'Question: why' is ") and "not one" in message


def _settings(*argv: str):
    cmd = typer.main.get_command(server_cli.app)
    return server_cli.settings_of(cmd.make_context("art-server", list(argv)).params)


def test_the_command_line_reads_a_typed_backslash_escape_as_its_character():
    """`--stop-token '\\n'` in a shell is a backslash and an n; the token a user means is the newline."""
    given = ("--stop-token", "\\n", "--stop-token", "\n", "--stop-token", "é»")
    assert _settings(*given).stop_token == ["\n", "\n", "é»"]
    assert _settings().stop_token == []
    with pytest.raises(SystemExit) as e:
        _settings("--stop-token", "end\\")
    assert str(e.value).startswith("--stop-token 'end\\\\': ") and len(str(e.value).splitlines()) == 1
