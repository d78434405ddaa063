"""The real chat templates of Qwen2.5-Instruct, Qwen3, Qwen3.5, Llama-3.1-Instruct, Mistral-7B-Instruct-v0.3,
Gemma 3, Gemma 4, GLM-4.5, LFM2.5, gpt-oss and SmolLM2 (tests/families.py), rendered by the server
exactly as transformers renders them, with sampled turns spliced in by id; and tiny random models
served end to end.
"""

from __future__ import annotations

import asyncio
import copy
import json

import openai
import pytest
from transformers import AutoTokenizer

from client import TrainConfig, TrainableModel, Trajectory, TrajectoryGroup
from conftest import ServerProcess
from server.chat.format import ChatFormat
from server.chat.template import TemplateError, template_message
from tests.families import FAMILIES, family_format, tiny_model_dir, tokenizer_dir, written_turn

# maxLength: a random model fills a string until it is told to stop
WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                            "parameters": {"type": "object", "properties": {
                                                "city": {"type": "string", "maxLength": 12}}, "required": ["city"],
                                                "additionalProperties": False}}}
BOOK = {"type": "function", "function": {"name": "book", "description": "Réserver une table.",
                                         "parameters": {"type": "object", "properties": {
                                             "people": {"type": "integer", "maximum": 99}, "when": {"type": "string", "maxLength": 12}},
                                             "additionalProperties": False}}}


def call(id_: str, name: str, args: dict) -> dict:
    return {"id": id_, "type": "function", "function": {"name": name, "arguments": json.dumps(args)}}


