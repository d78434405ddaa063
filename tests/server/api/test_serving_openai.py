"""The OpenAI-compatible serving path end to end: a real art-server on loopback, real clients
(the `openai` SDK sync/async/streaming, litellm, raw httpx), checked against an in-process
transformers copy of the same model; last, the legacy text completions route (`/v1/completions`)."""

from __future__ import annotations

import asyncio
import json

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from conftest import ROOT, ServerProcess

MODEL_DIR = ROOT / "server" / "embedded" / "model"
MODEL = "artisan-tiny"
TOOL_MODEL = "artisan-toolcaller"
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "Current weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


def user(text: str) -> list[dict]:
    return [{"role": "system", "content": "You are terse."}, {"role": "user", "content": text}]


def find_run(haystack: list[int], needle: list[int]) -> int:
    for i in range(len(haystack) - len(needle) + 1):
        if haystack[i:i + len(needle)] == needle:
            return i
    return -1


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(MODEL_DIR)


@pytest.fixture(scope="module")
def ids(tok):
    """Token ids the assertions need, looked up rather than hard-coded."""
    enc = lambda s: tok.encode(s, add_special_tokens=False)  # noqa: E731
    return {"gen": enc("<|im_start|>assistant\n"), "nl": enc("\n"), "im_end": tok.convert_tokens_to_ids("<|im_end|>"),
            "eos": {tok.convert_tokens_to_ids(t) for t in ("<|im_end|>", "<|endoftext|>")},
            "tags": {tok.convert_tokens_to_ids(t) for t in ("<tool_call>", "</tool_call>")}}


@pytest.fixture(scope="module")
def ref_model():
    return AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def client(server):
    with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=60) as c:
        yield c


def async_client(server) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=120)


def extra(obj, name: str):
    """A field beyond OpenAI's schema (token_ids, sampling, prompt_token_ids)."""
    value = (obj.model_extra or {}).get(name)
    assert value is not None, f"{type(obj).__name__} has no {name!r}"
    return value


def reference_logprobs(model, prompt_ids: list[int], completion_ids: list[int], temperature: float) -> torch.Tensor:
    """log softmax(logits / T) at every completion position, from one full forward pass: [len, vocab]."""
    with torch.no_grad():
        logits = model(torch.tensor([prompt_ids + completion_ids])).logits[0].float()
    return torch.log_softmax(logits[len(prompt_ids) - 1:-1] / temperature, dim=-1)


# ---- 1. token ids and prompt ids ------------------------------------------------------------------

def test_token_ids_decode_to_content_and_prompt_ids_are_the_template(client, tok, ids):
    messages = user("Tell me something about the sea.")
    seen_plain = 0
    for seed in (11, 12):
        resp = client.chat.completions.create(model=MODEL, messages=messages, n=3, max_tokens=24, seed=seed)
        prompt_ids = extra(resp, "prompt_token_ids")
        template = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        assert prompt_ids == tok.encode(template, add_special_tokens=False)
        assert resp.usage.prompt_tokens == len(prompt_ids)
        assert resp.usage.completion_tokens == sum(len(extra(c, "token_ids")) for c in resp.choices)
        assert [c.index for c in resp.choices] == [0, 1, 2]
        for choice in resp.choices:
            token_ids = extra(choice, "token_ids")
            assert 1 <= len(token_ids) <= 24
            assert len(choice.logprobs.content) == len(token_ids)
            if choice.finish_reason == "length":
                assert len(token_ids) == 24
            else:
                assert choice.finish_reason == "stop" and token_ids[-1] in ids["eos"]
            # without tools nothing is parsed: the content is the sampled text, control tokens
            # dropped and tool-call tags kept (the embedded agent often writes a call unasked)
            shown = [t for t in token_ids if t not in tok.all_special_ids or t in ids["tags"]]
            assert choice.message.content == tok.decode(shown, skip_special_tokens=False)
            seen_plain += 1
            sampling = extra(choice, "sampling")
            assert sampling["temperature"] == 1.0 and sampling["logprob_temperature"] == 1.0
            assert sampling["policy"] == MODEL and sampling["step"] == 0
            assert sampling["prompt_len"] == len(prompt_ids)
    assert seen_plain >= 4


