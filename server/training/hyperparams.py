"""Default learning rate for a LoRA, derived from the base model instead of hard-coded.

A fixed 1e-6 was 280-470x too low for 4B-8B LoRAs in the Tinker SWE-bench post-mortem. We use
Tinker's fit: lr = 5e-5 * 10 (LoRA) * (2000 / hidden_size) ** 0.0775 for Qwen-family models,
i.e. about 4.7e-4 at hidden size 2560 and 5.9e-4 at 256. Pass `learning_rate` to override.
"""

from __future__ import annotations

BASE_LR = 5e-5
LORA_MULTIPLIER = 10.0
HIDDEN_EXPONENT = 0.0775


def default_learning_rate(hidden_size: int) -> float:
    return BASE_LR * LORA_MULTIPLIER * (2000 / hidden_size) ** HIDDEN_EXPONENT
