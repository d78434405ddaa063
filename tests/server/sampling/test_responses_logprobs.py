"""OpenAI Responses' `include: ["message.output_text.logprobs"]`: the message's text carries the
logprobs of the tokens that wrote it, with `top_logprobs` alternatives, in the response, in its
stream's text deltas and in the text's done event, read through the real `openai` SDK on the
embedded model. Where a sample also holds reasoning or a tool call, only the text's tokens count
(the unit tests of `content_logprobs`). An `include` value OpenAI does not define is a 400 naming it."""

from __future__ import annotations

import openai
import pytest

from server.sampling.choices import content_logprobs

MODEL = "artisan-tiny"
TEXT_LOGPROBS = ["message.output_text.logprobs"]


# ---- which tokens wrote the text ----------------------------------------------------------------

PIECES = {1: "<think>", 2: "hm, Hello", 3: "</think>", 4: "\n\nHel", 5: "lo", 6: "<tool_call>", 7: "{}", 8: "<eos>"}


def _text_of(ids):
    return "".join(PIECES[i] for i in ids if i != 8)  # the stop token writes nothing, as ChatFormat.text drops it


def _answer(ids, content, reasoning=None):
    entries = [{"token": PIECES[i], "logprob": -i / 10, "bytes": list(PIECES[i].encode()), "top_logprobs": []}
               for i in ids]
    return {"token_ids": ids, "logprobs": {"content": entries},
            "message": {"role": "assistant", "content": content, "reasoning_content": reasoning}}


@pytest.mark.unit
def test_only_the_tokens_that_wrote_the_text_count_not_reasoning_that_quotes_it_nor_a_call_after_it():
    choice = _answer([1, 2, 3, 4, 5, 6, 7, 8], "Hello", reasoning="hm, Hello")
    assert [e["token"] for e in content_logprobs(_text_of, choice)] == ["\n\nHel", "lo"]


@pytest.mark.unit
def test_a_sample_that_is_all_text_gives_every_token_but_the_stop_and_an_empty_text_none():
    assert [e["token"] for e in content_logprobs(_text_of, _answer([4, 5, 8], "Hello"))] == ["\n\nHel", "lo"]
    assert content_logprobs(_text_of, _answer([6, 7, 8], None)) == []


@pytest.mark.unit
def test_a_text_the_parser_rewrote_gives_every_token():
    assert len(content_logprobs(_text_of, _answer([4, 5, 8], "Goodbye"))) == 3


# ---- through the SDK ----------------------------------------------------------------------------

@pytest.fixture(scope="module")
def oai(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120) as client:
        yield client


def _ask(oai, **kw):
    return oai.responses.create(model=MODEL, input="Say something.", max_output_tokens=12, top_logprobs=2,
                                extra_body={"seed": 7}, **kw)


def test_included_text_logprobs_are_the_texts_tokens_with_their_alternatives(oai):
    r = _ask(oai, include=TEXT_LOGPROBS)
    [text] = r.output[0].content
    assert text.logprobs, r.output
    assert b"".join(bytes(e.bytes) for e in text.logprobs).decode() == text.text
    assert all(len(e.top_logprobs) == 2 and e.top_logprobs[0].logprob >= e.logprob for e in text.logprobs)
    # the same tokens' entries as the logprobs art-server gives every response beside OpenAI's fields
    every = r.model_extra["logprobs"]["content"]
    assert [e.logprob for e in text.logprobs] == [e["logprob"] for e in every[: len(text.logprobs)]]
    assert _ask(oai).output[0].content[0].logprobs is None  # not asked for: not given


def test_a_stream_gives_them_with_its_deltas_and_whole_with_the_texts_end(oai):
    whole = _ask(oai, include=TEXT_LOGPROBS).output[0].content[0].logprobs
    events = list(_ask(oai, include=TEXT_LOGPROBS, stream=True))
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert sum(len(e.logprobs) for e in deltas) >= len(deltas) > 0
    [done] = [e for e in events if e.type == "response.output_text.done"]
    final = events[-1].response.output[0].content[0]
    def dumped(entries):  # the SDK types a done event's entries and a text part's differently
        return [e.model_dump() for e in entries]

    assert dumped(done.logprobs) == dumped(final.logprobs) == dumped(whole)


def test_an_include_openai_does_not_define_is_a_400_naming_it(oai):
    with pytest.raises(openai.BadRequestError) as e:
        _ask(oai, include=["message.output_text.logprob"])
    assert "include" in str(e.value)
    assert _ask(oai, include=["reasoning.encrypted_content"]).status in ("completed", "incomplete")  # as Codex sends
