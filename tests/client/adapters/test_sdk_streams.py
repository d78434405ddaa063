"""The real `openai` and `anthropic` SDKs' stream helpers against art-server (the embedded model):
what their accumulators keep of the training fields, client/adapters/sdk_streams.py's `final_answer` giving
back the answer a request that does not stream gets (same seed, same ids, logprobs and sampling
record), a streamed choice that trains token-exactly from its own fields, a session base URL that
ends in `/v1`, and TrainConfig.skip_mismatched_prompts.
"""

from __future__ import annotations

from typing import Any

import anthropic
import openai
import pytest
from openai import AsyncOpenAI, OpenAI

from client import TrainConfig, TrainableModel
from client.adapters.sdk_streams import final_answer, final_answer_sync
from protocol.trajectory import Trajectory, TrajectoryGroup

ASKED = [{"role": "user", "content": "What does a lamp cost?"}]
ITEM = {"type": "object", "properties": {"item": {"type": "string", "maxLength": 8}}, "required": ["item"],
        "additionalProperties": False}
# strict: the openai SDK's stream helper takes no other function tools
CHAT_TOOLS = [{"type": "function", "function": {"name": "get_price", "description": "Price of an item",
                                                "parameters": ITEM, "strict": True}}]
MESSAGES_TOOLS = [{"name": "get_price", "description": "Price of an item", "input_schema": ITEM}]
RESPONSES_TOOLS = [{"type": "function", "name": "get_price", "description": "Price of an item", "parameters": ITEM}]


@pytest.fixture(scope="module")
async def model(server) -> TrainableModel:
    return await TrainableModel("sdk-streams").register(server.url)


def extras(obj: Any) -> dict[str, Any]:
    return dict(obj.model_extra or {})


def chat_fields(completion) -> dict[str, Any]:
    """What a choice is, but for its calls' ids (new ones for every request)."""
    [choice] = completion.choices
    message = choice.message.model_dump(exclude_none=True)
    for call in message.get("tool_calls", []):
        call.pop("id")
    return {**extras(completion), **extras(choice), "logprobs": choice.logprobs.model_dump(), "message": message,
            "finish_reason": choice.finish_reason}


# ---- the training fields survive the SDKs' stream helpers ----------------------------------------

@pytest.mark.parametrize("tools", [False, True], ids=["text", "tool call"])
async def test_a_streamed_chat_completion_carries_what_the_same_request_unstreamed_does(model, tools):
    # max_tokens cuts the text answer: the SDK's own get_final_completion() raises for that.
    kw: dict[str, Any] = dict(model=model.name, messages=ASKED, max_tokens=8, seed=7, temperature=1.0)
    if tools:
        kw.update(tools=CHAT_TOOLS, tool_choice="required", max_tokens=40)

    async with AsyncOpenAI(base_url=model.server_url + "/v1", api_key="x", max_retries=0) as client:
        whole = await client.chat.completions.create(**kw)
        async with client.chat.completions.stream(**kw) as stream:
            streamed = await final_answer(stream)
    fields = chat_fields(streamed)
    assert {"prompt_token_ids", "token_ids", "sampling"} <= fields.keys(), fields.keys()
    assert fields == chat_fields(whole)
    assert len(fields["token_ids"]) == len(fields["logprobs"]["content"]) > 0
    assert (fields["finish_reason"] == "tool_calls") == tools, fields["finish_reason"]


