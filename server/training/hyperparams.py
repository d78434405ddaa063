"""Default learning rate for a LoRA, derived from the base model instead of hard-coded.

A fixed 1e-6 was 280-470x too low for 4B-8B LoRAs in the Tinker SWE-bench post-mortem. We use
tinker-cookbook's fit, lr = 5e-5 * 10 (LoRA) * (2000 / hidden_size) ** exponent, whose exponent
depends on the family: 0.781 for Llama, 0.0775 for Qwen. Mistral is fitted as the Llama it is
built on; families the fit does not cover (Gemma, gpt-oss) get the flatter Qwen curve. Pass
`learning_rate` to override.
"""

from __future__ import annotations

from typing import Any

BASE_LR = 5e-5
LORA_MULTIPLIER = 10.0
LLAMA_EXPONENT = 0.781
QWEN_EXPONENT = 0.0775
EXPONENT_BY_FAMILY = {"llama": LLAMA_EXPONENT, "mistral": LLAMA_EXPONENT, "qwen2": QWEN_EXPONENT,
                      "qwen3": QWEN_EXPONENT, "qwen3_moe": QWEN_EXPONENT}


def learning_rate_for(hidden_size: int, family: str) -> float:
    exponent = EXPONENT_BY_FAMILY.get(family, QWEN_EXPONENT)
    return BASE_LR * LORA_MULTIPLIER * (2000 / hidden_size) ** exponent


def default_learning_rate(config: Any) -> float:
    text = getattr(config, "text_config", None) or config  # multimodal configs nest the language model's
    return learning_rate_for(int(text.hidden_size), str(getattr(config, "model_type", "")))
