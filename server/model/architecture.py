"""What serving and training need to know of a causal LM's architecture, read from the model itself
by probe forwards of a few tokens, where its config or its modules' names would be guessed from:

- the layers a run's LoRA adapts: those that take each row of a batch apart (peft serves a batch of
  many runs' adapters by its first dimension; an MoE feeds its router and experts the tokens flat);
- the logits its forward makes of the decoder's states (Cohere scales them, Granite divides them,
  Gemma 2 soft-caps them: a trainer that skipped it would score tokens under another distribution);
- whether it honours the 4-D mask the trainer packs sequences that share a prefix with (Bloom's
  ALiBi is built from a 2-D one);
- what each layer caches (GPT-2 names no key-value heads, Falcon caches one for all its heads,
  DeepSeek's latent attention keys and values of two sizes).
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any, Callable, NamedTuple

import torch
from transformers import PreTrainedModel
from transformers.cache_utils import DummyLayer, DynamicLayer, LinearAttentionCacheLayerMixin, LinearAttentionLayer
from transformers.pytorch_utils import Conv1D

from server.log_limits import one_line

BLOCK = re.compile(r"(^|\.)\d+\.")  # inside a numbered block: model.layers.3., transformer.h.0.
PROBE = ((0, 1, 2, 3), (3, 2, 1, 0))  # two rows of token ids every vocabulary has
TREE = (0, 1, 2, 3, 2)  # one row: a shared first token, then two members of two tokens each


def _linear(module: torch.nn.Module) -> bool:
    return isinstance(module, (torch.nn.Linear, Conv1D))  # Conv1D: GPT-2's linear layers, weights stored in x out


def _features(module: torch.nn.Module) -> tuple[int, int]:
    if isinstance(module, Conv1D):
        return module.weight.shape[0], module.weight.shape[1]
    return module.in_features, module.out_features


def _block_linears(model: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """The linear layers of the decoder's numbered blocks (not a vision tower's: Gemma 4's has its own)."""
    inside = _decoder_prefix(model)
    return {name: m for name, m in model.named_modules()
            if _linear(m) and BLOCK.search(name) and name.startswith(inside)}


def _decoder_prefix(model: torch.nn.Module) -> str:
    """The module path of the decoder stack with a dot after it ("model.language_model."), or "" where
    the model is its own stack."""
    stack = decoder(model)
    return next((f"{name}." for name, m in model.named_modules() if m is stack and name), "")


def outside_decoder(model: torch.nn.Module, targets: list[str]) -> str | None:
    """peft's `exclude_modules` for a model that holds more than its decoder, where layers outside it
    share the targets' names (Gemma 4's vision tower has its own q_proj, of a class peft cannot wrap):
    a run's LoRA adapts the decoder only. None where nothing outside would be taken."""
    inside = _decoder_prefix(model)
    if not inside or not any(name.rsplit(".", 1)[-1] in targets and not name.startswith(inside)
                             for name, _ in model.named_modules()):
        return None
    return rf"(?!{re.escape(inside)}).*"


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
    fused = _fused_names(model)
    return sorted(leaf for leaf, rows_apart in by_leaf.items()
                  if all(rows_apart) and leaf not in fused and _peft_adapts(model, leaf))


def _peft_adapts(model: torch.nn.Module, leaf: str) -> bool:
    """Whether peft will put LoRA on layers of this name: it refuses a Mamba mixer's out_proj."""
    from peft import LoraConfig
    from peft.tuners.tuners_utils import _check_lora_target_modules_mamba

    try:
        _check_lora_target_modules_mamba(LoraConfig(), model, leaf)
    except ValueError:
        return False
    return True


