"""The one copy of the base model, its tokenizer and every run's LoRA adapters.

Inference and training share these weights. A single lock serialises forward passes: the engine
holds it for one decode step, the trainer for one micro-batch, so they interleave instead of
racing on peft's adapter state. Each served policy is a frozen adapter snapshot (`run@step`);
the trainer only ever changes its own working adapter, so a request that started decoding on a
step finishes on that step's weights.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from server.chat.render import Renderer, SampledTurn, assistant_turn_key

log = logging.getLogger("artisan.model")
BASE = "__base__"  # peft's name for "no adapter" in a mixed batch


@dataclass(frozen=True)
class Policy:
    """What a request's `model` resolved to."""

    name: str  # the name a client used (base name, run or run@step)
    adapter: str | None  # peft adapter name, None for the base model
    run: str | None
    step: int


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(device)


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


class TurnCache:
    """Assistant turns this server sampled, by what a client echoes back (content + tool calls).
    Lets a later request's prompt contain the exact sampled ids instead of a re-tokenization."""

    def __init__(self, capacity: int = 200_000):
        self.capacity = capacity
        self._items: OrderedDict[str, tuple[int, ...]] = OrderedDict()
        self._lock = threading.Lock()

    def put(self, message: dict[str, Any], token_ids: list[int]) -> None:
        key = assistant_turn_key(message)
        with self._lock:
            self._items[key] = tuple(token_ids)
            self._items.move_to_end(key)
            while len(self._items) > self.capacity:
                self._items.popitem(last=False)

    def lookup(self, message: dict[str, Any]) -> SampledTurn | None:
        ids = message.get("token_ids")  # a client may send the ids itself
        if isinstance(ids, list) and ids and all(isinstance(i, int) for i in ids):
            return SampledTurn(tuple(ids))
        with self._lock:
            found = self._items.get(assistant_turn_key(message))
        return SampledTurn(found) if found is not None else None


class ModelHost:
    def __init__(self, model_dir: str | Path, device: str = "auto", dtype: str = "auto", name: str | None = None):
        self.model_dir = Path(model_dir)
        self.device = pick_device(device)
        self.dtype = pick_dtype(dtype, self.device)
        self.tokenizer = AutoTokenizer.from_pretrained(self.model_dir)
        model = AutoModelForCausalLM.from_pretrained(self.model_dir, dtype=self.dtype)
        model.to(self.device).eval()
        for p in model.parameters():
            p.requires_grad_(False)
        self.base_model = model
        self.model: Any = model  # becomes a PeftModel when the first adapter is added
        self.config = model.config
        self.name = name or _model_name(self.model_dir)
        self.renderer = Renderer(self.tokenizer)
        self.turns = TurnCache()
        self.lock = threading.RLock()
        self.context_window = int(getattr(self.config, "max_position_embeddings", 4096))
        self.eos_ids = sorted({i for i in [self.tokenizer.eos_token_id, self.renderer.im_end_id,
                                            self.tokenizer.convert_tokens_to_ids("<|endoftext|>")]
                               if isinstance(i, int) and i >= 0})
        self.fingerprint = self._fingerprint()
        self.policies: dict[str, Policy] = {}  # served names -> policy (runs register theirs)
        self.n_params = sum(p.numel() for p in model.parameters())
        self.adapters_in_use: Callable[[], set[str]] = set  # the engine installs its own probe

    def _fingerprint(self) -> str:
        """Identifies base weights + tokenizer, so a choice sampled from another model is refused."""
        h = hashlib.sha256()
        h.update(json.dumps(self.tokenizer.get_vocab(), sort_keys=True).encode())
        h.update(json.dumps(self.config.to_dict(), sort_keys=True, default=str).encode())
        emb = self.base_model.get_input_embeddings().weight
        h.update(emb[: min(8, emb.shape[0])].float().cpu().numpy().tobytes())
        return h.hexdigest()[:16]

    # ---- adapters -------------------------------------------------------------------------
    @property
    def has_adapters(self) -> bool:
        return self.model is not self.base_model

    def add_adapter(self, adapter: str, lora_config: Any, state: dict[str, torch.Tensor] | None = None) -> None:
        """Create adapter `adapter` (optionally with weights). Call with `lock` held."""
        from peft import PeftModel, get_peft_model, set_peft_model_state_dict

        if not isinstance(self.model, PeftModel):
            self.model = get_peft_model(self.base_model, lora_config, adapter_name=adapter)
            self.model.eval()  # peft refuses mixed-adapter batches in training mode; no dropout anyway
        else:
            self.model.add_adapter(adapter, lora_config)
        if state is not None:
            set_peft_model_state_dict(self.model, state, adapter_name=adapter)
        for name, p in self.model.named_parameters():
            if f".{adapter}." in name:
                p.requires_grad_(False)

    def adapter_state(self, adapter: str) -> dict[str, torch.Tensor]:
        from peft import get_peft_model_state_dict

        return {k: v.detach().clone() for k, v in get_peft_model_state_dict(self.model, adapter_name=adapter).items()}

    def delete_adapter(self, adapter: str) -> None:
        with self.lock:
            if self.has_adapters and adapter in self.model.peft_config:
                self.model.delete_adapter(adapter)

    def adapter_params(self, adapter: str) -> list[torch.nn.Parameter]:
        return [p for n, p in self.model.named_parameters() if f".{adapter}." in n and "lora_" in n]

    # ---- serving names -----------------------------------------------------------------------
    def register_policy(self, name: str, policy: Policy) -> None:
        self.policies[name] = policy

    def unregister_policy(self, name: str) -> None:
        self.policies.pop(name, None)

    def resolve(self, model: str) -> Policy | None:
        if model == self.name or model == str(self.model_dir):
            return Policy(self.name, None, None, 0)
        return self.policies.get(model)

    def served_names(self) -> list[str]:
        return [self.name] + sorted(self.policies)

    # ---- forward ---------------------------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, adapters: list[str | None], **kwargs) -> Any:
        """A forward pass where each row uses its own adapter (None = base). Call with `lock` held."""
        if not self.has_adapters:
            return self.model(input_ids=input_ids, **kwargs)
        names = [a if a is not None else BASE for a in adapters]
        return self.model(input_ids=input_ids, adapter_names=names, **kwargs)


def _model_name(model_dir: Path) -> str:
    meta = model_dir / "artisan.json"
    if meta.exists():
        return json.loads(meta.read_text()).get("name", model_dir.name)
    return re.sub(r"[^A-Za-z0-9._-]", "-", model_dir.name)
