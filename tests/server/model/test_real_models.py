"""Real chat models, served and trained in their own formats: SmolLM2-135M-Instruct (Llama
architecture, ChatML with a default system prompt) from its GGUF, and Gemma 3 270M (a base model)
from its GGUF with Gemma 3's instruction template given by `--chat-template`.

For each, against a real art-server through the `openai` SDK: prompts are exactly what the
model's own template gives, a sampled turn comes back token for token in the next prompt,
returned logprobs are a full forward pass's, and an RL step trains on-policy. Neither template
shows tools: a request with tools is refused unless a template that does is given. Gemma 3 also
under the plain-text template a base model can follow, ending its answers at `--stop-token`.
"""

from __future__ import annotations

import asyncio
import re

import httpx
import openai
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from client import TrainConfig, TrainableModel, Trajectory, TrajectoryGroup
from conftest import ServerProcess
from examples import reasoning_gym
from tests.helpers import completion_logprobs
from tests.real_models import CACHE, TEMPLATES, converted, gemma3_gguf, smollm2_gguf

WEATHER = {"type": "function", "function": {"name": "get_weather", "description": "Weather in a city.",
                                            "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}


class Served:
    """A real model behind a real server, and the same weights in-process for reference."""

    def __init__(self, tmp_path_factory, name: str, gguf, template=None):
        self.dir = converted(gguf)
        extra = ["--cache-dir", str(CACHE), "--served-model-name", name]
        if template is not None:
            extra += ["--chat-template", str(template)]
        self.server = ServerProcess(tmp_path_factory.mktemp(name), model=gguf, extra=extra).start(timeout=600)
        self.name = name
        self.tokenizer = AutoTokenizer.from_pretrained(self.dir)
        self.template = template.read_text() if template is not None else None
        self.model = AutoModelForCausalLM.from_pretrained(self.dir, dtype=torch.float32).eval()
        self.client = openai.OpenAI(base_url=self.server.url + "/v1", api_key="x", max_retries=0, timeout=300)

    def template_ids(self, messages, tools=None) -> list[int]:
        return self.tokenizer.apply_chat_template(messages, tools=tools, add_generation_prompt=True,
                                                  chat_template=self.template)["input_ids"]

    def close(self) -> None:
        self.client.close()
        self.server.stop()


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    served = Served(tmp_path_factory, "smollm2", smollm2_gguf())
    yield served
    served.close()


@pytest.fixture(scope="module")
def gemma3(tmp_path_factory):
    served = Served(tmp_path_factory, "gemma3", gemma3_gguf(), TEMPLATES / "gemma3.jinja")
    yield served
    served.close()


@pytest.fixture(params=["smollm2", "gemma3"])
def served(request):
    return request.getfixturevalue(request.param)


def extra(obj, name: str):
    value = (obj.model_extra or {}).get(name)
    assert value is not None, f"{type(obj).__name__} has no {name!r}"
    return value


CONVERSATIONS = {
    "one_user_turn": ([{"role": "user", "content": "Hello there!"}], None),
    "system_prompt": ([{"role": "system", "content": "You answer in one word."},
                       {"role": "user", "content": "Colour of the sky?"}], None),
    "earlier_turns": ([{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! How can I help?"},
                       {"role": "user", "content": "Name a fruit, «s'il vous plaît» {{ not jinja }}."}], None),
}


@pytest.mark.parametrize("name", list(CONVERSATIONS))
def test_prompt_is_the_models_own_template(served, name):
    messages, tools = CONVERSATIONS[name]
    resp = served.client.chat.completions.create(model=served.name, messages=messages, tools=tools, max_tokens=1,
                                                 temperature=0)
    assert extra(resp, "prompt_token_ids") == served.template_ids(messages, tools)


TOOLS_REQUEST = {"messages": [{"role": "user", "content": "Weather in Paris?"}], "tools": [WEATHER], "max_tokens": 1}
NO_TOOLS_LINE = "chat template does not render tools"


def test_tools_the_template_cannot_show_are_refused(served):
    """SmolLM2's own template and Gemma 3's never read `tools`: served as they are, the tools would
    silently never reach the model, and an agent trained on it could not learn to call them."""
    with pytest.raises(openai.BadRequestError) as e:
        served.client.chat.completions.create(model=served.name, **TOOLS_REQUEST)
    err = e.value.body
    assert err["param"] == "tools" and err["code"] == "tools_not_rendered"
    assert len(err["message"].splitlines()) == 1
    assert f"model {served.name}:" in err["message"] and "--chat-template FILE" in err["message"]
    assert "--allow-unrendered-tools" in err["message"]
    log = served.server.log_path.read_text()
    assert log.count(NO_TOOLS_LINE) == 1 and "requests with tools get a 400" in log  # said once, at start-up
    resp = served.client.chat.completions.create(model=served.name, messages=TOOLS_REQUEST["messages"], max_tokens=1)
    assert extra(resp.choices[0], "token_ids")


def _smollm2_server(tmp_path, *extra: str) -> ServerProcess:
    """SmolLM2 from its GGUF under no --served-model-name, logging its start-up."""
    converted(smollm2_gguf())
    return ServerProcess(tmp_path, model=smollm2_gguf(), extra=["--cache-dir", str(CACHE), "--log-level", "info",
                                                                *extra]).start(timeout=600)


SMOLLM2_NAME = "SmolLM2-135M-Instruct.Q4_1"  # the GGUF file's stem


def test_a_tool_rendering_template_serves_tools_under_a_readable_name(tmp_path):
    """Given a template that shows tools (Qwen2.5's ChatML, whose special tokens SmolLM2 shares),
    the tools are in the prompt; and a GGUF is served under its file's name, not the content
    hash its cache is keyed by, which the start-up log states."""
    template = TEMPLATES / "qwen2_5.jinja"
    server = _smollm2_server(tmp_path, "--chat-template", str(template))
    try:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300) as client:
            assert [m.id for m in client.models.list().data] == [SMOLLM2_NAME]
            resp = client.chat.completions.create(model=SMOLLM2_NAME, **TOOLS_REQUEST)
        tokenizer = AutoTokenizer.from_pretrained(converted(smollm2_gguf()))
        prompt = extra(resp, "prompt_token_ids")
        assert "get_weather" in tokenizer.decode(prompt)
        assert prompt == tokenizer.apply_chat_template(TOOLS_REQUEST["messages"], tools=[WEATHER],
                                                       add_generation_prompt=True, chat_template=template.read_text()
                                                       )["input_ids"]
        log = server.log_path.read_text()
        assert re.search(rf"serving {re.escape(SMOLLM2_NAME)} .*served names: {re.escape(SMOLLM2_NAME)}", log), log
        assert NO_TOOLS_LINE not in log
    finally:
        server.stop()


def test_allow_unrendered_tools_serves_them_unseen(tmp_path):
    server = _smollm2_server(tmp_path, "--allow-unrendered-tools")
    try:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300) as client:
            resp = client.chat.completions.create(model=SMOLLM2_NAME, **TOOLS_REQUEST)
            client.chat.completions.create(model=SMOLLM2_NAME, **TOOLS_REQUEST)
        tokenizer = AutoTokenizer.from_pretrained(converted(smollm2_gguf()))
        assert "get_weather" not in tokenizer.decode(extra(resp, "prompt_token_ids"))
        log = server.log_path.read_text()
        assert log.count(NO_TOOLS_LINE) == 1 and "--allow-unrendered-tools" in log  # once, at start-up
    finally:
        server.stop()


def test_smollm2_sees_its_default_system_prompt(smollm2):
    text = smollm2.tokenizer.decode(extra(smollm2.client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "Hi"}], max_tokens=1), "prompt_token_ids"))
    assert "You are a helpful AI assistant named SmolLM, trained by Hugging Face" in text