def _fused_names(model: torch.nn.Module) -> set[str]:
    """Leaf names peft would also adapt as a fused parameter: transformers 5 stacks an MoE's experts
    into parameters named as the dense projections were (down_proj; gate_up_proj for gate_proj and
    up_proj), and peft wraps those where a target names them, in a wrapper no mixed batch serves
    (DeepSeek V3's dense first layers share the names with its experts)."""
    names = {name.rsplit(".", 1)[-1] for name, p in model.named_parameters(remove_duplicate=False)
             if name.rsplit(".", 1)[-1] not in ("weight", "bias")}
    return names | ({"gate_proj", "up_proj"} if "gate_up_proj" in names else set())


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
    except Exception as e:  # noqa: BLE001 - a model that cannot forward two rows cannot be served
        raise ModelRefused(f"error: {model.config.model_type}'s forward fails on two rows of four tokens "
                           f"({one_line(e, 200)})") from None
    finally:
        for h in handles:
            h.remove()
    return kept


class ModelRefused(SystemExit):
    """A model this server cannot serve as it is asked to, said in one line at start."""


def _probe_ids(model: torch.nn.Module) -> torch.Tensor:
    return torch.tensor(PROBE, dtype=torch.long, device=model.get_input_embeddings().weight.device)


def decoder(model: Any) -> Any:
    """The decoder stack whose last hidden states the output head reads. transformers' `get_decoder()`
    gives the model itself where a class names its stack otherwise (Llama 4's text model): then the one
    pretrained model among its children."""
    found = model.get_decoder()
    if found is not model:
        return found
    stacks = [m for m in model.children() if isinstance(m, PreTrainedModel)]
    return stacks[0] if len(stacks) == 1 else model


def takes_tree_mask(model: Any) -> bool:
    """Whether `model` honours a 4-D additive attention mask with position ids as given, as the
    trainer's shared-prefix rows need (server/training/packing.py): two sequences that share their
    first token, laid in one row, must get the logits each gets alone. Bloom's ALiBi, built from a
    2-D mask, does not take one; a flash kernel would ignore it."""
    device = model.get_input_embeddings().weight.device
    row = torch.tensor([TREE], device=device)
    mask = tree_attention(torch.tensor([-1, 0, 0, 1, 1], device=device), model.dtype)[None, None]
    try:
        with torch.no_grad():
            positions = torch.tensor([[0, 1, 2, 1, 2]], device=device)
            packed = model(input_ids=row, attention_mask=mask, position_ids=positions, use_cache=False).logits[0]
            packed = packed.float()
            first = model(input_ids=row[:, :3], use_cache=False).logits[0].float()
            second = model(input_ids=row[:, [0, 3, 4]], use_cache=False).logits[0, 1:].float()
    except Exception:  # noqa: BLE001 - a forward that refuses the mask does not take it
        return False
    alone = torch.cat([first, second])
    return bool((packed - alone).abs().max() <= _tolerance(model.dtype) * (1 + alone.abs().max()))