def test_stop_string_cuts_the_content_in_both_modes(client):
    kw = dict(model=MODEL, messages=user("Go."), max_tokens=30, seed=77, extra_body={"ignore_eos": True})
    full = client.chat.completions.create(**kw).choices[0]
    text = full.message.content
    # A 3-character stop from the middle of the text, first seen there.
    at = next(k for k in range(5, len(text) - 3)
              if not any(c.isspace() or c == "\ufffd" for c in text[k:k + 3]) and text.index(text[k:k + 3]) == k)
    stop, cut = text[at:at + 3], text[:at]
    resp = client.chat.completions.create(**kw, stop=[stop, "never-appears"]).choices[0]
    assert resp.message.content == cut and resp.finish_reason == "stop"
    sampled = extra(resp, "token_ids")
    assert sampled == extra(full, "token_ids")[: len(sampled)]  # sampling stopped at the stop's token
    streamed = "".join(ch.choices[0].delta.content or ""
                       for ch in client.chat.completions.create(**kw, stop=stop, stream=True) if ch.choices)
    assert streamed == cut


def test_greedy_is_argmax_and_reports_temperature_1_logprobs(client, ref_model):
    kw = dict(model=MODEL, messages=user("Be greedy."), max_tokens=12, temperature=0, n=2,
              extra_body={"ignore_eos": True})
    resp = client.chat.completions.create(**kw)
    prompt_ids = extra(resp, "prompt_token_ids")
    a, b = (extra(c, "token_ids") for c in resp.choices)
    assert a == b
    assert extra(resp.choices[0], "sampling")["logprob_temperature"] == 1.0
    ref = reference_logprobs(ref_model, prompt_ids, a, 1.0)
    assert ref.argmax(-1).tolist() == a
    got = torch.tensor([e.logprob for e in resp.choices[0].logprobs.content])
    assert (got - ref.max(-1).values).abs().max().item() <= 1e-4


def test_finish_reason_length_when_max_tokens_runs_out(client):
    for key in ("max_tokens", "max_completion_tokens"):
        resp = client.chat.completions.create(model=MODEL, messages=user("Count."), n=2, seed=3,
                                              extra_body={"ignore_eos": True}, **{key: 5})
        for choice in resp.choices:
            assert choice.finish_reason == "length" and len(extra(choice, "token_ids")) == 5


# ---- 2. logprobs are the sampler's, at the sampling temperature ---------------------------------

async def test_logprobs_equal_a_full_forward_pass_under_batching(server, ref_model):
    """Concurrent requests of different prompt lengths, temperatures, n and max_tokens share decode
    steps (rows join and leave the batch); each reported logprob must still be log softmax(logits/T)
    of the model over exactly prompt + completion."""
    long_text = " ".join(f"item {i} is {'blue' if i % 2 else 'green'}" for i in range(60))
    cases = [
        dict(messages=user("hi"), temperature=1.0, max_tokens=8),
        dict(messages=user("What is the capital of France, and why?"), temperature=0.7, max_tokens=16),
        dict(messages=user(long_text), temperature=1.0, max_tokens=24),
        dict(messages=user(long_text[:300]), temperature=0.7, max_tokens=12),
        dict(messages=user("Name three colours."), temperature=0.7, max_tokens=20, top_p=0.5),
        dict(messages=user("Spell it."), temperature=1.0, max_tokens=10, top_p=0.3, logprobs=True, top_logprobs=4),
    ]

    async with async_client(server) as c:
        responses = await asyncio.gather(*[c.chat.completions.create(model=MODEL, n=3, **kw) for kw in cases])
    checked = 0
    for kw, resp in zip(cases, responses):
        t = kw["temperature"]
        prompt_ids = extra(resp, "prompt_token_ids")
        assert len(resp.choices) == 3
        for choice in resp.choices:
            completion = extra(choice, "token_ids")
            assert extra(choice, "sampling")["logprob_temperature"] == t
            assert extra(choice, "sampling")["top_p"] == kw.get("top_p", 1.0)
            ref = reference_logprobs(ref_model, prompt_ids, completion, t)
            want = ref.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)
            got = torch.tensor([e.logprob for e in choice.logprobs.content])
            assert (got - want).abs().max().item() <= 1e-4, (kw, choice.index)
            checked += len(completion)
            if kw.get("top_p", 1.0) < 1:
                # The logprob is before truncation (checked above); the token itself came from the nucleus.
                probs = ref.exp()
                for pos, token in enumerate(completion):
                    mass_before = probs[pos][probs[pos] > probs[pos, token]].sum().item()
                    assert mass_before < kw["top_p"] + 1e-4
            if kw.get("top_logprobs"):
                for pos, entry in enumerate(choice.logprobs.content):
                    top = [e.logprob for e in entry.top_logprobs]
                    assert len(top) == kw["top_logprobs"]
                    ref_top = ref[pos].topk(kw["top_logprobs"]).values
                    assert (torch.tensor(top) - ref_top).abs().max().item() <= 1e-4
    assert checked > 100