def test_a_sampled_turn_reappears_token_for_token(served):
    messages = [{"role": "user", "content": "Write one short sentence about cats."}]
    first = served.client.chat.completions.create(model=served.name, messages=messages, max_tokens=12, seed=3)
    prompt, sampled = extra(first, "prompt_token_ids"), extra(first.choices[0], "token_ids")
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "And dogs?"}]
    second = served.client.chat.completions.create(model=served.name, messages=messages, max_tokens=1)
    again = extra(second, "prompt_token_ids")
    assert again[: len(prompt) + len(sampled)] == prompt + sampled


LONG = " ".join(f"Item {i} costs {i * 7 % 100} dollars and is {'red' if i % 3 else 'blue'}." for i in range(90))


def test_logprobs_are_a_full_forward_pass(served):
    """Also past Gemma 3's 512-token sliding window, where its local layers see only recent keys."""
    for messages, temperature in (([{"role": "user", "content": "Tell me about the moon."}], 1.0),
                                  ([{"role": "user", "content": "Tell me about the moon."}], 0.7),
                                  ([{"role": "user", "content": LONG + " Which item is cheapest?"}], 1.0)):
        resp = served.client.chat.completions.create(model=served.name, messages=messages, max_tokens=10, n=2,
                                                     temperature=temperature, seed=5)
        assert len(extra(resp, "prompt_token_ids")) > 600 or messages[0]["content"] != LONG + " Which item is cheapest?"
        for choice in resp.choices:
            ids = extra(choice, "token_ids")
            want = completion_logprobs(served.model, extra(resp, "prompt_token_ids"), ids, temperature)
            got = torch.tensor([e.logprob for e in choice.logprobs.content])
            assert (got - want).abs().max().item() <= 1e-4


