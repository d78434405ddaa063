"""`POST /inference/v1/generate`, the token-in route verifiers' train client calls, on the embedded
model over loopback HTTP: its answer as `renderers.client.generate` (0.1.12) validates it, the same
tokens and logprobs as a chat completion of the same prompt ids and seed, choices that train (and a
prompt rendered otherwise that is counted, not trained), and one-line 400s naming the field.
"""

from __future__ import annotations

import math

import httpx
import pytest
from openai.types.chat.chat_completion import Choice
from transformers import AutoTokenizer

from client import TrainConfig, TrainableModel
from conftest import ROOT
from protocol.trajectory import Trajectory, TrajectoryGroup

MODEL = "artisan-tiny"
MESSAGES = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "Name a fruit."}]
WINDOW = 2048  # the embedded model's max_position_embeddings
KEY = "generate-key"


@pytest.fixture(scope="module")
def tok():
    return AutoTokenizer.from_pretrained(ROOT / "server" / "embedded" / "model")


@pytest.fixture(scope="module")
def im_end(tok) -> int:
    return tok.convert_tokens_to_ids("<|im_end|>")


def generate(url: str, body: dict, key: str | None = None) -> httpx.Response:
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    return httpx.post(url + "/inference/v1/generate", json=body, headers=headers, timeout=120)


def chat(url: str, **kw) -> dict:
    resp = httpx.post(url + "/v1/chat/completions", json={"model": MODEL, "messages": MESSAGES, **kw}, timeout=120)
    assert resp.status_code == 200, resp.text
    return resp.json()


def renderers_view(data: dict) -> tuple[list[int], list[float], str]:
    """What renderers.client.generate takes from a response, refused as strictly as it refuses it
    (client.py, `_parse_completion_logprobs`): one logprob per completion id, named `token_id:<id>`,
    finite, never vLLM's -9999.0 placeholder."""
    assert isinstance(data["request_id"], str) and data["request_id"]
    [choice] = data["choices"]
    assert choice["index"] == 0 and choice["finish_reason"] in ("stop", "length")
    ids = choice["token_ids"]
    content = choice["logprobs"]["content"]
    assert isinstance(content, list) and len(content) == len(ids) > 0
    lps = []
    for t, entry in zip(ids, content):
        assert entry["token"] == f"token_id:{t}"
        lp = entry["logprob"]
        assert isinstance(lp, float) and math.isfinite(lp) and lp != -9999.0
        lps.append(lp)
    return ids, lps, choice["finish_reason"]


def test_same_prompt_ids_and_seed_sample_what_chat_samples(server, im_end):
    ref = chat(server.url, max_tokens=12, seed=5, temperature=1.0)
    [ref_choice] = ref["choices"]
    prompt = ref["prompt_token_ids"]
    body = {"model": MODEL, "token_ids": prompt, "cache_salt": "rollout-1", "priority": 0,
            "sampling_params": {"temperature": 1.0, "max_tokens": 12, "seed": 5, "stop_token_ids": [im_end],
                                "logprobs": 1, "skip_special_tokens": False, "top_k": -1,
                                "routed_experts_prompt_start": 0}}  # keys vLLM reads and art-server ignores
    resp = generate(server.url, body)
    assert resp.status_code == 200, resp.text
    data = resp.json()
    ids, lps, finish = renderers_view(data)
    assert ids == ref_choice["token_ids"] and finish == ref_choice["finish_reason"]
    assert lps == pytest.approx([e["logprob"] for e in ref_choice["logprobs"]["content"]], abs=1e-5)
    assert data["prompt_token_ids"] == prompt  # echoed exactly, as renderers takes it when present
    # The sampling record is the chat choice's: same prompt fingerprint, policy, temperature.
    assert data["choices"][0]["sampling"] == ref_choice["sampling"]
    assert data["usage"] == {"prompt_tokens": len(prompt), "completion_tokens": len(ids),
                             "total_tokens": len(prompt) + len(ids)}


