"""What serving and training need to know of a causal LM's architecture, read from the model itself:
the layers a run's LoRA adapts, the logits its forward makes of the decoder's last hidden states, and
the shape of the keys and values it caches.

Reading the modules alone guesses wrong on architectures no one tuned for, so a probe forward of two
short rows decides: which layers see each row of a batch as a row of its own (peft's mixed-adapter
batch, which the engine serves many runs' steps with, adds each row's adapter by the input's first
dimension; an MoE block feeds its router and experts the batch's tokens flattened), and whether the
trainer's logits are the forward's (Cohere scales them, Granite divides them, Gemma 2 soft-caps them;
a trainer that skipped that would score every sampled token under another distribution), and what
each layer caches (GPT-2 has no key-value heads in its config, Falcon one for all its heads).
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any, Callable

import torch
from transformers.pytorch_utils import Conv1D

BLOCK = re.compile(r"(^|\.)\d+\.")  # inside a numbered block: model.layers.3., transformer.h.0.
PROBE = ((0, 1, 2, 3), (3, 2, 1, 0))  # two rows of token ids every vocabulary has


def _linear(module: torch.nn.Module) -> bool:
    return isinstance(module, (torch.nn.Linear, Conv1D))  # Conv1D: GPT-2's linear layers, weights stored in x out


def _features(module: torch.nn.Module) -> tuple[int, int]:
    if isinstance(module, Conv1D):
        return module.weight.shape[0], module.weight.shape[1]
    return module.in_features, module.out_features


def _block_linears(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    return {name: m for name, m in model.named_modules() if _linear(m) and BLOCK.search(name)}


def linear_modules(model: torch.nn.Module) -> dict[str, tuple[int, int]]:
    """In and out features of each linear layer in the decoder blocks, by module path (what a LoRA
    checkpoint's keys name; read before any adapter wraps them)."""
    return {name: _features(m) for name, m in _block_linears(model).items()}


def linear_shapes(model: torch.nn.Module) -> list[tuple[str, int, int]]:
    """Leaf name, in and out features of each linear layer in the decoder blocks."""
    return [(name.rsplit(".", 1)[-1], *features) for name, features in linear_modules(model).items()]


def lora_targets(model: torch.nn.Module) -> list[str]:
    """What `all-linear` means for this model, by leaf name (q_proj ... down_proj for Llama, c_attn
    ... c_proj for GPT-2): the decoder blocks' linear layers that the probe forward shows taking each
    row apart. A leaf name any layer of which takes the rows flattened (an MoE's router, experts,
    shared expert) is left to the base weights: its adapter could not be served in a mixed batch."""
    modules = _block_linears(model)
    kept = _rows_kept(model, modules)
    by_leaf: dict[str, list[bool]] = defaultdict(list)
    for name in modules:
        by_leaf[name.rsplit(".", 1)[-1]].append(kept.get(name, False))  # one the probe never ran: not known to
    return sorted(leaf for leaf, rows_apart in by_leaf.items() if all(rows_apart))


def _rows_kept(model: torch.nn.Module, modules: dict[str, torch.nn.Module]) -> dict[str, bool]:
    rows = len(PROBE)
    kept: dict[str, bool] = {}

    def hook(name: str) -> Callable[..., None]:
        def seen(module: torch.nn.Module, args: tuple) -> None:
            x = args[0] if args else None
            kept[name] = kept.get(name, True) and isinstance(x, torch.Tensor) and x.dim() >= 3 and x.shape[0] == rows
        return seen

    handles = [m.register_forward_pre_hook(hook(name)) for name, m in modules.items()]
    try:
        with torch.no_grad():
            model(input_ids=_probe_ids(model), use_cache=False)
    finally:
        for h in handles:
            h.remove()
    return kept


def _probe_ids(model: torch.nn.Module) -> torch.Tensor:
    return torch.tensor(PROBE, dtype=torch.long, device=model.get_input_embeddings().weight.device)


def output_logits(model: Any) -> Callable[[torch.Tensor], torch.Tensor]:
    """The logits `model`'s forward makes of the decoder's last hidden states: its output head, then
    what the architecture's forward applies after it, in the same order and dtype."""
    head, config = model.get_output_embeddings(), model.config
    scale = getattr(config, "logit_scale", None)  # Cohere
    divisor = getattr(config, "logits_scaling", None)  # Granite
    cap = getattr(config, "final_logit_softcapping", None)  # Gemma 2

    def logits(hidden: torch.Tensor) -> torch.Tensor:
        out = head(hidden)
        if scale is not None:
            out = out * scale
        if divisor is not None:
            out = out / divisor
        if cap is not None:
            out = torch.tanh(out / cap) * cap
        return out

    return logits


def head_mismatch(model: Any) -> str | None:
    """Why training cannot score this model's tokens as its forward does, or None: the probe's logits
    through the decoder and `output_logits` against the model's own forward."""
    ids = _probe_ids(model)
    try:
        with torch.no_grad():
            want = model(input_ids=ids, use_cache=False).logits.float()
            hidden = model.get_decoder()(input_ids=ids, use_cache=False)[0]
            got = output_logits(model)(hidden).float()
    except Exception as e:  # noqa: BLE001 - any failure is the answer: its decoder and head do not run apart
        return f"its decoder and output head do not run apart ({type(e).__name__}: {' '.join(str(e).split())[:200]})"
    tolerance = 1e-5 if want.dtype == torch.float32 and hidden.dtype == torch.float32 else 1e-2
    gap = (want - got).abs().max().item() if want.shape == got.shape else float("inf")
    if gap <= tolerance * (1 + want.abs().max().item()):
        return None
    return (f"its forward makes other logits of the decoder's states than its output head does (largest gap "
            f"{gap:.3g}): a step would score sampled tokens under another distribution than they were sampled from")


class KVShapeError(SystemExit):
    """A model whose layers cache keys and values of different shapes: the torch engine's batch cache
    keeps one shape for all of them."""


def kv_shape(model: Any) -> tuple[int, int, int]:
    """Layers, key-value heads and head size of what `model` caches, from the cache of a probe forward."""
    with torch.no_grad():
        cache = model(input_ids=_probe_ids(model)[:1], use_cache=True).past_key_values
    shapes = {(layer.keys.shape[1], layer.keys.shape[-1]) for layer in cache.layers}
    if len(shapes) != 1:
        raise KVShapeError(f"error: {model.config.model_type}'s layers cache keys of {len(shapes)} shapes "
                           f"({sorted(shapes)}, heads x head size); the torch engine caches one: serve it with "
                           f"--engine vllm")
    [(heads, head_dim)] = shapes
    return len(cache.layers), heads, head_dim