def test_the_teacher_route_scores_given_tokens_as_a_full_forward_pass(served):
    """POST /v1/logprobs (on-policy distillation's teacher): every scored token's logprob, its
    top 5 and the mass left outside them, against the same weights run here."""
    resp = served.client.chat.completions.create(model=served.name, messages=[{"role": "user", "content": "Hi!"}],
                                                 max_tokens=12, temperature=1.0, seed=9)
    prompt, ids = extra(resp, "prompt_token_ids"), extra(resp.choices[0], "token_ids")
    r = httpx.post(served.server.url + "/v1/logprobs", timeout=120, json={
        "model": served.name, "top_k": 5, "sequences": [{"token_ids": prompt + ids, "start": len(prompt)}]})
    assert r.status_code == 200, r.text
    got = r.json()["data"][0]
    with torch.no_grad():
        logits = served.model(torch.tensor([prompt + ids])).logits[0, len(prompt) - 1:-1].float()
    full = torch.log_softmax(logits, dim=-1)
    want = full.gather(-1, torch.tensor(ids)[:, None]).squeeze(-1)
    assert (torch.tensor(got["logprobs"]) - want).abs().max().item() <= 1e-4
    top_values, top_ids = full.topk(5, dim=-1)
    assert [[t for t, _ in row] for row in got["top"]] == top_ids.tolist()
    assert (torch.tensor([[v for _, v in row] for row in got["top"]]) - top_values).abs().max().item() <= 1e-4
    rest = torch.logsumexp(full.scatter(1, top_ids, float("-inf")), dim=-1)
    assert (torch.tensor(got["rest"]) - rest).abs().max().item() <= 1e-4


def test_a_turn_after_a_long_prompt_reuses_its_prefix_and_samples_as_a_full_prefill_would(served):
    """The next turn of a conversation prefills only its new tokens: the first turn's prompt and
    reply come from the engine's prefix cache."""
    client = served.client
    messages = [{"role": "user", "content": LONG + " Which item is the cheapest?"}]
    first = client.chat.completions.create(model=served.name, messages=messages, max_tokens=6, seed=1)
    before = httpx.get(served.server.url + "/health").json()["prefix_cache"]
    messages += [first.choices[0].message.model_dump(exclude_none=True),
                 {"role": "user", "content": "And which is the dearest?"}]
    second = client.chat.completions.create(model=served.name, messages=messages, max_tokens=10, seed=2)
    after = httpx.get(served.server.url + "/health").json()["prefix_cache"]
    prompt = extra(second, "prompt_token_ids")
    assert after["hits"] == before["hits"] + 1
    reply = extra(first.choices[0], "token_ids")  # all but its last token were forwarded, and kept
    assert len(extra(first, "prompt_token_ids")) > 600
    assert after["tokens_reused"] - before["tokens_reused"] >= len(extra(first, "prompt_token_ids")) + len(reply) - 1
    ids = extra(second.choices[0], "token_ids")
    want = completion_logprobs(served.model, prompt, ids, 1.0)
    got = torch.tensor([e.logprob for e in second.choices[0].logprobs.content])
    assert (got - want).abs().max().item() <= 1e-4