# ---- 3. multi-turn: sampled turns come back as their exact ids ------------------------------------

def test_sampled_text_turn_is_spliced_back_by_its_exact_ids(client, tok, ids):
    messages = user("Start a story.")
    first = client.chat.completions.create(model=MODEL, messages=messages, n=6, max_tokens=24, seed=21,
                                           temperature=1.5)
    retokenized_differs = False
    for choice in first.choices:  # each of the n choices is remembered on its own
        sampled = extra(choice, "token_ids")
        convo = messages + [choice.message.model_dump(), {"role": "user", "content": "Go on."}]
        second = client.chat.completions.create(model=MODEL, messages=convo, max_tokens=2)
        prompt = extra(second, "prompt_token_ids")
        at = find_run(prompt, ids["gen"] + sampled)
        assert at >= 0, "the sampled ids are not in the next prompt"
        after = prompt[at + len(ids["gen"]) + len(sampled):]
        closing = ([] if sampled[-1] == ids["im_end"] else [ids["im_end"]]) + ids["nl"]
        assert after[: len(closing)] == closing
        assert prompt[-len(ids["gen"]):] == ids["gen"]
        body = sampled[:-1] if sampled[-1] == ids["im_end"] else sampled
        retokenized_differs |= tok.encode(choice.message.content, add_special_tokens=False) != body
    # Sampled text does not always re-tokenize to the ids that produced it: only a splice passes above.
    assert retokenized_differs


def test_assistant_turn_not_from_this_server_is_retokenized(client, tok):
    convo = user("What is 6 x 7?") + [{"role": "assistant", "content": "The answer is 42, obviously."},
                                      {"role": "user", "content": "Why?"}]
    resp = client.chat.completions.create(model=MODEL, messages=convo, max_tokens=2)
    prompt = extra(resp, "prompt_token_ids")
    turn = tok.encode("<|im_start|>assistant\nThe answer is 42, obviously.<|im_end|>\n", add_special_tokens=False)
    assert find_run(prompt, turn) >= 0
    template = tok.apply_chat_template(convo, tokenize=False, add_generation_prompt=True)
    assert prompt == tok.encode(template, add_special_tokens=False)


