"""The Responses and Anthropic Messages APIs driven by their real SDKs (`openai`, `anthropic`,
`openai-agents`) against art-server on real weights (SmolLM2-135M, with Qwen2.5's template so it
sees tools) and on a tiny model with Qwen3's template: a function call and its result over two
turns, streamed and not, recorded in sessions and trained for one step token-exactly.
"""

from __future__ import annotations

import asyncio
import json
from typing import Annotated, Any

import anthropic
import pytest
from openai import AsyncOpenAI
from pydantic import Field

from client import TrainConfig, TrainableModel
from conftest import ServerProcess
from tests.families import tiny_model_dir
from tests.real_models import CACHE, TEMPLATES, converted, smollm2_gguf

# maxLength: a random model fills a string until it is told to stop
CITY = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12}}, "required": ["city"],
        "additionalProperties": False}
RESPONSES_TOOLS = [{"type": "function", "name": "get_weather", "description": "Weather in a city.", "parameters": CITY},
                   {"type": "function", "name": "get_time", "description": "Local time in a city.", "parameters": CITY}]
MESSAGES_TOOLS = [{"name": t["name"], "description": t["description"], "input_schema": CITY} for t in RESPONSES_TOOLS]
QUESTION = "What is the weather in Paris?"


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    root = tmp_path_factory.mktemp("harness")
    started: dict[str, ServerProcess] = {}

    def serve(name: str) -> ServerProcess:
        if name not in started:
            if name == "smollm2":
                converted(smollm2_gguf())
                extra = ["--cache-dir", str(CACHE), "--served-model-name", "smollm2",
                         "--chat-template", str(TEMPLATES / "qwen2_5.jinja")]
                started[name] = ServerProcess(root / name, model=smollm2_gguf(), extra=extra).start(timeout=600)
            else:
                started[name] = ServerProcess(root / name, model=tiny_model_dir(name, root)).start()
        return started[name]

    yield serve
    for s in started.values():
        s.stop()


def extra(obj: Any, key: str) -> Any:
    return (obj.model_extra or {})[key]


def check_step(result, choices: int) -> None:
    m = result.metrics
    assert result.trained, result.warnings
    assert m.prompt_mismatches == 0 and m.trained_choices == m.choices == choices, m
    assert m.logprob_gap is not None and m.logprob_gap <= 1e-3


# ---- Responses ----------------------------------------------------------------------------------

async def _respond(client: AsyncOpenAI, stream: bool, **kw: Any):
    if not stream:
        return await client.responses.create(**kw)
    events = [e async for e in await client.responses.create(stream=True, **kw)]
    kinds = [e.type for e in events]
    assert kinds[:2] == ["response.created", "response.in_progress"], kinds
    assert kinds[-1] in ("response.completed", "response.incomplete"), kinds
    assert [e.sequence_number for e in events] == list(range(len(events)))
    final = events[-1].response
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == "".join(c.text for o in final.output if o.type == "message" for c in o.content)
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [i.id for i in done] == [o.id for o in final.output]
    return final


async def responses_rollout(model: TrainableModel, session: str, seed: int, stream: bool) -> None:
    async with AsyncOpenAI(base_url=model.session_url(session), api_key="x", max_retries=0, timeout=300) as client:
        asked = [{"role": "user", "content": QUESTION}]
        first = await _respond(client, stream, model=model.name, instructions="Answer with the tools.", input=asked,
                               tools=RESPONSES_TOOLS, tool_choice="required", parallel_tool_calls=False,
                               max_output_tokens=200, extra_body={"seed": seed})
        calls = [o for o in first.output if o.type == "function_call"]
        assert first.status == "completed" and calls and calls[0].name in ("get_weather", "get_time")
        assert "city" in json.loads(calls[0].arguments)
        results = [{"type": "function_call_output", "call_id": c.call_id, "output": "21C and sunny"} for c in calls]
        second = await _respond(client, stream, model=model.name, instructions="Answer with the tools.",
                                input=[*asked, *[o.model_dump(exclude_none=True) for o in first.output], *results],
                                tools=RESPONSES_TOOLS, max_output_tokens=8, extra_body={"seed": seed})
        assert second.usage.output_tokens == len(extra(second, "token_ids")) <= 8
        # The echoed items rendered back to the exact sampled ids: the turn is spliced, not re-tokenized.
        prompt, ids = extra(first, "prompt_token_ids"), extra(first, "token_ids")
        assert extra(second, "prompt_token_ids")[: len(prompt) + len(ids)] == prompt + ids


@pytest.mark.parametrize("family", ["smollm2", "qwen3"])
async def test_responses_with_a_function_call_over_two_turns_train_token_exactly(servers, family):
    srv = servers(family)

    model = await TrainableModel(f"{family}-responses").register(srv.url)
    sessions = {(stream, seed): f"{family}-resp-{stream}-{seed}" for stream in (False, True) for seed in (0, 1)}
    await asyncio.gather(*[responses_rollout(model, sid, seed, stream) for (stream, seed), sid in sessions.items()])
    groups = [[(sessions[(stream, seed)], float(seed)) for seed in (0, 1)] for stream in (False, True)]
    check_step(await model.train_sessions(groups, TrainConfig(learning_rate=1e-4)), choices=8)


