"""Architectures no one tuned for are served and trained as their own forward computes them: the
layers a LoRA adapts, the logits a step scores sampled tokens with, and the keys and values (or the
linear-attention states) the engine caches are read from the model (server/model/architecture.py),
not from Llama's names. A model whose forward the trainer cannot follow serves, and creating a run on
it is a 400 that says why.
"""

from __future__ import annotations

import asyncio
from typing import Any, Callable

import httpx
import openai
import pytest
import torch
import transformers

from client import TrainableModel
from protocol.trajectory import Trajectory, TrajectoryGroup
from server.settings import Settings
from server.model.architecture import (ModelRefused, decoder, head_mismatch, kv_shape, lora_targets, output_logits,
                                       takes_tree_mask)
from tests.families import tiny_architecture_dir, tiny_gemma4_vlm_dir
from tests.helpers import completion_logprobs

GPT2 = {"n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 2048}
BLOOM = {"n_layer": 2, "n_head": 4}
DEEPSEEK_V3 = {"n_routed_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32, "kv_lora_rank": 16,
               "q_lora_rank": 16, "qk_rope_head_dim": 8, "qk_nope_head_dim": 8, "v_head_dim": 16,
               "first_k_dense_replace": 1, "n_group": 1, "topk_group": 1}
LLAMA4_TEXT = {"num_key_value_heads": 2, "num_local_experts": 4, "intermediate_size_mlp": 128, "head_dim": 16}
QWEN2_MOE = {"num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 32,
             "shared_expert_intermediate_size": 32}
# Layers that keep a state: Qwen3.5's and Qwen3-Next's gated delta rule, LFM2's short convolution,
# Nemotron-H's Mamba-2 mixer, each beside attention layers. Gemma 4's second layer reads the first's keys.
QWEN3_5 = {"layer_types": ["linear_attention", "full_attention"], "head_dim": 16, "linear_num_key_heads": 2,
           "linear_num_value_heads": 4, "linear_key_head_dim": 16, "linear_value_head_dim": 16}
STATEFUL = {"Qwen3_5TextConfig": QWEN3_5,
            "Qwen3NextConfig": {**QWEN3_5, "num_key_value_heads": 2, "num_experts": 4, "num_experts_per_tok": 2,
                                "moe_intermediate_size": 32, "shared_expert_intermediate_size": 32},
            "Lfm2Config": {"layer_types": ["conv", "full_attention"], "num_key_value_heads": 2},
            "NemotronHConfig": {"layers_block_type": ["linear_attention", "full_attention"], "num_key_value_heads": 2,
                                "head_dim": 16, "mamba_num_heads": 4, "mamba_head_dim": 16, "ssm_state_size": 16,
                                "n_groups": 2, "expand": 2}}
GEMMA4_SHARED = {"head_dim": 16, "global_head_dim": 16, "layer_types": ["full_attention", "full_attention"],
                 "num_kv_shared_layers": 1}
# Each scale far from neutral: a trainer that left it out would be told apart at once.
SCALED = {"CohereConfig": {"logit_scale": 0.25}, "GraniteConfig": {"logits_scaling": 4.0},
          "Gemma2Config": {"final_logit_softcapping": 0.5, "head_dim": 16, "query_pre_attn_scalar": 16,
                           "sliding_window": 16}}


def _model(architecture: str, root, **config):
    return transformers.AutoModelForCausalLM.from_pretrained(tiny_architecture_dir(architecture, root, **config)).eval()


@pytest.mark.unit
@pytest.mark.parametrize("architecture,config,targets", [
    ("GPT2Config", GPT2, ["c_attn", "c_fc", "c_proj"]),  # transformers' Conv1D, in blocks named transformer.h.N
    ("FalconConfig", {}, ["dense", "dense_4h_to_h", "dense_h_to_4h", "query_key_value"]),
    ("Qwen2MoeConfig", QWEN2_MOE, ["k_proj", "o_proj", "q_proj", "v_proj"]),  # router and experts take tokens flat
    # its first layer's dense MLP shares its names with the experts' fused parameters, which peft would wrap too
    ("DeepseekV3Config", DEEPSEEK_V3, ["kv_a_proj_with_mqa", "kv_b_proj", "o_proj", "q_a_proj", "q_b_proj"]),
])
def test_lora_adapts_the_layers_that_take_each_row_apart(architecture, config, targets, tmp_path_factory):
    model = _model(architecture, tmp_path_factory.mktemp(architecture), **config)
    assert lora_targets(model) == targets


@pytest.mark.unit
@pytest.mark.parametrize("architecture,config,shape,kinds", [
    ("GPT2Config", GPT2, (2, 4, 16, 4, 16), ()),  # no key-value heads in its config: as many as its heads
    ("FalconConfig", {}, (2, 1, 16, 1, 16), ()),  # multi-query: one for all
    ("Qwen2MoeConfig", QWEN2_MOE, (2, 2, 16, 2, 16), ()),
    ("DeepseekV3Config", DEEPSEEK_V3, (2, 1, 16, 1, 8), ()),  # latent attention: a latent and a rotary key
    ("Qwen3_5TextConfig", QWEN3_5, (1, 4, 16, 4, 16), ("state", "kv")),
    ("Lfm2Config", STATEFUL["Lfm2Config"], (1, 2, 16, 2, 16), ("state", "kv")),
    ("Gemma4TextConfig", GEMMA4_SHARED, (1, 4, 16, 4, 16), ("kv", "none")),  # keys read from the layer before
])
def test_the_engine_caches_what_each_layer_caches(architecture, config, shape, kinds, tmp_path_factory):
    cached = kv_shape(_model(architecture, tmp_path_factory.mktemp(architecture), **config))
    assert cached[:5] == shape and cached.kinds == kinds and (cached.state_bytes > 0) == ("state" in kinds)


@pytest.mark.unit
def test_a_layer_with_keys_and_a_state_is_refused_in_one_line(tmp_path_factory):
    """Falcon-H1 keeps a Mamba state and keys in the same layer, a DynamicLayer by its class: served
    from the engine's slabs it would lose the state and fail on its first request."""
    model = _model("FalconH1Config", tmp_path_factory.mktemp("h1"), num_key_value_heads=2, head_dim=16,
                   mamba_d_ssm=64, mamba_n_heads=4, mamba_d_head=16, mamba_n_groups=1, mamba_d_state=16)
    with pytest.raises(ModelRefused) as refused:
        kv_shape(model)
    assert "--engine vllm" in str(refused.value) and "\n" not in str(refused.value)


@pytest.mark.unit
@pytest.mark.parametrize("architecture,config,takes", [("LlamaConfig", {"num_key_value_heads": 2}, True),
                                                       ("GPT2Config", GPT2, True), ("BloomConfig", BLOOM, False)])
def test_only_a_model_that_honours_a_tree_mask_packs_a_shared_prefix(architecture, config, takes, tmp_path_factory):
    assert takes_tree_mask(_model(architecture, tmp_path_factory.mktemp(architecture), **config)) is takes


@pytest.mark.unit
def test_the_decoder_is_found_where_get_decoder_gives_the_model_itself(tmp_path_factory):
    model = _model("Llama4TextConfig", tmp_path_factory.mktemp("llama4"), **LLAMA4_TEXT)
    assert model.get_decoder() is model and decoder(model) is model.model
    assert head_mismatch(model) is None


@pytest.mark.unit
@pytest.mark.parametrize("architecture", list(SCALED))
def test_the_trainers_logits_are_the_forwards(architecture, tmp_path_factory):
    model = _model(architecture, tmp_path_factory.mktemp(architecture), num_key_value_heads=2, **SCALED[architecture])
    ids = torch.randint(0, model.config.vocab_size, (2, 9), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = model(input_ids=ids).logits
        hidden = model.get_decoder()(input_ids=ids)[0]
        assert torch.allclose(output_logits(model)(hidden), want, atol=1e-6)
        assert not torch.allclose(model.get_output_embeddings()(hidden), want, atol=1e-3)  # the head alone is not
    assert head_mismatch(model) is None


def _double_the_logits(cls: type, monkeypatch) -> None:
    """`cls`'s forward, then its logits doubled: a step the trainer's head cannot follow."""
    forward = cls.forward

    def doubled(self, *args, **kwargs):
        out = forward(self, *args, **kwargs)
        out.logits = out.logits * 2
        return out

    monkeypatch.setattr(cls, "forward", doubled)


@pytest.mark.unit
def test_a_forward_the_trainer_cannot_follow_is_named(tmp_path_factory, monkeypatch):
    model = _model("LlamaConfig", tmp_path_factory.mktemp("llama"), num_key_value_heads=2)
    _double_the_logits(type(model), monkeypatch)
    assert "makes other logits of the decoder's states than its output head" in head_mismatch(model)


def _group(choices: list, prompt: list[dict]) -> TrajectoryGroup:
    return TrajectoryGroup(trajectories=[Trajectory(messages_and_choices=[*prompt, c], reward=float(i))
                                         for i, c in enumerate(choices)])


@pytest.mark.parametrize("architecture,config", [("GPT2Config", GPT2), ("FalconConfig", {}), ("BloomConfig", BLOOM),
                                                 ("Qwen2MoeConfig", QWEN2_MOE), ("DeepseekV3Config", DEEPSEEK_V3),
                                                 ("Llama4TextConfig", LLAMA4_TEXT),
                                                 *[(a, {"num_key_value_heads": 2, **c}) for a, c in SCALED.items()]])
async def test_a_run_samples_trains_and_serves_its_step(architecture, config, tmp_path_factory, fresh_server_module):
    """A run's adapter in the engine's batch, a step on its samples whose trainer agrees with the sampler
    (on-policy: a gap of ~0, not the scale the forward applies), and the step served."""
    srv = fresh_server_module(model=tiny_architecture_dir(architecture, tmp_path_factory.mktemp("m"), **config))
    model = await TrainableModel(architecture.lower()).register(srv.url)
    prompt = [{"role": "user", "content": "Say hi"}]
    async with model.openai_client(max_retries=0) as client:
        replies = await asyncio.gather(*(client.chat.completions.create(
            model=model.name, messages=prompt, max_tokens=8, seed=s, logprobs=True) for s in range(2)))
        result = await model.train([_group([r.choices[0] for r in replies], prompt)])
        assert result.trained and result.step == 1, result.warnings
        assert result.metrics.logprob_gap is not None and result.metrics.logprob_gap < 1e-3, result.metrics
        served = await client.chat.completions.create(model=f"{model.name}@1", messages=prompt, max_tokens=4)
        assert served.usage.completion_tokens >= 1


async def _two_turn_rollouts(client: Any, model: str, opening: Callable[[int], str], max_tokens: Callable[[int], int],
                             follow_up: str) -> TrajectoryGroup:
    """Four rollouts at once of two turns each, rewarded by parity: every turn a row that joins the
    engine's batch beside the others' and leaves it when done."""
    async def rollout(i: int) -> Trajectory:
        traj = Trajectory(messages_and_choices=[{"role": "user", "content": opening(i)}])
        for _ in range(2):
            reply = await client.chat.completions.create(model=model, messages=traj.messages(),
                                                         max_tokens=max_tokens(i), seed=i)
            traj.messages_and_choices += [reply.choices[0], {"role": "user", "content": follow_up}]
        traj.messages_and_choices.pop()
        return traj.model_copy(update={"reward": float(i % 2)})

    return TrajectoryGroup(trajectories=list(await asyncio.gather(*map(rollout, range(4)))))


@pytest.mark.parametrize("architecture", [*STATEFUL, "Gemma4TextConfig"])
async def test_rows_that_keep_states_join_and_leave_the_batch_and_train_exactly(architecture, tmp_path_factory,
                                                                                  fresh_server_module):
    """Two-turn rollouts of four lengths, each turn a row that joins the engine's batch, decodes beside
    the others and leaves when it is done: a row's linear-attention or convolution state follows it
    through every join and compaction, or the trainer's from-scratch forward would not give the
    logprobs it was sampled with. A prompt decoded alone and beside longer ones samples the same."""
    config = GEMMA4_SHARED if architecture == "Gemma4TextConfig" else STATEFUL[architecture]
    srv = fresh_server_module(model=tiny_architecture_dir(architecture, tmp_path_factory.mktemp("m"), **config))
    model = await TrainableModel("states").register(srv.url)
    async with model.openai_client(max_retries=0) as client:
        group = await _two_turn_rollouts(client, model.name, lambda i: "Hi there " * (1 + 3 * i), lambda i: 4 + 3 * i,
                                         "More.")
        greedy = {"max_tokens": 8, "temperature": 0, "logprobs": True}
        alone = await client.chat.completions.create(model=model.name, messages=[{"role": "user", "content": "Hi"}],
                                                     **greedy)
        beside = await asyncio.gather(*(client.chat.completions.create(
            model=model.name, messages=[{"role": "user", "content": "Hi" + " there" * k}], **greedy)
            for k in (0, 6, 12)))
        assert beside[0].choices[0].model_extra["token_ids"] == alone.choices[0].model_extra["token_ids"]
        result = await model.train([group])
    assert result.trained and result.metrics.trained_choices == 8 and result.metrics.prompt_mismatches == 0
    assert result.metrics.logprob_gap < 1e-3, result.metrics


@pytest.mark.parametrize("architecture", list(STATEFUL))
async def test_a_turn_after_a_long_prompt_starts_from_the_states_it_left(architecture, tmp_path_factory,
                                                                         fresh_server_module):
    """A layer's state holds its whole prefix, so the prefix cache keeps it with a finished turn's keys
    and reuses the entry only whole: the next turn prefills only its new tokens, and samples (two rows
    from one prompt) as a full forward of the model would."""
    model_dir = tiny_architecture_dir(architecture, tmp_path_factory.mktemp("m"), **STATEFUL[architecture])
    srv = fresh_server_module(model=model_dir)
    async with openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0) as client:
        messages = [{"role": "user", "content": "Hi there " * 150}]
        first = await client.chat.completions.create(model=model_dir.name.removeprefix("model-"),
                                                     messages=messages, max_tokens=6, seed=1)
        messages += [first.choices[0].message.model_dump(exclude_none=True), {"role": "user", "content": "More."}]
        before = httpx.get(srv.url + "/health").json()["prefix_cache"]
        second = await client.chat.completions.create(model=first.model, messages=messages, max_tokens=6, seed=2,
                                                      n=2, logprobs=True)
        after = httpx.get(srv.url + "/health").json()["prefix_cache"]
    assert after["hits"] == before["hits"] + 1
    kept = len(first.model_extra["prompt_token_ids"]) + len(first.choices[0].model_extra["token_ids"]) - 1
    assert after["tokens_reused"] - before["tokens_reused"] == kept
    model = _model(architecture, model_dir.parent, **STATEFUL[architecture])
    prompt = second.model_extra["prompt_token_ids"]
    for choice in second.choices:
        want = completion_logprobs(model, prompt, choice.model_extra["token_ids"])
        got = torch.tensor([e.logprob for e in choice.logprobs.content])
        assert (got - want).abs().max().item() <= 1e-4


@pytest.mark.parametrize("architecture", ["Qwen3_5TextConfig", "NemotronHConfig"])
async def test_prompts_sharing_a_long_opening_resume_from_the_states_kept_within_it(architecture, tmp_path_factory,
                                                                                   fresh_server_module):
    """The tasks of one domain share a long system prompt, then differ: a prefill keeps the states
    every --prefix-state-every tokens, and the next task resumes from the furthest within what it
    shares, sampling as a full forward of the model would."""
    model_dir = tiny_architecture_dir(architecture, tmp_path_factory.mktemp("m"), **STATEFUL[architecture])
    srv = fresh_server_module(model=model_dir)
    system = {"role": "system", "content": "Follow the policy. " * 80}
    name = model_dir.name.removeprefix("model-")
    async with openai.AsyncOpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0) as client:
        first = await client.chat.completions.create(model=name, messages=[system, {"role": "user", "content": "A?"}],
                                                     max_tokens=4, logprobs=True)  # prefilled in two stretches
        before = httpx.get(srv.url + "/health").json()["prefix_cache"]
        second = await client.chat.completions.create(model=name, messages=[system, {"role": "user", "content": "B!"}],
                                                      max_tokens=6, seed=2, logprobs=True)
        after = httpx.get(srv.url + "/health").json()["prefix_cache"]
    prompt, other = second.model_extra["prompt_token_ids"], first.model_extra["prompt_token_ids"]
    shared = next(i for i, (a, b) in enumerate(zip(prompt, other)) if a != b)
    every = Settings.model_fields["prefix_state_every"].default
    assert shared > every and after["hits"] == before["hits"] + 1
    assert after["tokens_reused"] - before["tokens_reused"] == shared // every * every
    model = _model(architecture, model_dir.parent, **STATEFUL[architecture])
    for answer in (first, second):
        choice = answer.choices[0]
        want = completion_logprobs(model, answer.model_extra["prompt_token_ids"], choice.model_extra["token_ids"])
        assert (torch.tensor([e.logprob for e in choice.logprobs.content]) - want).abs().max().item() <= 1e-4