def test_assistant_tool_call_turn_with_explicit_token_ids_is_spliced(client, tok, ids):
    text = '<tool_call>\n{"name":"get_weather","arguments":{"city":"Paris"}}\n</tool_call>'
    sampled = tok.encode(text, add_special_tokens=False) + [ids["im_end"]]
    assistant = {"role": "assistant", "content": None, "token_ids": sampled,
                 "tool_calls": [{"id": "call_1", "type": "function",
                                 "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]}
    convo = user("Weather in Paris?") + [assistant, {"role": "tool", "tool_call_id": "call_1", "content": "21C"}]
    resp = client.chat.completions.create(model=MODEL, messages=convo, tools=[WEATHER], max_tokens=2)
    prompt = extra(resp, "prompt_token_ids")
    at = find_run(prompt, ids["gen"] + sampled + ids["nl"])
    assert at >= 0
    rest = prompt[at + len(ids["gen"]) + len(sampled) + len(ids["nl"]):]
    tool_turn = tok.encode("<|im_start|>user\n<tool_response>\n21C\n</tool_response><|im_end|>\n", add_special_tokens=False)
    assert rest == tool_turn + ids["gen"]


# ---- tool calls from a model that really samples them --------------------------------------------

PREFIX = "Voilà, let me check"  # "à" is two byte-level tokens, neither a character alone
TOOL_CHAIN = [PREFIX, "<tool_call>", '{"name": "get_weather"}', "</tool_call>"]


def build_tool_calling_model(out, tok) -> list[int]:
    """The embedded model rewired into a deterministic bigram chain that writes one tool call:
    attention and MLP outputs zeroed (the residual stream is the current token's embedding) and an
    untied output layer that maps each token of the chain to the next. Returns the ids it samples."""
    model = AutoModelForCausalLM.from_pretrained(MODEL_DIR, dtype=torch.float32)
    sampled = [i for piece in TOOL_CHAIN for i in tok.encode(piece, add_special_tokens=False)]
    sampled.append(tok.convert_tokens_to_ids("<|im_end|>"))
    chain = tok.encode("\n", add_special_tokens=False)[-1:] + sampled  # the generation prompt ends in "\n"
    assert len(set(chain)) == len(chain), "a bigram chain cannot repeat a token"
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.norm.weight.fill_(1.0)
        emb = model.model.embed_tokens.weight
        # trained embeddings are correlated; random ones are near-orthogonal, so each bigram wins
        emb.copy_(torch.randn(emb.shape, generator=torch.Generator().manual_seed(0)))
        head = torch.zeros_like(emb)
        for cur, nxt in zip(chain, chain[1:]):
            head[nxt] = 5.0 * emb[cur] / emb[cur].norm()
    model.config.tie_word_embeddings = False
    model.lm_head = torch.nn.Linear(emb.shape[1], emb.shape[0], bias=False)
    model.lm_head.weight = torch.nn.Parameter(head)
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "artisan.json").write_text(json.dumps({"name": TOOL_MODEL}))
    return sampled


@pytest.fixture(scope="module")
def tool_server(tmp_path_factory, tok):
    model_dir = tmp_path_factory.mktemp("toolcaller-model")
    sampled = build_tool_calling_model(model_dir, tok)
    srv = ServerProcess(tmp_path_factory.mktemp("toolcaller-data"), model=model_dir).start()
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=60) as c:
        yield srv, c, sampled
    srv.stop()


def test_sampled_tool_call_is_parsed_and_its_turn_spliced_back(tool_server, tok, ids):
    _, c, sampled = tool_server
    messages = user("Weather in Paris?")
    resp = c.chat.completions.create(model=TOOL_MODEL, messages=messages, tools=[WEATHER], max_tokens=40)
    choice = resp.choices[0]
    assert extra(choice, "token_ids") == sampled
    assert choice.finish_reason == "tool_calls"
    assert choice.message.content == PREFIX
    # `bytes` are each token's own bytes: tokens that split a character join back into it.
    prefix_entries = choice.logprobs.content[: len(tok.encode(PREFIX, add_special_tokens=False))]
    assert b"".join(bytes(e.bytes) for e in prefix_entries).decode() == PREFIX
    [tc] = choice.message.tool_calls
    assert tc.type == "function" and tc.function.name == "get_weather" and json.loads(tc.function.arguments) == {}
    assert tc.id

    # Echo the SDK's own dict of the message plus a tool result: the sampled ids come back verbatim,
    # although re-rendering the message's text would give different ids.
    convo = messages + [choice.message.model_dump(), {"role": "tool", "tool_call_id": tc.id, "content": "21C"}]
    rerendered = tok.encode(tok.apply_chat_template(convo, tools=[WEATHER], tokenize=False), add_special_tokens=False)
    assert find_run(rerendered, ids["gen"] + sampled) < 0
    second = c.chat.completions.create(model=TOOL_MODEL, messages=convo, tools=[WEATHER], max_tokens=40)
    prompt = extra(second, "prompt_token_ids")
    at = find_run(prompt, ids["gen"] + sampled + ids["nl"])
    assert at >= 0
    assert prompt[at + len(ids["gen"]) + len(sampled) + len(ids["nl"]):] == tok.encode(
        "<|im_start|>user\n<tool_response>\n21C\n</tool_response><|im_end|>\n<|im_start|>assistant\n",
        add_special_tokens=False)
    assert second.choices[0].finish_reason == "tool_calls"


def test_streamed_tool_call_assembles_to_the_same_message(tool_server, ids):
    # Also: the stream holds back half a character ("à") instead of sending U+FFFD.
    _, c, sampled = tool_server
    messages = user("Weather in Oslo?")
    content, calls, token_ids, finish = "", {}, [], None
    for chunk in c.chat.completions.create(model=TOOL_MODEL, messages=messages, tools=[WEATHER], max_tokens=40,
                                           stream=True):
        for ch in chunk.choices:
            content += ch.delta.content or ""
            for tc in ch.delta.tool_calls or []:
                slot = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                slot["id"] += tc.id or ""
                slot["name"] += tc.function.name or ""
                slot["arguments"] += tc.function.arguments or ""
            token_ids += (ch.model_extra or {}).get("token_ids") or []
            finish = ch.finish_reason or finish
    assert content == PREFIX
    assert [(s["name"], json.loads(s["arguments"])) for s in calls.values()] == [("get_weather", {})]
    assert token_ids == sampled and finish == "tool_calls"
    # What a streaming client assembled is recognised as the sampled turn, too.
    assistant = {"role": "assistant", "content": content, "tool_calls": [
        {"id": s["id"], "type": "function", "function": {"name": s["name"], "arguments": s["arguments"]}}
        for s in calls.values()]}
    convo = messages + [assistant, {"role": "tool", "tool_call_id": calls[0]["id"], "content": "4C"}]
    second = c.chat.completions.create(model=TOOL_MODEL, messages=convo, tools=[WEATHER], max_tokens=1)
    assert find_run(extra(second, "prompt_token_ids"), ids["gen"] + sampled + ids["nl"]) >= 0


def test_tool_choice_none_or_no_tools_never_returns_tool_calls(tool_server):
    _, c, sampled = tool_server
    for kw in ({"tools": [WEATHER], "tool_choice": "none"}, {}):
        resp = c.chat.completions.create(model=TOOL_MODEL, messages=user("Weather?"), max_tokens=40, **kw)
        choice = resp.choices[0]
        assert not choice.message.tool_calls
        assert choice.finish_reason == "stop"
        assert choice.message.content == PREFIX + '<tool_call>{"name": "get_weather"}</tool_call>'


def test_tool_call_cut_by_max_tokens_stays_in_content(tool_server, ids):
    _, c, sampled = tool_server
    cut_inside_the_call = [i for i, t in enumerate(sampled) if t in ids["tags"]][0] + 3
    resp = c.chat.completions.create(model=TOOL_MODEL, messages=user("Weather?"), tools=[WEATHER],
                                     max_tokens=cut_inside_the_call)
    choice = resp.choices[0]
    assert choice.finish_reason == "length" and not choice.message.tool_calls
    assert choice.message.content.startswith(PREFIX + "<tool_call>")


# ---- 5. streaming -------------------------------------------------------------------------------

def test_raw_sse_stream_matches_the_non_streamed_completion(server, client):
    body = {"model": MODEL, "messages": user("Describe a cat."), "max_tokens": 16, "seed": 7, "stream": True}
    with httpx.stream("POST", server.url + "/v1/chat/completions", json=body, timeout=60) as r:
        assert r.status_code == 200
        assert r.headers["content-type"].startswith("text/event-stream")
        raw = r.read().decode()
    events = raw.split("\n\n")
    assert events[-1] == "" and events[-2] == "data: [DONE]"
    chunks = []
    for ev in events[:-2]:
        assert ev.startswith("data: ") and "\n" not in ev
        chunks.append(json.loads(ev[len("data: "):]))
    assert {ch["object"] for ch in chunks} == {"chat.completion.chunk"}
    assert len({ch["id"] for ch in chunks}) == 1 and chunks[0]["id"].startswith("chatcmpl-")
    assert chunks[0]["choices"][0]["delta"]["role"] == "assistant"
    finals = [ch for ch in chunks if ch["choices"][0]["finish_reason"]]
    assert len(finals) == 1 and finals[0] is chunks[-1]
    content = "".join(ch["choices"][0]["delta"].get("content") or "" for ch in chunks)
    token_ids = [t for ch in chunks for t in ch["choices"][0].get("token_ids", [])]
    logprobs = [e["logprob"] for ch in chunks for e in (ch["choices"][0].get("logprobs") or {}).get("content", [])]

    ref = client.chat.completions.create(model=MODEL, messages=body["messages"], max_tokens=16, seed=7)
    choice = ref.choices[0]
    assert content == choice.message.content
    assert token_ids == extra(choice, "token_ids")
    assert len(logprobs) == len(token_ids)
    assert max(abs(a - b.logprob) for a, b in zip(logprobs, choice.logprobs.content)) <= 1e-4
    assert chunks[-1]["choices"][0]["finish_reason"] == choice.finish_reason
    assert chunks[0]["prompt_token_ids"] == extra(ref, "prompt_token_ids")
    assert chunks[-1]["choices"][0]["sampling"]["prompt_len"] == len(extra(ref, "prompt_token_ids"))


def test_same_seed_same_tokens(client):
    kw = dict(model=MODEL, messages=user("Pick a word."), max_tokens=12, n=2, seed=1234)
    a, b = client.chat.completions.create(**kw), client.chat.completions.create(**kw)
    assert [extra(c, "token_ids") for c in a.choices] == [extra(c, "token_ids") for c in b.choices]
    other = client.chat.completions.create(**{**kw, "seed": 1235})
    assert [extra(c, "token_ids") for c in a.choices] != [extra(c, "token_ids") for c in other.choices]


def test_sdk_stream_with_n_and_usage(client):
    kw = dict(model=MODEL, messages=user("List fruits."), max_tokens=14, n=3, seed=99)
    texts, tokens, finishes, usage = ["", "", ""], [[], [], []], [None] * 3, None
    for chunk in client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if chunk.usage:
            usage = chunk.usage
        for ch in chunk.choices:
            texts[ch.index] += ch.delta.content or ""
            tokens[ch.index] += (ch.model_extra or {}).get("token_ids") or []
            finishes[ch.index] = ch.finish_reason or finishes[ch.index]
    ref = client.chat.completions.create(**kw)
    assert texts == [c.message.content for c in ref.choices]
    assert tokens == [extra(c, "token_ids") for c in ref.choices]
    assert finishes == [c.finish_reason for c in ref.choices]
    assert usage is not None and usage.completion_tokens == sum(len(t) for t in tokens)


async def test_async_sdk_stream(server, client):
    kw = dict(model=MODEL, messages=user("Hello async."), max_tokens=10, seed=5)

    async with async_client(server) as c:
        stream = await c.chat.completions.create(**kw, stream=True)
        streamed = "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])
    assert streamed == client.chat.completions.create(**kw).choices[0].message.content


def test_litellm_completion_and_stream(server, client):
    import litellm

    kw = dict(model="openai/" + MODEL, api_base=server.url + "/v1", api_key="x",
              messages=user("Hello litellm."), max_tokens=10, seed=42)
    want = client.chat.completions.create(model=MODEL, messages=kw["messages"], max_tokens=10, seed=42)
    resp = litellm.completion(**kw)
    assert resp.choices[0].message.content == want.choices[0].message.content
    streamed = "".join(ch.choices[0].delta.content or "" for ch in litellm.completion(**kw, stream=True))
    assert streamed == want.choices[0].message.content


# ---- 6. many concurrent requests ------------------------------------------------------------------

async def test_64_concurrent_requests_all_succeed(server, client, tok):
    prompts = [f"Request number {i}: {'x' * (i % 7)}" for i in range(64)]

    async with async_client(server) as c:
        responses = await asyncio.gather(*[
            c.chat.completions.create(model=MODEL, messages=user(p), max_tokens=4 + i % 5, seed=i)
            for i, p in enumerate(prompts)])
    assert len(responses) == 64
    for i, (p, resp) in enumerate(zip(prompts, responses)):
        want = tok.apply_chat_template(user(p), tokenize=False, add_generation_prompt=True)
        assert extra(resp, "prompt_token_ids") == tok.encode(want, add_special_tokens=False)  # nothing mixed up
        token_ids = extra(resp.choices[0], "token_ids")
        assert 1 <= len(token_ids) <= 4 + i % 5
    # A seeded row samples the same tokens alone as it did in a batch of 64.
    for i in (0, 37):
        alone = client.chat.completions.create(model=MODEL, messages=user(prompts[i]), max_tokens=4 + i % 5, seed=i)
        assert extra(alone.choices[0], "token_ids") == extra(responses[i].choices[0], "token_ids")


def test_models_route_lists_the_base_model(client):
    models = client.models.list()
    names = [m.id for m in models.data]
    assert MODEL in names
    assert extra(models.data[names.index(MODEL)], "max_model_len") == 2048


# ---- 7. legacy text completions: raw text continued without the template, echo's prompt logprobs as
# lm-eval reads them, batches, streaming, and one-line 400s after which the server goes on serving --

PROMPT = "A list of fruits: apple, pear,"


def full_forward_logprobs(model, ids: list[int]) -> list[float]:
    """Each token's logprob given the tokens before it (from the second on), at temperature 1."""
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0].float()
    lp = torch.log_softmax(logits[:-1], dim=-1)
    return lp.gather(1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()


def test_text_is_continued_without_the_template_and_scored_like_a_forward_pass(client, tok, ref_model):
    r = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=10, temperature=0, logprobs=3)
    [choice] = r.choices
    prompt_ids, ids = choice.model_extra["prompt_token_ids"], choice.model_extra["token_ids"]
    assert prompt_ids == tok.encode(PROMPT)  # no template around it
    lp = choice.logprobs
    assert lp.tokens == [tok.decode([t]) for t in ids]
    # Greedy reports temperature-1 logprobs: those of one forward pass over prompt and completion.
    want = full_forward_logprobs(ref_model, prompt_ids + ids)[len(prompt_ids) - 1:]
    assert lp.token_logprobs == pytest.approx(want, abs=1e-4)
    for token, top, offset in zip(lp.tokens, lp.top_logprobs, lp.text_offset):
        assert max(top, key=top.get) == token  # greedy: the likeliest, as lm-eval's is_greedy checks
        assert 2 <= len(top) <= 4
        if token not in tok.all_special_tokens:  # a closing stop token is not in the text
            assert choice.text[offset:offset + len(token)] == token
    assert r.usage.prompt_tokens == len(prompt_ids) and r.usage.completion_tokens == len(ids)


