"""Tiny stand-ins for the model families people train: each family's real chat template (kept as
test data in tests/data/templates) on a small byte-level tokenizer that has the family's special
tokens, and a random-weight model of the family's architecture. Rendering, splicing and parsing
depend on the template and the special tokens, not on the vocabulary's size or the weights.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

from tests.real_models import TEMPLATES


@dataclass(frozen=True)
class Family:
    name: str
    template: str  # file in tests/data/templates
    architecture: str  # transformers config class
    special: tuple[str, ...]  # control tokens (dropped from visible text)
    added: tuple[str, ...] = ()  # plain added tokens (kept in text, as Qwen's tool and think tags are)
    bos: str | None = None
    eos: str = ""
    stops: tuple[str, ...] = ()  # other tokens the model's generation config ends a turn on
    config: dict = field(default_factory=dict)


QWEN_SPECIAL = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
QWEN_ADDED = ("<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>", "<think>", "</think>")

FAMILIES = {
    "qwen2_5": Family("qwen2_5", "qwen2_5.jinja", "Qwen2Config", QWEN_SPECIAL, QWEN_ADDED, eos="<|im_end|>"),
    "qwen3": Family("qwen3", "qwen3.jinja", "Qwen3Config", QWEN_SPECIAL, QWEN_ADDED, eos="<|im_end|>"),
    "llama3_1": Family("llama3_1", "llama3_1.jinja", "LlamaConfig",
                       ("<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
                        "<|eot_id|>", "<|eom_id|>", "<|python_tag|>"), bos="<|begin_of_text|>", eos="<|eot_id|>"),
    "mistral_v0_3": Family("mistral_v0_3", "mistral_v0_3.jinja", "MistralConfig",
                           ("<unk>", "<s>", "</s>", "[INST]", "[/INST]", "[TOOL_CALLS]", "[AVAILABLE_TOOLS]",
                            "[/AVAILABLE_TOOLS]", "[TOOL_RESULTS]", "[/TOOL_RESULTS]"), bos="<s>", eos="</s>"),
    "gemma3": Family("gemma3", "gemma3.jinja", "Gemma3TextConfig",
                     ("<pad>", "<eos>", "<bos>", "<start_of_turn>", "<end_of_turn>"), bos="<bos>", eos="<eos>",
                     config={"head_dim": 16, "query_pre_attn_scalar": 16, "sliding_window": 16}),
    "gpt_oss": Family("gpt_oss", "gpt_oss.jinja", "GptOssConfig",
                      ("<|startoftext|>", "<|endoftext|>", "<|start|>", "<|end|>", "<|message|>", "<|channel|>",
                       "<|constrain|>", "<|return|>", "<|call|>"), eos="<|return|>", stops=("<|call|>",)),
    "smollm2": Family("smollm2", "smollm2.jinja", "LlamaConfig", ("<|endoftext|>", "<|im_start|>", "<|im_end|>"),
                      eos="<|im_end|>"),
    # Formats that write each argument apart, on their models' architectures (GLM-4.5's MoE on Qwen2's).
    "qwen3_5": Family("qwen3_5", "qwen3_5.jinja", "Qwen3_5TextConfig", QWEN_SPECIAL, QWEN_ADDED, eos="<|im_end|>",
                      config={"layer_types": ["linear_attention", "full_attention"], "head_dim": 16,
                              "linear_num_key_heads": 2, "linear_num_value_heads": 4, "linear_key_head_dim": 16,
                              "linear_value_head_dim": 16}),
    "gemma4": Family("gemma4", "gemma4.jinja", "Gemma4TextConfig",
                     ("<pad>", "<eos>", "<bos>", "<|turn>", "<turn|>", "<|tool_call>", "<tool_call|>", '<|"|>',
                      "<|tool_response>", "<tool_response|>", "<|channel>", "<channel|>", "<|tool>", "<tool|>",
                      "<|think|>"), bos="<bos>", eos="<turn|>", stops=("<|tool_response>",),
                     config={"head_dim": 16, "global_head_dim": 16, "sliding_window": 16,
                             "layer_types": ["sliding_attention", "full_attention"]}),
    "glm4_5": Family("glm4_5", "glm4_5.jinja", "Qwen2Config",
                     ("<|endoftext|>", "[gMASK]", "<sop>", "<|system|>", "<|user|>", "<|assistant|>",
                      "<|observation|>"),
                     ("<tool_call>", "</tool_call>", "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>",
                      "<think>", "</think>", "<tool_response>", "</tool_response>"), eos="<|user|>",
                     stops=("<|observation|>",)),
    "lfm2_5": Family("lfm2_5", "lfm2_5.jinja", "Lfm2Config",
                     ("<|pad|>", "<|startoftext|>", "<|im_start|>", "<|im_end|>", "<|tool_call_start|>",
                      "<|tool_call_end|>"), ("<think>", "</think>"), bos="<|startoftext|>", eos="<|im_end|>",
                     config={"layer_types": ["conv", "full_attention"]}),
}

_TEXT = [
    "The weather in Paris is 21 degrees today.", "Let me look that up for you.", "What is the capital of France?",
    'get_weather {"city": "Paris", "unit": "celsius"}', "Réserver une table pour deux ce soir à 20h.",
    "I need to think about this step by step.", "The answer is 42, because six times seven is 42.",
    "Tools: functions with JSON arguments, results and calls.", "{{ looks like jinja }} but is text",
]


@lru_cache(maxsize=None)
def tokenizer_dir(name: str, root: Path) -> Path:
    """A byte-level BPE with the family's special tokens and template, saved as transformers loads it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    fam = FAMILIES[name]
    out = root / f"tok-{name}"
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=600, special_tokens=list(fam.special),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    tok.train_from_iterator(_TEXT * 20, trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token=fam.eos, bos_token=fam.bos,
                                   pad_token=fam.special[0])
    fast.add_tokens(list(fam.added))
    fast.chat_template = (TEMPLATES / fam.template).read_text()
    fast.save_pretrained(out)
    return out


