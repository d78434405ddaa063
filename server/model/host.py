"""The one copy of the base model, its tokenizer and chat format, and every run's LoRA adapters.

Inference and training share these weights. A single lock serialises forward passes: the engine
holds it for one decode step, the trainer for one micro-batch, so they interleave instead of
racing on peft's adapter state. Everything model-specific (context window, stop tokens, dtype,
LoRA target modules, chat format) is read from the model itself, not from a table of families.
"""

from __future__ import annotations

import hashlib
import json
import logging
import re
import threading
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

import torch
from transformers import MODEL_FOR_CAUSAL_LM_MAPPING, AutoConfig, AutoModelForCausalLM, AutoTokenizer, GenerationConfig

from server.chat.format import ChatFormat
from server.chat.template import TemplateError
from server.log_limits import one_line
from server.model import decode_copy, decode_pass
from server.model.architecture import (ModelRefused, head_mismatch, linear_modules, linear_shapes, lora_targets,
                                       outside_decoder, takes_tree_mask)
from server.model.memory import GB
from server.model.source import resolve, served_name
from server.settings import Settings

log = logging.getLogger("artisan.model")
BASE = "__base__"  # peft's name for "no adapter" in a mixed batch


@dataclass(frozen=True)
class ChatOptions:
    """How to read the model's chat format; None/auto: from the template itself."""

    template: str | None = None  # Jinja source (`--chat-template`)
    tool_call_parser: str = "auto"
    reasoning_parser: str = "auto"
    template_kwargs: dict[str, Any] | None = None
    stop_tokens: tuple[str, ...] = ()  # `--stop-token`: texts of tokens that also end a generation


class DeviceError(SystemExit):
    """`--device` names a device this machine does not have."""


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device != "cpu" and not re.fullmatch(r"cuda(:\d+)?", device):
        raise DeviceError(f"--device {device}: expected auto, cpu, cuda or cuda:N")
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            raise DeviceError("CUDA is not available on this machine; use --device cpu")
        index = int(device.partition(":")[2] or 0)
        if index >= torch.cuda.device_count():
            raise DeviceError(f"--device {device}: this machine has {torch.cuda.device_count()} CUDA device(s)")
    return torch.device(device)


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[dtype]


def stop_ids_of(model_dir: Path, config: Any) -> list[int]:
    """EOS ids from the generation config (Llama 3 lists several) and the model config."""
    ids: list[Any] = []
    try:
        ids.append(GenerationConfig.from_pretrained(model_dir).eos_token_id)
    except OSError:
        pass
    ids.append(getattr(config, "eos_token_id", None))
    flat = [i for x in ids for i in (x if isinstance(x, list) else [x])]
    return sorted({i for i in flat if isinstance(i, int) and i >= 0})


def base_fingerprint(model: torch.nn.Module, config: Any) -> str:
    """What a run's checkpoints depend on: the architecture and every parameter's name and shape.
    No weight is read, so it costs nothing and stays the same across devices, dtypes, paths and a
    GGUF's conversion of the same model; two models that differ in any shape differ here."""
    h = hashlib.sha256(str(getattr(config, "model_type", "")).encode())
    for name, p in model.named_parameters():
        h.update(f";{name}:{tuple(p.shape)}".encode())
    return h.hexdigest()[:16]


def context_window(config: Any) -> int:
    """The longest sequence the model takes: prompt and completion, as both engines bound them."""
    return int(getattr(config, "max_position_embeddings", None) or 4096)