def test_token_prompt_samples_what_chat_samples(client):
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name a fruit."}],
                                          max_tokens=12, seed=7, temperature=1.0)
    prompt = chat.model_extra["prompt_token_ids"]
    [want] = chat.choices
    r = client.completions.create(model=MODEL, prompt=prompt, max_tokens=12, seed=7, temperature=1.0, logprobs=0)
    [choice] = r.choices
    assert choice.model_extra["token_ids"] == want.model_extra["token_ids"]
    assert choice.logprobs.token_logprobs == pytest.approx([e.logprob for e in want.logprobs.content], abs=1e-5)
    assert choice.model_extra["sampling"]["prompt_fingerprint"] == want.model_extra["sampling"]["prompt_fingerprint"]


def test_echo_scores_the_prompt_as_lm_eval_reads_it(client, ref_model):
    """lm-eval's loglikelihood: echo a context and its continuation, read the continuation's logprobs."""
    sampled = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=8, temperature=1.0, seed=3,
                                        logprobs=0).choices[0]
    context = sampled.model_extra["prompt_token_ids"]
    ids = context + sampled.model_extra["token_ids"]
    r = client.completions.create(model=MODEL, prompt=ids, max_tokens=0, echo=True, logprobs=1)
    [choice] = r.choices
    lp = choice.logprobs
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None  # nothing predicts the first token
    assert lp.token_logprobs[1:] == pytest.approx(full_forward_logprobs(ref_model, ids), abs=1e-4)
    # What was sampled scores as it was sampled, so a continuation's likelihood is the sampler's.
    assert lp.token_logprobs[len(context):] == pytest.approx(sampled.logprobs.token_logprobs, abs=1e-4)
    assert choice.model_extra["token_ids"] == [] and choice.finish_reason == "length"
    assert choice.text == PROMPT + sampled.text and r.usage.completion_tokens == 0
    echoed = client.completions.create(model=MODEL, prompt=PROMPT, max_tokens=4, echo=True, temperature=0, logprobs=0)
    text, lp = echoed.choices[0].text, echoed.choices[0].logprobs
    assert text.startswith(PROMPT) and len(lp.tokens) == len(context) + 4
    assert [text[o:o + len(t)] for o, t in zip(lp.text_offset, lp.tokens)] == lp.tokens
    # A character over several byte tokens: whole tokens still start where their text does.
    unicode = "Café ☕, naïve 日本"
    lp = client.completions.create(model=MODEL, prompt=unicode, max_tokens=0, echo=True, logprobs=0).choices[0].logprobs
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] < len(unicode)
    whole = [(o, t) for o, t in zip(lp.text_offset, lp.tokens) if "\ufffd" not in t]
    assert whole and all(unicode[o:o + len(t)] == t for o, t in whole)