def family_format(name: str, root: Path) -> Any:
    """The family's ChatFormat as a served model of it builds one: its template, and the stop ids its
    generation config adds (gpt-oss's <|call|>, GLM's <|observation|>)."""
    from transformers import AutoTokenizer

    from server.chat.format import ChatFormat

    tok, fam = AutoTokenizer.from_pretrained(tokenizer_dir(name, root)), FAMILIES[name]
    return ChatFormat.build(tok, eos_ids=tok.convert_tokens_to_ids([fam.eos, *fam.stops]))


def written_turn(chat: Any, prompt: list[dict], conversation: list[dict], tools: list[dict]) -> list[int]:
    """The ids the template writes for the assistant turn that follows `prompt` in `conversation`,
    as a model samples them: up to and including the turn's stop token."""
    text = chat.template.render(conversation, tools, True)[len(chat.template.render(prompt, tools, True)):]
    ids = chat.renderer.encode(text)
    return ids[: next(k for k, i in enumerate(ids) if i in chat.stop_ids) + 1]


def tiny_model_dir(name: str, root: Path) -> Path:
    """A random-weight model of the family's architecture, with its tokenizer and template."""
    fam = FAMILIES[name]
    return _tiny_model(root / f"model-{name}", tokenizer_dir(name, root), fam.architecture, fam.eos, name,
                       {"num_key_value_heads": 2, **fam.config}, fam.stops)


def tiny_architecture_dir(architecture: str, root: Path, **config) -> Path:
    """A random-weight model of a transformers architecture no family here names (`GPT2Config`,
    `Qwen2MoeConfig`), on SmolLM2's tokenizer and ChatML template: what the server reads of the model
    itself, not of its chat format. `config`: the architecture's own fields (heads, experts, scales)."""
    name = architecture.removesuffix("Config").lower()
    return _tiny_model(root / f"model-{name}", tokenizer_dir("smollm2", root), architecture, "<|im_end|>", name,
                       config)


def tiny_gemma4_vlm_dir(root: Path) -> Path:
    """Gemma 4 as its checkpoints are: Gemma4ForConditionalGeneration, a vision tower beside the
    language model (whose projections share the decoder's names), and the language model's settings
    (its sliding window among them) nested in `text_config`; on the gemma4 family's tokenizer."""
    import torch
    import transformers

    out = root / "model-gemma4-vlm"
    if (out / "config.json").exists():
        return out
    tok = transformers.AutoTokenizer.from_pretrained(tokenizer_dir("gemma4", root))
    text = dict(vocab_size=len(tok), vocab_size_per_layer_input=len(tok), hidden_size=64,
                hidden_size_per_layer_input=16, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, global_head_dim=16, sliding_window=16,
                layer_types=["sliding_attention", "full_attention"],
                eos_token_id=tok.convert_tokens_to_ids("<turn|>"), pad_token_id=tok.pad_token_id)
    vision = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                  num_key_value_heads=2, head_dim=16, position_embedding_size=64)
    torch.manual_seed(0)
    model = transformers.Gemma4ForConditionalGeneration(
        transformers.Gemma4Config(text_config=text, vision_config=vision, audio_config=None))
    model.generation_config.eos_token_id = tok.convert_tokens_to_ids(["<turn|>", "<|tool_response>"])
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "artisan.json").write_text(json.dumps({"name": "gemma4-vlm"}))
    return out


def _tiny_model(out: Path, tok_dir: Path, architecture: str, eos: str, name: str, config: dict,
                stops: tuple[str, ...] = ()) -> Path:
    import torch
    import transformers

    if (out / "config.json").exists():
        return out
    tok = transformers.AutoTokenizer.from_pretrained(tok_dir)
    config = getattr(transformers, architecture)(
        vocab_size=len(tok), hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        max_position_embeddings=2048, tie_word_embeddings=True, eos_token_id=tok.convert_tokens_to_ids(eos),
        pad_token_id=tok.pad_token_id, bos_token_id=tok.bos_token_id, **config)
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(config)
    if stops:
        model.generation_config.eos_token_id = [config.eos_token_id, *tok.convert_tokens_to_ids(list(stops))]
    model.save_pretrained(out)
    tok.save_pretrained(out)
    (out / "artisan.json").write_text(json.dumps({"name": name}))
    return out
