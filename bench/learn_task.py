"""The reasoning-gym task both trainers of bench/learn.py see: rows, chat prompt, reward.

One module so that artisan's rollouts and TRL's GRPOTrainer are given the same questions in the
same messages and scored by the same function: reasoning-gym's own `score_answer` for the
dataset, on the reply's last `<answer>` if it wrote one, else on the stripped reply (as the
verifiers taskset in environments/reasoning_gym_env scores it). No torch here.
"""

from __future__ import annotations

import functools
from typing import Any

import reasoning_gym

from rewards.reasoning_gym import score_reply

# Easy settings of reasoning-gym datasets; `bench/learn_base_rates.py` measures SmolLM2 on each.
SETTINGS: dict[str, dict[str, Any]] = {
    "basic_arithmetic": dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1, operators=("+", "-"),
                             allow_parentheses=False, allow_negation=False),
    "chain_sum": dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1),
    "products": dict(min_terms=2, max_terms=2, min_digits=1, max_digits=1),
    "spell_backward": dict(min_word_len=3, max_word_len=4),
    "gcd": dict(min_value=1, max_value=20),
    "lcm": dict(min_value=1, max_value=10),
    "leg_counting": dict(min_animals=1, max_animals=1, min_instances=1, max_instances=2),
    "count_bits": dict(min_n=1, max_n=16),
    "letter_counting": dict(min_words=3, max_words=5),
}

# System prompts that ask for the bare answer (reasoning-gym's own "direct" prompt asks for
# <answer> tags, which SmolLM2-135M ignores: it answers in sentences).
# Each is (system prompt, text appended to the question); the user-turn variants repeat the
# instruction where a small chat model attends to it most.
PROMPTS: dict[str, tuple[str, str]] = {
    "number": ("Answer with only the number.", ""),
    "final": ("Reply with only the final answer, nothing else.", ""),
    "user_number": ("Answer with only the number.", "\nAnswer with only the number."),
    "user_final": ("Reply with only the final answer, nothing else.", "\nReply with only the final answer, nothing else."),
    # Two solved questions of the same dataset as earlier chat turns: the model copies their form.
    "fewshot": ("Answer with only the final answer.", ""),
}
FEWSHOT_SEED, FEWSHOT_N = 99_999, 2

TASK, PROMPT = "chain_sum", "fewshot"  # chosen by measuring: see bench/learn_base_rates.py
TRAIN_SEED, EVAL_SEED = 0, 10_000  # disjoint seeds: the held-out rows are other questions


def rows(task: str, size: int, seed: int) -> list[dict[str, Any]]:
    return list(reasoning_gym.create_dataset(task, size=size, seed=seed, **SETTINGS[task]))


def messages(row: dict[str, Any], prompt: str) -> list[dict[str, str]]:
    system, suffix = PROMPTS[prompt]
    shots = []
    if prompt == "fewshot":
        shots = list(_shots(row["metadata"]["source_dataset"]))
    return [{"role": "system", "content": system}, *shots, {"role": "user", "content": row["question"] + suffix}]


@functools.cache
def _shots(task: str) -> tuple[dict[str, str], ...]:
    return tuple(m for ex in rows(task, FEWSHOT_N, FEWSHOT_SEED)
                 for m in ({"role": "user", "content": ex["question"]}, {"role": "assistant", "content": str(ex["answer"])}))


score = score_reply  # reasoning-gym's own score_answer (rewards/reasoning_gym.py)