def test_a_batch_gives_n_choices_per_prompt_in_order(client, tok):
    prompts = ["One, two,", "Red, green,"]
    r = client.completions.create(model=MODEL, prompt=prompts, max_tokens=5, n=2, seed=1)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    assert [c.model_extra["prompt_token_ids"] for c in r.choices] == [tok.encode(p) for p in prompts for _ in "ab"]
    assert r.usage.prompt_tokens == sum(len(tok.encode(p)) for p in prompts)
    assert r.usage.completion_tokens == sum(len(c.model_extra["token_ids"]) for c in r.choices)


def test_stream_joins_to_the_text_it_would_have_answered(client):
    kw = dict(model=MODEL, prompt=PROMPT, max_tokens=24, temperature=0, stop=[" pear"])
    want = client.completions.create(**kw).choices[0]
    text, finish, ids, usage = "", None, [], None
    for chunk in client.completions.create(**kw, stream=True, stream_options={"include_usage": True}):
        if not chunk.choices:
            usage = chunk.usage
            continue
        text += chunk.choices[0].text
        ids += chunk.choices[0].model_extra["token_ids"]
        finish = chunk.choices[0].finish_reason or finish
    assert (text, finish, ids) == (want.text, want.finish_reason, want.model_extra["token_ids"])
    assert " pear" not in text and usage.completion_tokens == len(ids)