async def test_one_rl_step_trains_on_policy(served):
    model = await TrainableModel(f"{served.name}-rl").register(served.server.url)
    async with model.openai_client(max_retries=0, timeout=300) as client:
        async def rollout(seed: int) -> Trajectory:
            messages = [{"role": "user", "content": "Say a word."}]
            resp = await client.chat.completions.create(model=model.name, messages=messages, max_tokens=6, seed=seed)
            traj = Trajectory(messages_and_choices=[*messages, resp.choices[0],
                                                    {"role": "user", "content": "Another."}])
            resp = await client.chat.completions.create(model=model.name, messages=traj.messages(), max_tokens=6,
                                                        seed=seed + 100)
            traj.messages_and_choices.append(resp.choices[0])
            traj.reward = float(seed)  # any spread will do: this checks the mechanics, not learning
            return traj

        trajs = await asyncio.gather(*[rollout(s) for s in range(4)])
    groups = [TrajectoryGroup(trajectories=list(trajs))]
    result = await model.train(groups, TrainConfig(learning_rate=1e-4))
    m = result.metrics
    assert result.trained, result.warnings
    assert m.prompt_mismatches == 0 and m.trained_choices == m.choices == 8
    assert m.logprob_gap is not None and m.logprob_gap <= 1e-3
    assert m.lora_update_norm > 0


def test_smollm2_knows_the_capital_of_france(smollm2):
    resp = smollm2.client.chat.completions.create(
        model="smollm2", messages=[{"role": "user", "content": "What is the capital of France?"}],
        max_tokens=24, temperature=0)
    assert "Paris" in resp.choices[0].message.content


def test_a_base_model_under_plain_text_shots_ends_its_answer_at_the_stop_token(tmp_path):
    """Gemma 3 270M under examples/reasoning_gym's BASE_MODEL_TEMPLATE with `--stop-token '\\n'` (as a
    shell passes it): it answers a few-shot question on one line and stops at the newline, which the
    reply's text drops, and the answer comes back token for token in the next prompt."""
    model_dir = converted(gemma3_gguf())
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    [newline] = tokenizer.encode("\n", add_special_tokens=False)
    server = ServerProcess(tmp_path, model=gemma3_gguf(), extra=[
        "--cache-dir", str(CACHE), "--served-model-name", "gemma3-base",
        "--chat-template", str(reasoning_gym.BASE_MODEL_TEMPLATE), "--stop-token", "\\n"]).start(timeout=600)
    try:
        with openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300) as client:
            row = reasoning_gym.rows("basic_arithmetic", 1, reasoning_gym.EVAL_SEED)[0]
            messages = reasoning_gym.messages(row, "fewshot_drawn")
            first = client.chat.completions.create(model="gemma3-base", messages=messages, max_tokens=16,
                                                   temperature=0)
            choice, prompt = first.choices[0], extra(first, "prompt_token_ids")
            assert prompt == tokenizer.apply_chat_template(messages, add_generation_prompt=True, chat_template=(
                reasoning_gym.BASE_MODEL_TEMPLATE.read_text()))["input_ids"]
            sampled = extra(choice, "token_ids")
            assert choice.finish_reason == "stop" and sampled[-1] == newline and len(sampled) < 16
            assert choice.message.content.strip() and "\n" not in choice.message.content
            messages += [choice.message.model_dump(exclude_none=True), {"role": "user", "content": "What is 2 + 2?"}]
            again = client.chat.completions.create(model="gemma3-base", messages=messages, max_tokens=1)
            assert extra(again, "prompt_token_ids")[: len(prompt) + len(sampled)] == prompt + sampled
    finally:
        server.stop()