async def test_a_multimodal_checkpoint_trains_its_language_model(tmp_path_factory, fresh_server_module):
    """Gemma 4's checkpoints hold a vision tower whose projections share the decoder's names (in a class
    peft cannot wrap), and nest the language model's config, sliding window included: a run adapts the
    decoder only, and sequences longer than the window are not packed under one mask that ignores it."""
    srv = fresh_server_module(model=tiny_gemma4_vlm_dir(tmp_path_factory.mktemp("vlm")))
    model = await TrainableModel("vlm").register(srv.url)
    async with model.openai_client(max_retries=0) as client:
        group = await _two_turn_rollouts(client, model.name, lambda i: "Describe the weather " * (2 + i),
                                         lambda i: 12, "And tomorrow?")  # past the 16-token window
        result = await model.train([group])
    assert result.trained and result.metrics.prompt_mismatches == 0, result.warnings
    assert result.metrics.logprob_gap < 1e-3, result.metrics


async def test_a_model_the_trainer_cannot_score_serves_and_refuses_runs(tmp_path, monkeypatch):
    from server.app import create_app
    from server.settings import Settings
    from tests.helpers import ServedApp

    _double_the_logits(transformers.Qwen2ForCausalLM, monkeypatch)  # the embedded model's class
    app = create_app(Settings(data_dir=tmp_path / "data", device="cpu"))
    with ServedApp(app, log_level="critical") as served:
        async with openai.AsyncOpenAI(base_url=served.url + "/v1", api_key="x", max_retries=0) as client:
            with pytest.raises(openai.BadRequestError) as refused:
                await client.post("/runs", body={"name": "r"}, cast_to=object)
            error = refused.value.body
            assert error["code"] == "model_not_trainable" and "cannot train runs here" in error["message"], error
            assert "\n" not in error["message"]
            reply = await client.chat.completions.create(model="artisan-tiny", max_tokens=2,
                                                         messages=[{"role": "user", "content": "hi"}])
            assert reply.usage.completion_tokens == 2  # and it serves