class ModelHost:
    def __init__(self, model_dir: str | Path, device: str = "auto", dtype: str = "auto", name: str | None = None,
                 chat: ChatOptions = ChatOptions(), aliases: tuple[str, ...] = ()):
        self.model_dir = Path(model_dir)
        self.device = pick_device(device)
        self.dtype = pick_dtype(dtype, self.device)
        self.tokenizer, model = _load(self.model_dir, self.dtype)
        model.to(self.device).eval()
        for p in model.parameters():
            p.requires_grad_(False)
        self.base_model = model
        self.model: Any = model  # becomes a PeftModel when the first adapter is added
        # The language model's config: a multimodal checkpoint (Gemma 4's) nests it, and what serving and
        # training read of a config (the window, sizes, a sliding window) is the language model's.
        self.config = model.config.get_text_config()
        card = _model_card(self.model_dir)
        own_name = _model_name(self.model_dir, card)
        self.name = name or own_name
        # a learning rate measured for this model (server/training/hyperparams.py), None for most
        self.measured_learning_rate: float | None = card.get("learning_rate")
        self.aliases = {self.name, str(self.model_dir), own_name, *aliases,
                        *([model.config.name_or_path] if getattr(model.config, "name_or_path", None) else [])}
        self.chat = ChatFormat.build(self.tokenizer, chat.template, chat.tool_call_parser, chat.reasoning_parser,
                                     stop_ids_of(self.model_dir, self.config), chat.template_kwargs, chat.stop_tokens)
        self.lock = threading.RLock()
        self.context_window = context_window(self.config)
        self.lora_targets = lora_targets(model)
        self.lora_excluded = outside_decoder(model, self.lora_targets)  # what shares their names outside the decoder
        mismatch = head_mismatch(model)  # None: a step scores tokens as the forward that sampled them
        self.untrainable = mismatch and f"{self.name} ({model.config.model_type}) cannot train runs here: {mismatch}"
        self.takes_tree_mask = takes_tree_mask(model)  # whether a row may hold sequences that share a prefix
        self.linear_shapes = linear_shapes(model)
        self.linear_modules = linear_modules(model)
        self.fingerprint = self._fingerprint()
        self.base_fingerprint = base_fingerprint(model, model.config)  # which runs are this model's
        self.n_params = sum(p.numel() for p in model.parameters())
        self.gradient_checkpointing = False
        self.share_prefix = False  # train sequences that share a prefix in one row (server/training/packing.py)
        self.memory_budget: int | None = None  # bytes training may take the process to (None: what the machine has)
        self.exact_decode_pass = decode_pass.applies(model)  # redecided as adapters come and go

    @property
    def vocab_size(self) -> int:
        return max(len(self.tokenizer), int(getattr(self.config, "vocab_size", 0) or 0))

    def _fingerprint(self) -> str:
        """Identifies base weights + tokenizer, so a choice sampled from another model is refused."""
        h = hashlib.sha256()
        h.update(json.dumps(self.tokenizer.get_vocab(), sort_keys=True).encode())
        h.update(json.dumps(self.base_model.config.to_dict(), sort_keys=True, default=str).encode())
        emb = self.base_model.get_input_embeddings().weight
        h.update(emb[: min(8, emb.shape[0])].float().cpu().numpy().tobytes())
        return h.hexdigest()[:16]

    # ---- adapters (call with `lock` held) ------------------------------------------------------
    @property
    def has_adapters(self) -> bool:
        return self.model is not self.base_model and bool(self.model.peft_config)

    def add_adapter(self, adapter: str, lora_config: Any, state: dict[str, torch.Tensor] | None = None) -> None:
        from peft import PeftModel, get_peft_model, set_peft_model_state_dict

        if not isinstance(self.model, PeftModel):
            self.model = get_peft_model(self.base_model, lora_config, adapter_name=adapter)
            self.model.eval()  # peft refuses mixed-adapter batches in training mode; no dropout anyway
        else:
            self.model.add_adapter(adapter, lora_config)
            if self.model.active_adapter not in self.model.peft_config:  # the last one was deleted
                self.model.set_adapter(adapter)
        if state is not None:
            set_peft_model_state_dict(self.model, state, adapter_name=adapter)
        for p in self.adapter_params(adapter):
            p.requires_grad_(False)
        self.exact_decode_pass = decode_pass.applies(self.base_model)

    def load_adapter_state(self, adapter: str, state: dict[str, torch.Tensor]) -> None:
        from peft import set_peft_model_state_dict

        set_peft_model_state_dict(self.model, state, adapter_name=adapter)

    def adapter_state(self, adapter: str) -> dict[str, torch.Tensor]:
        from peft import get_peft_model_state_dict

        return {k: v.detach().clone() for k, v in get_peft_model_state_dict(self.model, adapter_name=adapter).items()}

    def delete_adapter(self, adapter: str) -> None:
        if self.has_adapters and adapter in self.model.peft_config:
            self.model.delete_adapter(adapter)
            self.exact_decode_pass = decode_pass.applies(self.base_model)

    def adapter_params(self, adapter: str) -> list[torch.nn.Parameter]:
        return [p for n, p in self.model.named_parameters() if f".{adapter}." in n and "lora_" in n]

    # ---- forward (call with `lock` held) -------------------------------------------------------
    def forward(self, input_ids: torch.Tensor, adapters: list[str | None], **kwargs) -> Any:
        """A forward pass where each row uses its own adapter (None = base)."""
        if not self.has_adapters:
            # Not through peft once its last adapter is deleted: it still names that one active, and
            # fails; the wrapped layers without an adapter are the base model's.
            return self.base_model(input_ids=input_ids, **kwargs)
        names = [a if a is not None else BASE for a in adapters]
        return self.model(input_ids=input_ids, adapter_names=names, **kwargs)

    def decode(self, input_ids: torch.Tensor, adapters: list[str | None], **kwargs) -> Any:
        """The engine's pass: `forward`, a row multiplied by the transposed weights where `load_model`
        copied them (server/model/decode_copy.py); every other pass multiplies as training does."""
        with decode_copy.decoding():
            return self.forward(input_ids, adapters, **kwargs)

    def decode_step(self, input_ids: torch.Tensor, adapters: list[str | None], cache: Any,
                    attention_mask: torch.Tensor, position_ids: torch.Tensor) -> torch.Tensor:
        """The engine's decode step, one new token per row: next-token logits [rows, vocab], bitwise
        `decode`'s, through server/model/decode_pass.py where it knows the model."""
        unknown = self.has_adapters and any(a is not None and a not in self.model.peft_config for a in adapters)
        if not self.exact_decode_pass or unknown:  # the forward, and peft's refusal of an adapter it does not hold
            return self.decode(input_ids, adapters, past_key_values=cache, use_cache=True,
                               attention_mask=attention_mask, position_ids=position_ids).logits[:, -1, :]
        with decode_copy.decoding():
            return decode_pass.decode_logits(self.base_model, input_ids, adapters, cache, attention_mask,
                                             position_ids)[:, -1, :]

    @contextmanager
    def training_forward(self) -> Iterator[None]:
        """A trainer forward pass. Gradient checkpointing, when asked for, only runs in train mode,
        so the model switches mode for the pass (nothing in it drops out)."""
        if not self.gradient_checkpointing:
            yield
            return
        self.base_model.train()
        try:
            yield
        finally:
            self.base_model.eval()

    def enable_gradient_checkpointing(self) -> None:
        self.base_model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
        self.gradient_checkpointing = True