# ---- Anthropic Messages -------------------------------------------------------------------------

async def _message(client: anthropic.AsyncAnthropic, stream: bool, **kw: Any):
    if not stream:
        return await client.messages.create(**kw)
    async with client.messages.stream(**kw) as s:
        return await s.get_final_message()


async def messages_rollout(model: TrainableModel, session: str, seed: int, stream: bool) -> None:
    async with anthropic.AsyncAnthropic(base_url=model.session_url(session), api_key="x", max_retries=0,
                                        timeout=300) as client:
        asked = [{"role": "user", "content": QUESTION}]
        first = await _message(client, stream, model=model.name, system="Answer with the tools.", messages=asked,
                               tools=MESSAGES_TOOLS, tool_choice={"type": "any", "disable_parallel_tool_use": True},
                               max_tokens=200, extra_body={"seed": seed})
        uses = [b for b in first.content if b.type == "tool_use"]
        assert first.stop_reason == "tool_use" and uses and uses[0].name in ("get_weather", "get_time")
        assert isinstance(uses[0].input, dict) and "city" in uses[0].input
        turn = {"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in first.content]}
        results = {"role": "user", "content": [{"type": "tool_result", "tool_use_id": u.id, "content": "21C and sunny"}
                                               for u in uses]}
        second = await _message(client, stream, model=model.name, system="Answer with the tools.",
                                messages=[*asked, turn, results], tools=MESSAGES_TOOLS, max_tokens=8,
                                extra_body={"seed": seed})
        assert second.stop_reason in ("end_turn", "max_tokens", "tool_use") and second.usage.output_tokens <= 8
        if not stream:
            prompt, ids = extra(first, "prompt_token_ids"), extra(first, "token_ids")
            assert extra(second, "prompt_token_ids")[: len(prompt) + len(ids)] == prompt + ids


@pytest.mark.parametrize("family", ["smollm2", "qwen3"])
async def test_messages_with_tool_use_over_two_turns_train_token_exactly(servers, family):
    srv = servers(family)

    model = await TrainableModel(f"{family}-messages").register(srv.url)
    sessions = {(stream, seed): f"{family}-msg-{stream}-{seed}" for stream in (False, True) for seed in (0, 1)}
    await asyncio.gather(*[messages_rollout(model, sid, seed, stream) for (stream, seed), sid in sessions.items()])
    groups = [[(sessions[(stream, seed)], float(seed)) for seed in (0, 1)] for stream in (False, True)]
    check_step(await model.train_sessions(groups, TrainConfig(learning_rate=1e-4)), choices=8)


# ---- an agent harness, unchanged but for its base URL ---------------------------------------------

async def test_an_openai_agents_sdk_agent_trains_through_a_session_url(servers, monkeypatch):
    monkeypatch.setenv("OPENAI_AGENTS_DISABLE_TRACING", "1")  # it would send traces to OpenAI
    import agents

    srv = servers("smollm2")

    @agents.function_tool
    def get_weather(city: Annotated[str, Field(max_length=12)]) -> str:
        """Weather in a city."""
        return "21C and sunny"

    @agents.function_tool
    def get_time(city: Annotated[str, Field(max_length=12)]) -> str:
        """Local time in a city."""
        return "noon"

    async def run(model: TrainableModel, session: str, seed: int) -> int:
        client = AsyncOpenAI(base_url=model.session_url(session), api_key="x", max_retries=0, timeout=300)
        agent = agents.Agent(
            name="assistant", instructions="Answer with the tools.", tools=[get_weather, get_time],
            model=agents.OpenAIResponsesModel(model=model.name, openai_client=client),
            model_settings=agents.ModelSettings(tool_choice="required", parallel_tool_calls=False, max_tokens=48,
                                                extra_body={"seed": seed}))
        try:
            result = await agents.Runner.run(agent, QUESTION, max_turns=3)
            items = result.new_items
        except agents.MaxTurnsExceeded as e:  # a model that keeps calling tools: still a session to score
            items = e.run_data.new_items if e.run_data else []
        finally:
            await client.close()
        return sum(isinstance(i, agents.ToolCallItem) for i in items)

    model = await TrainableModel("agents-sdk").register(srv.url)
    calls = await asyncio.gather(*[run(model, f"agent-{seed}", seed) for seed in (0, 1)])
    assert all(n >= 1 for n in calls), calls  # each agent called a tool and got its result back
    sessions = [await model.request("GET", f"/v1/sessions/agent-{seed}") for seed in (0, 1)]
    assert all(s["exchanges"] >= 2 for s in sessions), sessions
    result = await model.train_sessions([[("agent-0", 0.0), ("agent-1", 1.0)]], TrainConfig(learning_rate=1e-4))
    check_step(result, choices=sum(s["exchanges"] for s in sessions))
