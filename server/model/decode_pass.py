"""The engine's decode step on Llama and Qwen2 decoders: transformers' arithmetic, without its dispatch.

A decode step forwards one token per row. On SmolLM2-135M (30 layers) transformers' forward makes
about 400 module calls a token, each through nn.Module's hook machinery, the layers' kwarg plumbing
and deprecation wrappers, and, once a run's adapter is loaded, peft's mixed-batch bookkeeping in each
of its 210 adapted layers: with an adapter loaded, 13-16 ms of a one-row step's 67-84 on the 2-core
machine, and 14-17 ms of an 8-row step's 109-189 (`make bench-decode`). This pass calls the same
functions on the same tensors in the same order (each linear's own `forward`, the model's rotary
embedding, mask builder, `apply_rotary_pos_emb`, cache update and attention function, peft's LoRA
arithmetic as its mixed-batch forward does it), so its logits are bitwise the model's forward's
(tests/server/model/test_decode_pass.py): every logprob and every seeded sample is what it was. What it
leaves out is the dispatch. A model it does not know takes the model's forward (`applies`).
"""

from __future__ import annotations

import sys
from typing import Any

import torch
from transformers.masking_utils import create_causal_mask
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

def applies(model: Any) -> bool:
    """Whether `model` (a transformers causal LM, peft-wrapped in place or not) is one this pass
    computes exactly: a Llama or a Qwen2 whose layers all attend to the full context through SDPA
    or eager attention, with LoRA adapters of plain LoRA only, none merged or disabled."""
    config = model.config
    if config.model_type not in ("llama", "qwen2") or getattr(config, "pretraining_tp", 1) != 1:
        return False
    if config._attn_implementation not in ("sdpa", "eager"):  # flash attention reads kwargs this pass does not pass
        return False
    if any(t != "full_attention" for t in getattr(config, "layer_types", None) or ()):
        return False
    return all(not getattr(m, "lora_variant", None) and not getattr(m, "merged", False)
               and not getattr(m, "disable_adapters", False)
               for m in model.modules() if hasattr(m, "base_layer"))


def decode_logits(model: Any, input_ids: torch.Tensor, adapters: list[str | None], cache: Any,
                  attention_mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
    """Next-token logits [rows, 1, vocab] for one new token per row, each row under its own adapter
    (None: the base model), written through `cache` as the model's forward writes it."""
    inner = model.model
    x = inner.embed_tokens(input_ids)
    mask = create_causal_mask(config=model.config, inputs_embeds=x, attention_mask=attention_mask, cache=cache,
                              position_ids=position_ids)
    cos, sin = inner.rotary_emb(x, position_ids=position_ids)
    rows = _rows_by_adapter(adapters)
    architecture = sys.modules[type(inner.layers[0].self_attn).__module__]  # its own rotary and eager attention
    attend = ALL_ATTENTION_FUNCTIONS.get_interface(model.config._attn_implementation,
                                                   architecture.eager_attention_forward)
    for layer in inner.layers[: model.config.num_hidden_layers]:
        attn, mlp = layer.self_attn, layer.mlp
        heads = (*x.shape[:-1], -1, attn.head_dim)
        h = layer.input_layernorm.forward(x)
        q = _linear(attn.q_proj, h, rows).view(heads).transpose(1, 2)
        k = _linear(attn.k_proj, h, rows).view(heads).transpose(1, 2)
        v = _linear(attn.v_proj, h, rows).view(heads).transpose(1, 2)
        q, k = architecture.apply_rotary_pos_emb(q, k, cos, sin)
        k, v = cache.update(k, v, attn.layer_idx)
        o, _ = attend(attn, q, k, v, mask, dropout=0.0, scaling=attn.scaling,
                      sliding_window=getattr(attn, "sliding_window", None))
        x = x + _linear(attn.o_proj, o.reshape(*x.shape[:-1], -1).contiguous(), rows)
        h = layer.post_attention_layernorm.forward(x)
        gated = mlp.act_fn(_linear(mlp.gate_proj, h, rows)) * _linear(mlp.up_proj, h, rows)
        x = x + _linear(mlp.down_proj, gated, rows)
    return model.lm_head.forward(inner.norm.forward(x))


def _rows_by_adapter(adapters: list[str | None]) -> list[tuple[str, list[int]]]:
    """The rows of each adapter, base rows left out (they take the base weights alone)."""
    by: dict[str, list[int]] = {}
    for i, a in enumerate(adapters):
        if a is not None:
            by.setdefault(a, []).append(i)
    return list(by.items())


def _linear(module: Any, x: torch.Tensor, rows: list[tuple[str, list[int]]]) -> torch.Tensor:
    """`module`'s output as peft's mixed-batch forward computes it: the base layer for every row, then
    each adapter's scaled low-rank term added to its own rows."""
    base = getattr(module, "base_layer", None)
    if base is None:
        return module.forward(x)
    result = base.forward(x)
    for adapter, index in rows:
        if adapter not in module.lora_A:
            continue
        lora_a, lora_b = module.lora_A[adapter], module.lora_B[adapter]
        sub = x[index].to(lora_a.weight.dtype)
        out = lora_b.forward(lora_a.forward(module.lora_dropout[adapter](sub))) * module.scaling[adapter]
        result[index] += out.to(result.dtype)
    return result