@pytest.mark.parametrize("tools", [False, True], ids=["text", "tool use"])
async def test_a_streamed_message_carries_what_the_same_request_unstreamed_does(model, tools):
    kw: dict[str, Any] = dict(model=model.name, messages=ASKED, max_tokens=8, extra_body={"seed": 7})
    if tools:
        kw.update(tools=MESSAGES_TOOLS, tool_choice={"type": "any"}, max_tokens=40)

    async with anthropic.AsyncAnthropic(base_url=model.server_url, api_key="x", max_retries=0) as client:
        whole = await client.messages.create(**kw)
        async with client.messages.stream(**kw) as stream:
            streamed = await final_answer(stream)
    assert {"prompt_token_ids", "token_ids", "logprobs", "sampling"} <= extras(streamed).keys()
    assert extras(streamed) == extras(whole)
    assert [b.model_dump(exclude={"parsed_output", "id"}) for b in streamed.content] == \
        [b.model_dump(exclude={"id"}) for b in whole.content]
    assert streamed.stop_reason == whole.stop_reason == ("tool_use" if tools else "max_tokens")


async def test_a_streamed_response_carries_what_the_same_request_unstreamed_does(model):
    """The SDK's own get_final_response() keeps every field of `response.completed`; final_answer
    also returns a response cut by max_output_tokens, whose stream ends `response.incomplete`."""
    kw: dict[str, Any] = dict(model=model.name, input=ASKED, tools=RESPONSES_TOOLS, tool_choice="required",
                              max_output_tokens=40, extra_body={"seed": 7})

    async with AsyncOpenAI(base_url=model.server_url + "/v1", api_key="x", max_retries=0) as client:
        answers = []
        for more in ({}, {"tools": None, "tool_choice": None, "max_output_tokens": 4}):
            args = {k: v for k, v in {**kw, **more}.items() if v is not None}
            whole = await client.responses.create(**args)
            async with client.responses.stream(**args) as stream:
                streamed = await final_answer(stream)
            answers.append((whole, streamed))
        async with client.responses.stream(**kw) as stream:
            answers.append((answers[0][0], await stream.get_final_response()))
    for whole, streamed in answers:
        assert {"prompt_token_ids", "token_ids", "logprobs", "sampling"} <= extras(streamed).keys()
        assert extras(streamed) == extras(whole)
        assert streamed.status == whole.status
    assert [whole.status for whole, _ in answers[:2]] == ["completed", "incomplete"]


def test_sync_clients_streams_keep_them_too(model):
    chat_kw = dict(model=model.name, messages=ASKED, max_tokens=6, seed=3)
    with OpenAI(base_url=model.server_url + "/v1", api_key="x", max_retries=0) as client:
        whole = client.chat.completions.create(**chat_kw)
        with client.chat.completions.stream(**chat_kw) as stream:
            seen: list[str] = []
            streamed = final_answer_sync(stream, on_event=lambda e: seen.append(e.type))
    assert chat_fields(streamed) == chat_fields(whole) and "content.delta" in seen
    msg_kw = dict(model=model.name, messages=ASKED, max_tokens=6, extra_body={"seed": 3})
    with anthropic.Anthropic(base_url=model.server_url, api_key="x", max_retries=0) as client:
        whole = client.messages.create(**msg_kw)
        with client.messages.stream(**msg_kw) as stream:
            streamed = final_answer_sync(stream)
    assert extras(streamed) == extras(whole) and "token_ids" in extras(streamed)


async def test_a_stream_already_read_is_refused_rather_than_missing_ids(model):
    async with AsyncOpenAI(base_url=model.server_url + "/v1", api_key="x", max_retries=0) as client:
        async with client.chat.completions.stream(model=model.name, messages=ASKED, max_tokens=6) as stream:
            await stream.__anext__()
            await stream.__anext__()
            with pytest.raises(RuntimeError, match="needs the stream unread"):
                await final_answer(stream)
    with pytest.raises(TypeError, match="chat.completions.stream"):
        await final_answer(object())


