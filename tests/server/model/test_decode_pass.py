"""The engine's decode step (server/model/decode_pass.py) gives bitwise the logits and K/V of the
model's own forward: on the embedded Qwen2 and SmolLM2's Llama, one row (the transposed copy) and
several, base rows and rows of two LoRA adapters in one batch; and a model it does not know takes
the model's forward."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig
from transformers import AutoModelForCausalLM, MistralConfig

from server.engine.kv_cache import HEADROOM, BatchKV
from server.model import decode_copy, decode_pass
from server.model.host import ModelHost
from server.settings import DEFAULT_MODEL_DIR

PROMPT = "the price of the apple is seven dollars and the pear costs two more"


def _with_adapters(host: ModelHost) -> None:
    gen = torch.Generator().manual_seed(0)
    for name in ("left", "right"):
        host.add_adapter(name, LoraConfig(r=4, lora_alpha=8, target_modules=host.lora_targets, lora_dropout=0.0))
        for p in host.adapter_params(name):  # peft starts B at zero, which would hide the adapter's term
            p.copy_(torch.randn(p.shape, generator=gen) * 0.05)


def _prefilled(host: ModelHost, rows: int) -> BatchKV:
    ids = host.tokenizer(PROMPT).input_ids
    cfg = host.config
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    kv = BatchKV.empty(cfg.num_hidden_layers, rows, cfg.num_key_value_heads, head_dim, len(ids) + HEADROOM, host.dtype,
                       host.device)
    batch = torch.tensor([ids] * rows)
    host.decode(batch, [None] * rows, past_key_values=kv.cache(), use_cache=True,
                attention_mask=torch.ones_like(batch), logits_to_keep=1)
    kv.advance(len(ids))
    kv.lengths[-1] -= 3  # the last row's prompt is shorter: its first columns are padding
    return kv


def _steps(host: ModelHost, adapters: list[str | None], through_pass: bool, steps: int = 4):
    kv = _prefilled(host, len(adapters))
    token, seen = torch.full((len(adapters), 1), 7), []
    for _ in range(steps):
        args = (token, adapters, kv.cache(), kv.attention_mask(extra=1), torch.tensor(kv.lengths)[:, None])
        if through_pass:
            logits = host.decode_step(*args)
        else:
            logits = host.decode(args[0], adapters, past_key_values=args[2], use_cache=True, attention_mask=args[3],
                                 position_ids=args[4]).logits[:, -1, :]
        kv.advance(1)
        seen.append(logits)
        token = logits.argmax(-1, keepdim=True)
    return seen, kv


def _assert_same(host: ModelHost, adapters: list[str | None]) -> None:
    with torch.inference_mode():
        want, want_kv = _steps(host, adapters, through_pass=False)
        got, got_kv = _steps(host, adapters, through_pass=True)
    assert all(torch.equal(a, b) for a, b in zip(want, got))
    assert all(torch.equal(a, b) for a, b in zip(want_kv.kbufs + want_kv.vbufs, got_kv.kbufs + got_kv.vbufs))


def _check_host(host: ModelHost) -> None:
    assert host.exact_decode_pass
    for adapters in ([None], [None, None, None]):
        _assert_same(host, adapters)
    _with_adapters(host)
    assert host.exact_decode_pass
    for adapters in (["left"], [None], ["left", None, "right", "left"]):
        _assert_same(host, adapters)
    with pytest.raises(ValueError), torch.inference_mode():  # as the forward refuses it, not decoded as the base
        _steps(host, ["left", "gone"], through_pass=True)
    host.delete_adapter("left")
    host.delete_adapter("right")
    _assert_same(host, [None, None])


@pytest.mark.unit
def test_the_decode_pass_is_the_embedded_qwen2_s_forward_bit_for_bit():
    host = ModelHost(DEFAULT_MODEL_DIR, device="cpu", dtype="float32")
    decode_copy.copy_for_decode(host.base_model)
    _check_host(host)


def test_the_decode_pass_is_smollm2_s_forward_bit_for_bit():
    from tests.real_models import converted, smollm2_gguf

    host = ModelHost(converted(smollm2_gguf()), device="cpu", dtype="float32")
    decode_copy.copy_for_decode(host.base_model)  # as art-server decodes on a CPU: one row takes the copy
    _check_host(host)


@pytest.mark.unit
def test_a_model_the_pass_does_not_know_takes_the_model_s_forward(tmp_path):
    config = MistralConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                           num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128)
    assert not decode_pass.applies(AutoModelForCausalLM.from_config(config))
    host = ModelHost(DEFAULT_MODEL_DIR, device="cpu", dtype="float32")
    host.exact_decode_pass = False  # as for such a model: decode_step is the model's forward
    _assert_same(host, [None, None])