def tree_attention(owner: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """[n, n] additive attention mask of one row whose positions belong to `owner` (-1: a prefix every
    member sees, m >= 0: member m, -2: padding): 0 where a query may attend a key (causally, the
    prefix and its own member's earlier tokens), the dtype's lowest elsewhere."""
    index = torch.arange(len(owner), device=owner.device)
    causal = index[None, :] <= index[:, None]
    same = (owner[None, :] == owner[:, None]) & (owner[:, None] >= 0)
    visible = causal & ((owner[None, :] == -1) | same)
    return torch.zeros(visible.shape, dtype=dtype, device=owner.device).masked_fill(~visible, torch.finfo(dtype).min)


def _tolerance(dtype: torch.dtype) -> float:
    return 1e-5 if dtype == torch.float32 else 1e-2


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
            hidden = decoder(model)(input_ids=ids, use_cache=False)[0]
            got = output_logits(model)(hidden).float()
    except Exception as e:  # noqa: BLE001 - any failure is the answer: its decoder and head do not run apart
        return f"its decoder and output head do not run apart ({one_line(e, 200)})"
    gap = (want - got).abs().max().item() if want.shape == got.shape else float("inf")
    if gap <= _tolerance(hidden.dtype) * (1 + want.abs().max().item()):
        return None
    return (f"its forward makes other logits of the decoder's states than its output head does (largest gap "
            f"{gap:.3g}): a step would score sampled tokens under another distribution than they were sampled from")


class KVShape(NamedTuple):
    """What each layer caches per token: `heads` keys of `head_dim`, `value_heads` values of `value_dim`
    (the same but for multi-head latent attention, which caches a latent and a rotary key). `layers`
    counts the layers that cache keys and values; `kinds` says of every layer in order whether it does
    ("kv") or keeps a fixed-size state instead ("state": a linear attention's or a short convolution's,
    as Qwen3.5's and LFM2's do), which takes `state_bytes` a row, or caches nothing ("none": an MoE
    or MLP block of a hybrid stack, a layer that reads another's keys and values)."""

    layers: int
    heads: int
    head_dim: int
    value_heads: int
    value_dim: int
    kinds: tuple[str, ...] = ()
    state_bytes: int = 0


def kv_shape(model: Any) -> KVShape:
    """What `model` caches, from the cache of a probe forward: one shape of plain keys and values for
    every layer that caches them, beside layers that keep a state (transformers' LinearAttentionLayer),
    or the torch engine cannot serve it."""
    name = model.config.model_type
    try:
        with torch.no_grad():
            layers = list(model(input_ids=_probe_ids(model)[:1], use_cache=True).past_key_values.layers)
    except Exception as e:  # noqa: BLE001 - a forward that cannot cache
        raise ModelRefused(f"error: the torch engine cannot cache {name}'s layers ({one_line(e, 200)}); serve it "
                           f"with --engine vllm") from None
    kinds = tuple(_cache_kind(lay) for lay in layers)
    shapes = {(lay.keys.shape[1], lay.keys.shape[-1], lay.values.shape[1], lay.values.shape[-1])
              for lay, kind in zip(layers, kinds) if kind == "kv"}
    if "?" in kinds:
        found = sorted({type(lay).__name__ for lay, kind in zip(layers, kinds) if kind == "?"})
        raise ModelRefused(f"error: the torch engine cannot hold {name}'s {', '.join(found)} caches (keys and values "
                           f"beside a state in one layer, or another kind): serve it with --engine vllm")
    if len(shapes) != 1:
        raise ModelRefused(f"error: {name}'s layers cache {len(shapes)} shapes of keys and values; the torch engine "
                           f"caches one shape of them: serve it with --engine vllm")
    [shape] = shapes
    state_bytes = sum(t.nelement() * t.element_size() for lay, kind in zip(layers, kinds) if kind == "state"
                      for t in [*lay.conv_states.values(), *lay.recurrent_states.values()] if t is not None)
    return KVShape(kinds.count("kv"), *shape, kinds if set(kinds) != {"kv"} else (), state_bytes)


def continues_from_cache(model: Any) -> bool:
    """Whether a forward of several tokens continues from the cache a shorter forward left, as
    from the prompt alone: what lets the engine start a prompt from a cached prefix's states
    (a linear attention's, a convolution's), which can only be taken whole."""
    ids = torch.tensor([TREE * 3], device=model.get_input_embeddings().weight.device)
    cut = ids.shape[1] // 2
    try:
        with torch.no_grad():
            whole = model(input_ids=ids, use_cache=False).logits[0, cut:].float()
            cache = model(input_ids=ids[:, :cut], use_cache=True).past_key_values
            rest = model(input_ids=ids[:, cut:], past_key_values=cache, use_cache=True).logits[0].float()
    except Exception:  # noqa: BLE001 - a model that cannot continue does not
        return False
    return bool((whole - rest).abs().max() <= _tolerance(model.dtype) * (1 + whole.abs().max()))


def _cache_kind(layer: Any) -> str:
    """What a layer of transformers' cache holds, as the engine holds it; "?" for one it cannot (Falcon-H1's
    keeps keys and a state in one layer, a DynamicLayer that the engine's slabs would strip of its state)."""
    if type(layer) is LinearAttentionLayer:
        return "state"
    if type(layer) is DummyLayer:
        return "none"
    return "kv" if isinstance(layer, DynamicLayer) and not isinstance(layer, LinearAttentionCacheLayerMixin) else "?"