def test_litellm_text_completion(server, client):
    import litellm

    kw = dict(prompt=PROMPT, max_tokens=8, temperature=0)
    want = client.completions.create(model=MODEL, **kw).choices[0].text
    resp = litellm.text_completion(model="text-completion-openai/" + MODEL, api_base=server.url + "/v1", api_key="x",
                                   **kw)
    assert resp.choices[0].text == want


@pytest.mark.parametrize("body, names", [
    ({"prompt": ""}, "prompt is empty"),
    ({"prompt": []}, "at least one token"),
    ({"prompt": [10**9]}, "not a token id"),
    ({"prompt": ["a", [1, 2]]}, "prompt"),
    ({"prompt": "x", "max_tokens": 0}, "only meaningful with echo"),
    ({"prompt": "x", "suffix": "y"}, "suffix"),
    ({"prompt": "x", "best_of": 3}, "best_of"),
    ({"prompt": "x", "logit_bias": {"5": 3}}, "logit_bias"),
    ({"prompt": "x", "top_k": 5}, "top_k"),
    ({"prompt": ["a", "b"], "stream": True}, "one prompt"),
    ({"prompt": "x " * 5000}, "context window"),
    ({"prompt": "x", "model": "nope"}, "does not exist"),
])
def test_bad_requests_get_one_line_errors_and_serving_goes_on(server, client, body, names):
    r = httpx.post(server.url + "/v1/completions", json={"model": MODEL, **body}, timeout=60)
    assert r.status_code in (400, 404), r.text
    message = r.json()["error"]["message"]
    assert names in message and "\n" not in message
    assert client.completions.create(model=MODEL, prompt="ok", max_tokens=1).choices[0].finish_reason