# Mistral's template wants nine-character ids; the others take any.
CONVERSATIONS = {
    "user_only": ([{"role": "user", "content": "Hello!"}], None),
    "system_prompt": ([{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi"}], None),
    "unicode_and_jinja_lookalikes": ([
        {"role": "user", "content": "Réservez «deux» places 🎉 {{ user }} {% if x %}"},
        {"role": "assistant", "content": "C'est fait: {{ done }} ✓"},
        {"role": "user", "content": "Merci {#comment#}"}], None),
    "tools_offered": ([{"role": "system", "content": "Use tools."},
                       {"role": "user", "content": "Weather in Paris?"}], [WEATHER, BOOK]),
    "tool_call_and_result": ([
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [call("abcdefgh1", "get_weather", {"city": "Paris"})]},
        {"role": "tool", "tool_call_id": "abcdefgh1", "content": '{"temp": 21}'},
        {"role": "assistant", "content": "It is 21C."},
        {"role": "user", "content": "Thanks"}], [WEATHER]),
    "parallel_tool_calls": ([
        {"role": "user", "content": "Paris and Oslo?"},
        {"role": "assistant", "content": None, "tool_calls": [call("abcdefgh1", "get_weather", {"city": "Paris"}),
                                                              call("abcdefgh2", "get_weather", {"city": "Oslo"})]},
        {"role": "tool", "tool_call_id": "abcdefgh1", "content": "21C"},
        {"role": "tool", "tool_call_id": "abcdefgh2", "content": "4C"}], [WEATHER]),
    "reasoning_in_earlier_turns": ([
        {"role": "user", "content": "2+2?"},
        {"role": "assistant", "content": "4", "reasoning_content": "Two and two make four."},
        {"role": "user", "content": "And 3+3?"}], None),
}


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    return tmp_path_factory.mktemp("families")


def _format(name: str, workdir) -> ChatFormat:
    return ChatFormat.build(AutoTokenizer.from_pretrained(tokenizer_dir(name, workdir)))


@pytest.mark.unit
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("conversation", list(CONVERSATIONS))
def test_render_parity_with_the_models_own_template(family, conversation, workdir):
    """No sampled turns: the server's prompt ids are exactly apply_chat_template's, and a
    conversation the template itself refuses (Gemma has no tool role) is refused, not guessed at."""
    chat = _format(family, workdir)
    tok = chat.template.tokenizer
    messages, tools = copy.deepcopy(CONVERSATIONS[conversation])
    try:
        want = tok.apply_chat_template([template_message(m) for m in messages], tools=tools,
                                       add_generation_prompt=True)["input_ids"]
    except Exception as refused:  # the template's own raise_exception
        with pytest.raises(TemplateError):
            chat.renderer.render(messages, tools)
        pytest.skip(f"{family}'s template refuses this conversation: {str(refused)[:80]}")
    assert chat.renderer.render(messages, tools).ids == want
    assert messages == CONVERSATIONS[conversation][0]  # rendering never mutates the caller's messages


@pytest.mark.unit
@pytest.mark.parametrize("family", list(FAMILIES))
def test_whether_a_template_shows_tools_is_known_before_serving(family, workdir):
    """SmolLM2's and Gemma 3's templates never read `tools`: a request's tools would silently not
    reach the model, so the server must know before it serves one."""
    assert _format(family, workdir).template.renders_tools == (family not in ("smollm2", "gemma3"))


@pytest.mark.unit
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_sampled_turn_is_spliced_by_id(family, workdir):
    """An assistant turn the server sampled comes back as its exact ids (which need not be how
    its text would tokenize), closed by the template's own end of turn."""
    chat = _format(family, workdir)
    tok = chat.template.tokenizer
    first = [{"role": "user", "content": "Where?"}]
    text = "Paris is nice."
    messages = first + [{"role": "assistant", "content": text}, {"role": "user", "content": "Why?"}]
    # How the template ends a turn; GLM's closes none: the model stops on the next message's role tag.
    after = chat.template.format.turn_end or chat.template.render(messages, None, False).split(text, 1)[1]
    end = tok.encode(after, add_special_tokens=False)[0]
    assert end in chat.stop_ids
    by_char = [i for ch in text for i in tok.encode(ch, add_special_tokens=False)]
    assert by_char != tok.encode(text, add_special_tokens=False)  # the same text, other ids
    sampled = tuple(by_char + [end])
    prompt = chat.renderer.render(first).ids
    rendered = chat.renderer.render(messages, sampled_ids={1: sampled})
    if family == "gpt_oss":
        # Harmony closes an answer with <|return|> when sampling and with <|end|> in history: the
        # template rewrites every earlier turn, and the prompt follows it.
        assert rendered.rewritten_turns == 1 and "Paris is nice." in tok.decode(rendered.ids)
        return
    assert rendered.spliced_turns == 1 and rendered.rewritten_turns == 0
    if rendered.ids[: len(prompt)] != prompt:
        # The history leaves out the generation prompt's end: Qwen3.5's answered turns lose the
        # `<think>` it opens. The sampled ids stand where the template puts the turn's text, and the
        # next prompt does not extend the one they were sampled after (a step trains them apart).
        assert tok.decode(rendered.ids) == chat.template.render(messages, None, True)
        assert any(rendered.ids[i:i + len(sampled)] == list(sampled) for i in range(len(rendered.ids)))
        return
    assert rendered.ids[: len(prompt) + len(sampled)] == prompt + list(sampled)


@pytest.mark.unit
@pytest.mark.parametrize("family", list(FAMILIES))
def test_a_sampled_tool_call_followed_by_its_result_renders(family, workdir):
    """A template may refuse the probe that locates a turn (gpt-oss wants a tool result to follow
    a message with tool calls): the prompt is then the template's own text, the turn counted as
    rewritten, never an error."""
    chat = _format(family, workdir)
    calls = [call("abcdefgh1", "get_weather", {"city": "Paris"})]
    messages = [{"role": "user", "content": "Weather in Paris?"},
                {"role": "assistant", "content": None, "tool_calls": calls},
                {"role": "tool", "tool_call_id": "abcdefgh1", "content": "21C"}]
    try:
        chat.renderer.render(messages, [WEATHER])
    except TemplateError as e:
        pytest.skip(f"{family}'s template refuses this conversation: {e}")
    sampled = tuple(chat.renderer.encode("get_weather Paris"))
    rendered = chat.renderer.render(messages, [WEATHER], sampled_ids={1: sampled})
    assert rendered.spliced_turns + rendered.rewritten_turns == 1
    assert "21C" in chat.template.tokenizer.decode(rendered.ids)


@pytest.mark.unit
@pytest.mark.parametrize("family", [f for f in FAMILIES if f not in ("smollm2", "gemma3")])  # no tools shown
def test_a_sampled_call_with_its_reasoning_is_spliced_inside_a_tool_loop(family, workdir):
    """A turn sampled as the model writes it (its reasoning, then a call in its own format, by other
    ids than its text would tokenize to) is parsed, and the tool loop's next prompt holds its exact
    ids right after the prompt it was sampled from: where the template writes a think block after
    the generation prompt (Qwen3.5 closes the one its prompt opens, GLM writes one), that is model
    text, not template text; where it writes the call's result inside the same turn (Gemma 4) or
    will not render a turn of text before a result (gpt-oss), the turn is found by rendering the
    conversation up to it."""
    chat = family_format(family, workdir)
    tok = chat.template.tokenizer
    first = [{"role": "user", "content": "Weather in Paris?"}]
    turn = {"role": "assistant", "content": None, "reasoning_content": "Look it up.",
            "tool_calls": [call("abcdefgh1", "get_weather", {"city": "Paris"})]}
    loop = first + [turn, {"role": "tool", "tool_call_id": "abcdefgh1", "content": "21C"}]
    prompt = chat.renderer.render(first, [WEATHER]).ids
    *said, stop = written_turn(chat, first, loop, [WEATHER])
    sampled = tuple(i for ch in chat.text(said) for i in tok.encode(ch, add_special_tokens=False)) + (stop,)
    parsed = chat.parse(chat.text(sampled), {"get_weather": WEATHER["function"]["parameters"]})
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [("get_weather", {"city": "Paris"})]
    echoed = {**turn, "content": parsed.content, "reasoning_content": parsed.reasoning,
              "tool_calls": [c.to_openai() for c in parsed.tool_calls]}
    rendered = chat.renderer.render([*first, echoed, loop[2]], [WEATHER], sampled_ids={1: sampled})
    assert rendered.spliced_turns == 1 and rendered.ids[: len(prompt) + len(sampled)] == prompt + list(sampled)


@pytest.mark.unit
def test_qwen3_drops_earlier_reasoning_and_the_prompt_follows(workdir):
    """Qwen3's template shows the reasoning of turns after the last user message only. A sampled
    turn with reasoning keeps its ids inside a tool loop, and is rewritten as the template says
    once a new user message follows it."""
    chat = _format("qwen3", workdir)
    tok = chat.template.tokenizer
    said = "<think>\nLook it up.\n</think>\n\n"
    call_text = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    sampled = tuple(tok.encode(said + call_text, add_special_tokens=False) + [tok.convert_tokens_to_ids("<|im_end|>")])
    turn = {"role": "assistant", "content": None, "reasoning_content": "Look it up.",
            "tool_calls": [call("c1", "get_weather", {"city": "Paris"})]}
    first = [{"role": "user", "content": "Weather?"}]
    prompt = chat.renderer.render(first, [WEATHER]).ids
    in_loop = first + [turn, {"role": "tool", "tool_call_id": "c1", "content": "21C"}]
    kept = chat.renderer.render(in_loop, [WEATHER], sampled_ids={1: sampled})
    assert kept.spliced_turns == 1 and kept.ids[: len(prompt) + len(sampled)] == prompt + list(sampled)
    later = in_loop + [{"role": "assistant", "content": "21C."}, {"role": "user", "content": "And Oslo?"}]
    rewritten = chat.renderer.render(later, [WEATHER], sampled_ids={1: sampled})
    assert rewritten.rewritten_turns == 1 and rewritten.spliced_turns == 0
    assert "Look it up." not in tok.decode(rewritten.ids)
    want = tok.apply_chat_template([template_message(m) for m in later], tools=[WEATHER],
                                   add_generation_prompt=True)["input_ids"]
    assert rewritten.ids == want  # exactly what the template itself gives


# ---- served end to end, on tiny random models ---------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_servers(workdir):
    servers: dict[tuple, ServerProcess] = {}

    def serve(name: str, *extra: str) -> ServerProcess:
        if (name, extra) not in servers:
            servers[(name, extra)] = ServerProcess(workdir / f"data-{name}-{len(servers)}",
                                                   model=tiny_model_dir(name, workdir), extra=list(extra)).start()
        return servers[(name, extra)]

    yield serve
    for s in servers.values():
        s.stop()


NO_THINKING = ("--chat-template-kwargs", '{"enable_thinking": false}')


@pytest.mark.parametrize("family,extra", [("qwen2_5", ()), ("qwen3", ()), ("llama3_1", ()), ("mistral_v0_3", ()),
                                          ("qwen3_5", ()), ("qwen3_5", NO_THINKING), ("glm4_5", ()),
                                          ("gemma4", ()), ("lfm2_5", ())])
async def test_a_forced_tool_call_round_trips_and_trains(family, extra, tiny_servers):
    """tool_choice "required" makes even a random model call a tool in its family's format (JSON,
    Qwen3.5's and GLM's tags around each argument, Gemma 4's literals, LFM2.5's Python); the call
    parses, its result goes back, the next prompt holds the call's exact ids, and a step on those
    trajectories trains token-exactly."""
    srv = tiny_servers(family, *extra)

    model = await TrainableModel(f"{family}-tools").register(srv.url)
    async with model.openai_client(max_retries=0, timeout=300) as client:
        async def rollout(seed: int) -> Trajectory:
            messages = [{"role": "user", "content": "Weather in Paris?"}]
            first = await client.chat.completions.create(model=model.name, messages=messages, tools=[WEATHER],
                                                         tool_choice="required", parallel_tool_calls=False,
                                                         max_tokens=250, seed=seed)
            choice = first.choices[0]
            assert choice.finish_reason == "tool_calls", choice
            [tc] = choice.message.tool_calls[:1]
            assert tc.function.name == "get_weather" and "city" in json.loads(tc.function.arguments)
            traj = Trajectory(messages_and_choices=[*messages, choice], tools=[WEATHER])
            for extra_call in choice.message.tool_calls:
                traj.messages_and_choices.append({"role": "tool", "tool_call_id": extra_call.id, "content": "21C"})
            second = await client.chat.completions.create(model=model.name, messages=traj.messages(),
                                                          tools=[WEATHER], max_tokens=8, seed=seed)
            again = second.model_extra["prompt_token_ids"]
            prompt, ids = first.model_extra["prompt_token_ids"], choice.model_extra["token_ids"]
            assert again[: len(prompt) + len(ids)] == prompt + ids
            traj.messages_and_choices.append(second.choices[0])
            traj.reward = float(seed)
            return traj

        trajs = await asyncio.gather(*[rollout(s) for s in range(3)])
    result = await model.train([TrajectoryGroup(trajectories=list(trajs))], TrainConfig(learning_rate=1e-3))
    m = result.metrics
    assert result.trained and m.prompt_mismatches == 0 and m.trained_choices == m.choices == 6
    assert m.logprob_gap <= 1e-3


def test_named_tool_choice_and_json_response_format(tiny_servers):
    srv = tiny_servers("qwen2_5")
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=300) as client:
        resp = client.chat.completions.create(
            model="qwen2_5", messages=[{"role": "user", "content": "Book a table."}], tools=[WEATHER, BOOK],
            tool_choice={"type": "function", "function": {"name": "book"}}, parallel_tool_calls=False,
            max_tokens=250, seed=1)
        assert [c.function.name for c in resp.choices[0].message.tool_calls] == ["book"]
        schema = {"type": "object", "properties": {"score": {"type": "integer", "maximum": 9}}, "required": ["score"],
                  "additionalProperties": False}
        resp = client.chat.completions.create(
            model="qwen2_5", messages=[{"role": "user", "content": "Score it."}], max_tokens=40, seed=2,
            response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": schema}})
        assert set(json.loads(resp.choices[0].message.content)) == {"score"}


def test_reasoning_effort_reaches_the_template_that_reads_it(tiny_servers):
    """gpt-oss's template writes `Reasoning: <effort>` in its system message; vLLM hands
    `reasoning_effort` to the template, and so does art-server (chat_template_kwargs wins)."""
    srv = tiny_servers("gpt_oss")
    tok = AutoTokenizer.from_pretrained(srv.model)
    with openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0, timeout=300) as client:
        def prompt(**extra) -> str:
            reply = client.chat.completions.create(model="gpt_oss", max_tokens=1, messages=[
                {"role": "user", "content": "Hi"}], **extra)
            return tok.decode(reply.model_extra["prompt_token_ids"])

        assert "Reasoning: medium" in prompt()  # the template's default
        assert "Reasoning: high" in prompt(reasoning_effort="high")
        assert "Reasoning: low" in prompt(reasoning_effort="high", extra_body={
            "chat_template_kwargs": {"reasoning_effort": "low"}})
        with pytest.raises(openai.BadRequestError):
            prompt(reasoning_effort="extreme")


async def test_qwen3_turns_that_do_not_extend_get_their_own_sequences(tiny_servers):
    """With thinking off, Qwen3's generation prompt holds an empty think block that its history
    does not: after a new user message the next prompt does not extend the last one. Both turns
    train, each in its own sequence, and the step says how many such turns it saw."""
    srv = tiny_servers("qwen3", "--chat-template-kwargs", '{"enable_thinking": false}')

    model = await TrainableModel("qwen3-turns").register(srv.url)
    async with model.openai_client(max_retries=0, timeout=300) as client:
        async def rollout(seed: int) -> Trajectory:
            traj = Trajectory(messages_and_choices=[{"role": "user", "content": "Hi"}])
            for question in ("First?", "Second?"):
                resp = await client.chat.completions.create(model=model.name, messages=traj.messages(),
                                                            max_tokens=6, seed=seed)
                traj.messages_and_choices += [resp.choices[0], {"role": "user", "content": question}]
            traj.messages_and_choices.pop()
            traj.reward = float(seed)
            return traj

        trajs = await asyncio.gather(*[rollout(s) for s in range(3)])
    result = await model.train([TrajectoryGroup(trajectories=list(trajs))], TrainConfig(learning_rate=1e-3))
    m = result.metrics
    assert result.trained and m.prompt_mismatches == 0 and m.trained_choices == 6
    assert m.non_extending_turns == 3 and m.sequences == 6