def test_without_max_tokens_it_samples_what_the_window_leaves(server):
    resp = generate(server.url, {"model": MODEL, "token_ids": [42] * (WINDOW - 2),
                                 "sampling_params": {"ignore_eos": True}})
    assert resp.status_code == 200, resp.text
    ids, _, finish = renderers_view(resp.json())
    assert len(ids) == 2 and finish == "length"


def _from_generate(data: dict) -> Choice:
    """A trajectory's Choice from a generate answer, as a client that decodes the ids itself builds it."""
    c = data["choices"][0]
    return Choice.model_validate({
        "index": 0, "finish_reason": c["finish_reason"], "message": {"role": "assistant", "content": "a fruit"},
        "token_ids": c["token_ids"], "sampling": c["sampling"],
        "logprobs": {"content": [{**e, "bytes": None, "top_logprobs": []} for e in c["logprobs"]["content"]]}})


async def test_its_choices_train_and_a_prompt_rendered_otherwise_is_counted_not_trained(server):
    model = await TrainableModel("token-in").register(server.url)
    prompt = chat(server.url, max_tokens=1)["prompt_token_ids"]  # the ids art-server renders MESSAGES to
    trajectories = []
    # The last prompt lacks its first token: a client that rendered the conversation otherwise.
    for seed, ids, reward in ((1, prompt, 0.0), (2, prompt, 1.0), (3, prompt[1:], 0.5)):
        resp = generate(server.url, {"model": model.name, "token_ids": ids,
                                     "sampling_params": {"max_tokens": 8, "seed": seed}})
        assert resp.status_code == 200, resp.text
        trajectories.append(Trajectory(messages_and_choices=[*MESSAGES, _from_generate(resp.json())], reward=reward))
    result = await model.train([TrajectoryGroup(trajectories=trajectories)], TrainConfig(learning_rate=1e-4))
    m = result.metrics
    assert result.trained, result.warnings
    assert m.choices == 3 and m.trained_choices == 2 and m.prompt_mismatches == 1
    assert m.logprob_gap is not None and m.logprob_gap <= 1e-3


@pytest.mark.parametrize("change, param", [
    ({"token_ids": [10**9]}, "token_ids"),
    ({"token_ids": [-1]}, "token_ids[0]"),
    ({"token_ids": []}, "token_ids"),
    ({"token_ids": [42] * WINDOW}, "token_ids"),
    ({"content_parts": [{"type": "image_url", "image_url": {"url": "data:,"}}]}, "content_parts"),
    ({"features": {"mm_hashes": {}}}, "features"),
    ({"sampling_params": {"stop_token_ids": [42]}}, "sampling_params.stop_token_ids"),
    ({"sampling_params": {"top_k": 5}}, "sampling_params.top_k"),
    ({"sampling_params": {"repetition_penalty": 1.2}}, "sampling_params.repetition_penalty"),
    ({"sampling_params": {"n": 2}}, "sampling_params.n"),
    ({"sampling_params": {"temperature": 3}}, "sampling_params.temperature"),
    ({"sampling_params": {"stop": ["a", "b", "c", "d", "e"]}}, "sampling_params.stop"),
])
def test_bad_input_is_a_one_line_400_naming_the_field(server, change, param):
    body = {"model": MODEL, "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 2}}
    resp = generate(server.url, {**body, **change})
    assert resp.status_code == 400, resp.text
    error = resp.json()["error"]
    assert error["param"] == param and "\n" not in error["message"], error


def test_an_unknown_model_is_a_404(server):
    resp = generate(server.url, {"model": "nope", "token_ids": [1, 2, 3]})
    assert resp.status_code == 404 and resp.json()["error"]["param"] == "model"


def test_it_needs_the_api_key_like_every_route(fresh_server_module):
    srv = fresh_server_module(api_key=KEY)
    body = {"model": MODEL, "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 1}}
    for key in (None, "wrong"):
        assert generate(srv.url, body, key).status_code == 401
    assert generate(srv.url, body, KEY).status_code == 200