def _load(model_dir: Path, dtype: torch.dtype) -> tuple[Any, Any]:
    """The tokenizer and the causal LM in `model_dir`, or one line that says why not (missing or
    damaged weights, an encoder-decoder): nothing could be served, and a traceback tells a user less."""
    try:
        config = AutoConfig.from_pretrained(model_dir)
        if type(config) not in MODEL_FOR_CAUSAL_LM_MAPPING:  # transformers' refusal lists 200 classes
            raise ModelRefused(f"error: {model_dir.name} is a {config.model_type} model, which transformers does "
                               f"not load as a causal language model: art-server serves decoder-only models")
        return AutoTokenizer.from_pretrained(model_dir), AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype)
    except ModelRefused:
        raise
    except Exception as e:  # noqa: BLE001 - whatever stops the load, the server cannot start
        log.debug("loading %s failed", model_dir, exc_info=True)
        raise ModelRefused(f"error: {model_dir.name} could not be loaded: {one_line(e)}") from None


def _model_card(model_dir: Path) -> dict[str, Any]:
    """artisan.json: what artisan knows of a model it built (its name, a learning rate measured for it)."""
    meta = model_dir / "artisan.json"
    return json.loads(meta.read_text()) if meta.exists() else {}


def _model_name(model_dir: Path, card: dict[str, Any]) -> str:
    return card.get("name") or re.sub(r"[^A-Za-z0-9._-]", "-", model_dir.name)


def load_model(settings: Settings) -> ModelHost:
    model_dir = resolve(settings.model, settings.cache_dir / "models")
    template = settings.chat_template.read_text() if settings.chat_template else None
    chat = ChatOptions(template, settings.tool_call_parser, settings.reasoning_parser, settings.chat_template_kwargs,
                       tuple(settings.stop_token))
    names = settings.served_model_name
    try:
        host = ModelHost(model_dir, device=settings.device, dtype=settings.dtype,
                         name=names[0] if names else served_name(settings.model), chat=chat,
                         aliases=(settings.model, *names))
    except TemplateError as e:  # nothing could be served: said in one line, as a bad option is
        raise ModelRefused(f"error: {model_dir.name}: {e}") from None
    if settings.gradient_checkpointing:
        host.enable_gradient_checkpointing()
    host.share_prefix = settings.share_prefix
    if settings.decode_copy and settings.engine == "torch" and host.device.type == "cpu":
        copied = decode_copy.copy_for_decode(host.base_model)
        log.info("a transposed copy of the linear weights decodes one row: %.0f MB", copied / 2**20)
    if settings.memory_budget is not None:
        host.memory_budget = int(settings.memory_budget * GB)
    _warn_unrendered_tools(host, settings)
    if host.untrainable:
        log.warning("%s; it serves, and creating a run gets a 400", host.untrainable)
    return host


def _warn_unrendered_tools(host: ModelHost, settings: Settings) -> None:
    if host.chat.template.renders_tools:
        return
    if settings.allow_unrendered_tools:
        log.warning("%s's chat template does not render tools; --allow-unrendered-tools: requests with tools are "
                    "served and the model never sees them", host.name)
    else:
        log.warning("%s's chat template does not render tools: requests with tools get a 400; pass --chat-template "
                    "FILE (a template that renders tools), or --allow-unrendered-tools", host.name)
