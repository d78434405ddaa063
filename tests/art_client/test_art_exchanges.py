"""ART 0.5.23's client-side capture of Responses, Messages and Chat Completions exchanges,
trained through ArtisanBackend against a live art-server.

ART's own rollout style since 0.5.23: the agent calls the real `openai` and `anthropic` SDKs inside
`art.trajectory(...)`, which records each HTTP exchange; nothing is appended by hand. Two turns
with a function call (SmolLM2-135M with Qwen2.5's template, which renders tools), streamed and
not, and one training step per API that must be token-exact. Runs in the ART environments
(`make test-art`); the server runs from the main one.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import json

import pytest

art = pytest.importorskip("art")
if "exchanges" not in getattr(art.Trajectory, "model_fields", {}):
    pytest.skip(f"openpipe-art {importlib.metadata.version('openpipe-art')} captures only Chat Completions "
                "into messages_and_choices; client-side capture of Responses and Messages exchanges came with 0.5.23",
                allow_module_level=True)

import anthropic  # noqa: E402
from openai import AsyncOpenAI  # noqa: E402

from client.adapters.art_compat import ArtisanBackend  # noqa: E402
from client.local_server import ROOT, LocalServer  # noqa: E402
from test_art_client import HUB_ID, SERVER_PYTHON, _smollm2, trainable  # noqa: E402

CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
        "additionalProperties": False}
FUNCTIONS = [{"name": "get_weather", "description": "Weather in a city.", "parameters": CITY},
             {"name": "get_time", "description": "Local time in a city.", "parameters": CITY}]
INSTRUCTIONS = "Answer with the tools."
ASKED = [{"role": "user", "content": "What is the weather in Paris?"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = LocalServer(tmp_path_factory.mktemp("art-exchanges"), model=_smollm2(), python=SERVER_PYTHON,
                      extra=["--device", "cpu", "--cache-dir", str(ROOT / "test-artifacts" / "cache"),
                             "--served-model-name", "smollm2", "--served-model-name", HUB_ID,
                             "--chat-template", str(ROOT / "tests" / "data" / "templates" / "qwen2_5.jinja")]
                      ).start(timeout=600)
    yield srv
    srv.stop()


@pytest.fixture
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # ART writes its logs under ./.art


async def responses_rollout(client: AsyncOpenAI, model: str, seed: int, stream: bool) -> None:
    tools = [{"type": "function", **f} for f in FUNCTIONS]
    kw = dict(model=model, instructions=INSTRUCTIONS, tools=tools, extra_body={"seed": seed})
    if stream:
        events = [e async for e in await client.responses.create(
            input=ASKED, tool_choice="required", parallel_tool_calls=False, max_output_tokens=200, stream=True, **kw)]
        first = events[-1].response
    else:
        first = await client.responses.create(input=ASKED, tool_choice="required", parallel_tool_calls=False,
                                              max_output_tokens=200, **kw)
    calls = [o for o in first.output if o.type == "function_call"]
    assert first.status == "completed" and calls, first.output
    results = [{"type": "function_call_output", "call_id": c.call_id, "output": "21C and sunny"} for c in calls]
    # Not streamed even in the streamed rollout: cut at max_output_tokens, a stream ends with
    # `response.incomplete` (as OpenAI's does), and ART 0.5.23 keeps only streams that end with
    # `response.completed`: it would drop the turn.
    await client.responses.create(input=[*ASKED, *[o.model_dump(exclude_none=True) for o in first.output], *results],
                                  max_output_tokens=8, **kw)


async def messages_rollout(client: anthropic.AsyncAnthropic, model: str, seed: int, stream: bool) -> None:
    tools = [{"name": f["name"], "description": f["description"], "input_schema": f["parameters"]} for f in FUNCTIONS]
    kw = dict(model=model, system=INSTRUCTIONS, tools=tools, extra_body={"seed": seed})

    async def create(**more) -> tuple[str, list[dict]]:
        """(stop reason, tool calls), from the message or from its events"""
        if not stream:
            m = await client.messages.create(**kw, **more)
            return m.stop_reason, [{"id": b.id, "name": b.name, "input": b.input} for b in m.content
                                   if b.type == "tool_use"]
        events = [e async for e in await client.messages.create(stream=True, **kw, **more)]
        assert events[-1].type == "message_stop"
        uses = {e.index: {"id": e.content_block.id, "name": e.content_block.name, "input": ""} for e in events
                if e.type == "content_block_start" and e.content_block.type == "tool_use"}
        for e in events:
            if e.type == "content_block_delta" and e.delta.type == "input_json_delta":
                uses[e.index]["input"] += e.delta.partial_json
        stop = next(e.delta.stop_reason for e in events if e.type == "message_delta")
        return stop, [{**u, "input": json.loads(u["input"])} for u in uses.values()]

    stop, uses = await create(messages=ASKED, tool_choice={"type": "any", "disable_parallel_tool_use": True},
                              max_tokens=200)
    assert stop == "tool_use" and uses
    turn = {"role": "assistant", "content": [{"type": "tool_use", **u} for u in uses]}
    results = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": u["id"], "content": "21C and sunny"}
                                           for u in uses]}
    await create(messages=[*ASKED, turn, results], max_tokens=8)


async def chat_rollout(client: AsyncOpenAI, model: str, seed: int, stream: bool) -> None:
    tools = [{"type": "function", "function": f} for f in FUNCTIONS]
    first = await client.chat.completions.create(model=model, messages=ASKED, tools=tools, tool_choice="required",
                                                 parallel_tool_calls=False, max_tokens=200, seed=seed)
    message = first.choices[0].message
    assert message.tool_calls, message
    results = [{"role": "tool", "tool_call_id": c.id, "content": "21C and sunny"} for c in message.tool_calls]
    echoed = message.model_dump(exclude_none=True, exclude={"refusal", "annotations", "audio", "function_call"})
    second = await client.chat.completions.create(model=model, messages=[*ASKED, echoed, *results], tools=tools,
                                                  max_tokens=8, seed=seed, stream=stream)
    if stream:
        async for _ in second:
            pass


async def train_captured(server, name: str, rollout, make_client) -> tuple[list, dict[str, float]]:
    """Four rollouts captured by ART (two seeds, streamed and not), two groups, one step."""
    backend = ArtisanBackend(server.url)
    model = trainable(name, project="artisan-art", base_model=HUB_ID)
    await model.register(backend)
    client = make_client()

    async def one(stream: bool, seed: int) -> art.Trajectory:
        t = await art.trajectory(rollout(client, model.get_inference_name(), seed, stream))
        t.reward = float(seed)
        return t

    # All four at once, as ART's own gathers run rollouts: the server decodes them in one batch, and
    # each capture keeps to its own task.
    plain_0, plain_1, streamed_0, streamed_1 = await asyncio.gather(
        *(one(stream, seed) for stream in (False, True) for seed in (0, 1)))
    groups = [art.TrajectoryGroup([plain_0, plain_1]), art.TrajectoryGroup([streamed_0, streamed_1])]
    await client.close()
    captured = [t.exchanges for g in groups for t in g.trajectories]
    result = await backend.train(model, groups, learning_rate=1e-4)
    await backend.close()
    assert result.step == 1
    return captured, result.metrics


def check(metrics: dict[str, float]) -> None:
    # four rollouts of two turns: every turn trained, each prompt rebuilt to the ids it was sampled after
    assert metrics["choices"] == metrics["trained_choices"] == 8, metrics
    assert metrics["prompt_mismatches"] == 0 and metrics["logprob_gap"] <= 1e-3, metrics


async def test_captured_responses_exchanges_train_token_exactly(server, in_tmp):
    captured, m = await train_captured(server, "cap-responses", responses_rollout,
                                       lambda: AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0))
    assert all(len(e.responses) == 2 and not e.messages for e in captured)
    check(m)


async def test_captured_messages_exchanges_train_token_exactly(server, in_tmp):
    captured, m = await train_captured(server, "cap-messages", messages_rollout,
                                       lambda: anthropic.AsyncAnthropic(base_url=server.url, api_key="x", max_retries=0))
    assert all(len(e.messages) == 2 and not e.responses for e in captured)
    check(m)


async def test_captured_chat_completions_exchanges_train_token_exactly(server, in_tmp):
    captured, m = await train_captured(server, "cap-chat", chat_rollout,
                                       lambda: AsyncOpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0))
    assert all(len(e.chat_completions) == 2 for e in captured)
    check(m)