async def test_streamed_choices_train_from_their_own_fields(model):
    """Recovered from the server's record of its turns is the fallback for a choice that lost its
    ids; these carry them, so none is recovered, and both train."""

    async with AsyncOpenAI(base_url=model.server_url + "/v1", api_key="x", max_retries=0) as client:
        trajectories = []
        for seed in (1, 2):
            async with client.chat.completions.stream(model=model.name, messages=ASKED, max_tokens=8,
                                                      seed=seed) as stream:
                completion = await final_answer(stream)
            trajectories.append(Trajectory(messages_and_choices=[*ASKED, completion.choices[0]],
                                           reward=float(seed)))
    result = await model.train([TrajectoryGroup(trajectories=trajectories)], TrainConfig(learning_rate=1e-4))
    m = result.metrics
    assert result.trained, result.warnings
    assert m.choices == m.trained_choices == 2 and m.recovered_choices == 0 and m.prompt_mismatches == 0, m
    assert m.logprob_gap is not None and m.logprob_gap <= 1e-3


# ---- a session base URL that ends in /v1 ---------------------------------------------------------

async def test_a_session_base_url_may_end_in_v1(model):
    sid = "sdk-streams-v1"

    async with AsyncOpenAI(base_url=model.session_url(sid) + "/v1", api_key="x", max_retries=0) as client:
        assert model.name in [m.id async for m in client.models.list()]
        await client.chat.completions.create(model=model.name, messages=ASKED, max_tokens=4, seed=1)
        await client.responses.create(model=model.name, input=ASKED, max_output_tokens=4, extra_body={"seed": 1})
        async with client.chat.completions.stream(model=model.name, messages=ASKED, max_tokens=4) as stream:
            await final_answer(stream)
    async with anthropic.AsyncAnthropic(base_url=model.session_url(sid), api_key="x", max_retries=0) as client:
        await client.messages.create(model=model.name, messages=ASKED, max_tokens=4)
    assert (await model.request("GET", f"/v1/sessions/{sid}"))["exchanges"] == 4


def test_any_other_path_under_a_session_says_which_ones_there_are(model):
    client = OpenAI(base_url=model.session_url("sdk-streams-bad") + "/v1/v1", api_key="x", max_retries=0)
    with pytest.raises(openai.NotFoundError) as e:
        client.chat.completions.create(model=model.name, messages=ASKED, max_tokens=4)
    message = e.value.body["message"]
    assert "no route POST /v1/sessions/sdk-streams-bad/v1/v1/chat/completions" in message
    assert "/v1/sessions/{id}/v1/" in message and "POST responses" in message


# ---- TrainConfig.skip_mismatched_prompts ---------------------------------------------------------

@pytest.mark.parametrize("skip", [True, False])
async def test_skip_mismatched_prompts_false_trains_a_choice_whose_prompt_was_edited(server, skip):
    """The second rollout's question was edited after it was sampled: its prompt no longer
    rebuilds to the one sampled. Skipped (the default) it is context; not skipped it trains, after
    the rebuilt prompt, and the step says so."""

    run = await TrainableModel(f"sdk-streams-mismatch-{skip}").register(server.url)
    async with AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0) as client:
        trajectories = []
        for seed in (1, 2):
            completion = await client.chat.completions.create(model=run.name, messages=ASKED, max_tokens=8,
                                                              seed=seed)
            asked = ASKED if seed == 1 else [{"role": "user", "content": "What does a chair cost?"}]
            trajectories.append(Trajectory(messages_and_choices=[*asked, completion.choices[0]],
                                           reward=float(seed)))
    ids = [t.messages_and_choices[-1].token_ids for t in trajectories]
    result = await run.train([TrajectoryGroup(trajectories=trajectories)],
                             TrainConfig(learning_rate=1e-4, skip_mismatched_prompts=skip))
    m = result.metrics
    assert result.trained, result.warnings
    assert m.choices == 2 and m.prompt_mismatches == 1, m
    trained = [ids[0]] if skip else ids
    assert (m.trained_choices, m.prompt_mismatches_trained) == (len(trained), 0 if skip else 1)
    assert m.trainable_tokens == sum(len(i) for i in trained)
    [warning] = [w for w in result.warnings if "could not be rebuilt" in w]
    assert ("were not trained" in warning) == skip and ("trained anyway" in warning) == (not skip)
