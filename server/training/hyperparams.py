"""Default learning rate for a LoRA, derived from the base model instead of hard-coded.

A fixed 1e-6 was 280-470x too low for 4B-8B LoRAs in the Tinker SWE-bench post-mortem. We use
tinker-cookbook's fit, lr = 5e-5 * 10 (LoRA) * (2000 / hidden_size) ** exponent, whose exponent
depends on the family: 0.781 for Llama, 0.0775 for Qwen. Mistral is fitted as the Llama it is
built on; families the fit does not cover (Gemma, gpt-oss) get the flatter Qwen curve. Pass
`learning_rate` to override.

The steep Llama curve is not extrapolated below the smallest model it was fitted on (Llama 3.2 1B,
hidden size 2048): for SmolLM2-135M (hidden 576) it would give 1.3e-3, at which GRPO on
bench/learn.py's task took held-out accuracy from 0.109 to 0.031 in 8 steps, where 4.9e-4 (the
value at 2048) took it to 0.398.

A model can carry a learning rate measured for it in its artisan.json (`learning_rate`), which wins
over the fit. The embedded model does: at 3.3M parameters it is 150x below the fit's smallest model,
and the fit's 5.9e-4 barely moved it: the Quick start's 3 steps of 8 x 8 changed held-out reward by
+0.03 on average over seeds 0-4 and five unseeded runs, 4 of the 10 down, where 2e-3 raised it by
0.34-0.59 on each of seeds 0-4, and held 0.88-0.94 over 16 steps (seeds 0-2).
"""

from __future__ import annotations

from typing import Any

BASE_LR = 5e-5
LORA_MULTIPLIER = 10.0
LLAMA_EXPONENT = 0.781
QWEN_EXPONENT = 0.0775
EXPONENT_BY_FAMILY = {"llama": LLAMA_EXPONENT, "mistral": LLAMA_EXPONENT, "qwen2": QWEN_EXPONENT,
                      "qwen3": QWEN_EXPONENT, "qwen3_moe": QWEN_EXPONENT}
SMALLEST_FITTED_HIDDEN = {LLAMA_EXPONENT: 2048}  # Llama 3.2 1B


def learning_rate_for(hidden_size: int, family: str) -> float:
    exponent = EXPONENT_BY_FAMILY.get(family, QWEN_EXPONENT)
    hidden_size = max(hidden_size, SMALLEST_FITTED_HIDDEN.get(exponent, 0))
    return BASE_LR * LORA_MULTIPLIER * (2000 / hidden_size) ** exponent


def default_learning_rate(host: Any) -> float:
    """What a job that names no learning rate trains `host`'s LoRAs at: its measured rate, or the fit."""
    if host.measured_learning_rate is not None:
        return float(host.measured_learning_rate)
    config = host.config
    text = getattr(config, "text_config", None) or config  # multimodal configs nest the language model's
    return learning_rate_for(int(text.hidden_size), str(getattr(config, "model_type", "")))
