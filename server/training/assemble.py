"""Trajectories -> token sequences with a loss mask and the sampler's logprobs (invariant 1).

Each Choice's prompt is rebuilt with the same renderer the server sampled with, splicing every
earlier sampled turn in as its exact ids, and checked against the fingerprint the sampler
recorded. A choice whose prompt cannot be reproduced is not trained on (its tokens stay in the
context of later turns) and is counted. Consecutive turns whose prompts extend each other share
one sequence, so a multi-turn rollout costs one forward pass, not one per turn.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

from openai.types.chat.chat_completion import Choice

from client.types import Trajectory, choice_logprobs, choice_sampling, choice_token_ids
from server.chat.render import RenderError, fingerprint


class AssemblyError(ValueError):
    """A submitted trajectory is invalid for this model (maps to a 400, nothing is trained)."""


@dataclass
class TrainSequence:
    ids: list[int] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)  # True exactly on sampled, trained tokens
    old_logprobs: list[float] = field(default_factory=list)
    temperatures: list[float] = field(default_factory=list)
    advantage: float = 0.0
    weight: float = 1.0  # per-sequence weight (advantage-weighted SFT)
    group: int = 0

    @property
    def n_loss_tokens(self) -> int:
        return sum(self.mask)

    def extend(self, ids: list[int], trained: bool, logprobs: list[float] | None = None, temperature: float = 1.0):
        self.ids += ids
        self.mask += [trained] * len(ids)
        self.old_logprobs += logprobs if logprobs is not None else [0.0] * len(ids)
        self.temperatures += [temperature] * len(ids)


@dataclass
class AssemblyStats:
    choices: int = 0
    trained_choices: int = 0
    prompt_mismatches: int = 0
    truncated_choices: int = 0
    context_only_assistant_messages: int = 0
    trajectories_without_choices: int = 0
    sequences: int = 0

    def add(self, other: "AssemblyStats") -> None:
        for k in self.__dataclass_fields__:
            setattr(self, k, getattr(self, k) + getattr(other, k))


def validate_choice(choice: Choice, vocab_size: int, model_fingerprint: str, where: str) -> None:
    ids = choice_token_ids(choice)
    lps = choice_logprobs(choice)
    info = choice_sampling(choice)
    if ids is None or lps is None or info is None:
        raise AssemblyError(f"{where}: a Choice needs token_ids, logprobs.content and sampling as this server "
                            f"returns them; append the server's Choice, not a rebuilt one")
    if len(ids) != len(lps):
        raise AssemblyError(f"{where}: {len(ids)} token_ids but {len(lps)} logprobs")
    bad = [t for t in ids if not isinstance(t, int) or t < 0 or t >= vocab_size]
    if bad:
        raise AssemblyError(f"{where}: token id {bad[0]} is not valid for this model's tokenizer (size {vocab_size})")
    if any(not math.isfinite(lp) or lp > 1e-6 for lp in lps):
        raise AssemblyError(f"{where}: logprobs must be finite and <= 0")
    if info.model_fingerprint != model_fingerprint:
        raise AssemblyError(f"{where}: this choice was sampled from another model "
                            f"(fingerprint {info.model_fingerprint}, this server {model_fingerprint})")


def _as_message(item: Any) -> dict[str, Any]:
    if isinstance(item, Choice):
        msg = item.message.model_dump(exclude_none=True, exclude={"refusal", "annotations", "audio", "function_call"})
        msg["token_ids"] = choice_token_ids(item)  # spliced by the renderer's lookup
        return msg
    return item


def assemble_trajectory(
    traj: Trajectory, renderer: Any, lookup: Any, mask_truncated: bool = False
) -> tuple[list[TrainSequence], AssemblyStats]:
    stats = AssemblyStats()
    messages = [_as_message(i) for i in traj.messages_and_choices]
    stats.context_only_assistant_messages = sum(
        1 for i in traj.messages_and_choices if isinstance(i, dict) and i.get("role") == "assistant")
    sequences: list[TrainSequence] = []
    current: TrainSequence | None = None
    for idx, item in enumerate(traj.messages_and_choices):
        if not isinstance(item, Choice):
            continue
        stats.choices += 1
        info = choice_sampling(item)
        ids = choice_token_ids(item) or []
        try:
            prompt = renderer.render(messages[:idx], traj.tools, True, lookup=lookup)
        except RenderError as e:
            raise AssemblyError(f"messages before choice {idx}: {e}")
        matches = fingerprint(prompt) == info.prompt_fingerprint
        truncated = item.finish_reason == "length"
        stats.truncated_choices += truncated
        trained = matches and not (truncated and mask_truncated)
        stats.prompt_mismatches += not matches
        stats.trained_choices += trained
        if current is not None and prompt[: len(current.ids)] == current.ids:
            current.extend(prompt[len(current.ids):], trained=False)
        else:
            current = TrainSequence()
            sequences.append(current)
            current.extend(prompt, trained=False)
        current.extend(ids, trained, choice_logprobs(item), info.logprob_temperature)
    if stats.choices == 0:
        stats.trajectories_without_choices = 1
    sequences = [s for s in sequences if s.n_loss_tokens > 0]
    stats.sequences = len(sequences)
    return sequences, stats


def assemble_sft(messages: list[dict[str, Any]], tools: list[dict[str, Any]] | None, renderer: Any) -> TrainSequence:
    """A demonstration conversation: every assistant turn's tokens (through <|im_end|>) are
    trained, everything else is context."""
    seq = TrainSequence()
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        prompt = renderer.render(messages[:i], tools, True)
        full = renderer.render(messages[: i + 1], tools, False)
        if prompt[: len(seq.ids)] != seq.ids or full[: len(prompt)] != prompt:
            raise AssemblyError(f"messages[{i}]: the conversation does not render as one growing sequence")
        seq.extend(prompt[len(seq.ids):], trained=False)
        completion = full[len(prompt):]
        # The template closes a turn with "<|im_end|>\n"; the newline is template, not model output.
        end = completion.index(renderer.im_end_id) + 1 if renderer.im_end_id in completion else len(completion)
        seq.extend(completion[:end], trained=True)
        seq.extend(completion[end:], trained=False)
    if seq.n_loss_tokens == 0:
        raise AssemblyError("an SFT conversation needs at least one assistant message")
    return seq
