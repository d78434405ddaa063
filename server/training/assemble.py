"""Trajectories -> token sequences with a loss mask and the sampler's logprobs (invariant 1).

Each Choice's prompt is rebuilt with the renderer the server sampled with, splicing every earlier
sampled turn in as its exact ids, and checked against the fingerprint the sampler recorded. A
choice whose prompt cannot be reproduced is not trained on (its tokens stay in the context of
later turns) and is counted. Consecutive turns whose prompts extend each other share one sequence,
so a multi-turn rollout costs one forward pass; a turn whose prompt does not extend the last one
(the template rewrote history) starts a sequence of its own, with the same advantage.

A Choice that lost its token ids on the way (a streamed choice rebuilt by the client, litellm's
rebuilt choices) is matched to what this server sampled (server/chat/sampled_turns.py, the same
code that splices turns into prompts); one the server never sampled is context, counted.
"""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from openai.types.chat.chat_completion import Choice

from protocol.choices import (SamplingInfo, as_message, check_choice_numbers, choice_logprobs, choice_sampling,
                              choice_token_ids)
from protocol.trajectory import Conversation, History, TrajectoryGroup
from server.chat.format import ChatFormat
from server.chat.render import RenderedPrompt
from server.chat.sampled_turns import fingerprint
from server.chat.template import TemplateError
from server.chat.validate import RenderError


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
    recovered_choices: int = 0
    unsampled_choices: int = 0
    truncated_choices: int = 0
    context_only_assistant_messages: int = 0
    trajectories_without_choices: int = 0
    sequences: int = 0
    non_extending_turns: int = 0
    rewritten_turns: int = 0

    def add(self, other: "AssemblyStats") -> None:
        for f in fields(self):
            setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))


@dataclass(frozen=True)
class SampledChoice:
    """What training needs of one sampled turn."""

    ids: list[int]
    logprobs: list[float]
    sampling: SamplingInfo
    recovered: bool = False


def check_submission(groups: list[TrajectoryGroup], vocab_size: int, model_fingerprint: str) -> None:
    """What only this model can tell about a submission (token ids in its vocabulary, choices
    sampled from it), found before the job is queued: a 400 that names the place."""
    for gi, g in enumerate(groups):
        if not g.trajectories and not g.exceptions:
            raise AssemblyError(f"groups[{gi}] is empty: it has no trajectories and no exceptions")
        for ti, t in enumerate(g.trajectories):
            for hi, h in enumerate(t.histories()):
                where = f"groups[{gi}].trajectories[{ti}]" + (f".additional_histories[{hi - 1}]" if hi else "")
                for ci, choice in enumerate(h.choices()):
                    _check_choice(choice, vocab_size, model_fingerprint, f"{where} choice {ci}")


def _check_choice(choice: Choice, vocab_size: int, model_fingerprint: str, where: str) -> None:
    try:
        check_choice_numbers(choice, where)
    except ValueError as e:  # a SamplingInfo that does not validate, or mismatched lists
        raise AssemblyError(str(e)) from None
    ids, info = choice_token_ids(choice), choice_sampling(choice)
    bad = [t for t in ids or [] if t >= vocab_size]
    if bad:
        raise AssemblyError(f"{where}: token id {bad[0]} is not valid for this model's tokenizer (size {vocab_size})")
    if ids is not None and choice_logprobs(choice) is None:
        raise AssemblyError(f"{where}: token_ids without logprobs.content; append the server's Choice as it came")
    if info is not None and info.model_fingerprint != model_fingerprint:
        raise AssemblyError(f"{where}: this choice was sampled from another model "
                            f"(fingerprint {info.model_fingerprint}, this server {model_fingerprint})")


def _resolve(choice: Choice, messages: list[dict[str, Any]], idx: int, tools: Any, chat: ChatFormat
             ) -> tuple[SampledChoice | None, RenderedPrompt | None]:
    """The turn as sampled, and the prompt rebuilt for it: the choice's own record, or, for a
    choice that lost it, what this server sampled with that text after that very prompt."""
    ids, lps, info = choice_token_ids(choice), choice_logprobs(choice), choice_sampling(choice)
    try:
        if ids is not None and lps is not None and info is not None:
            return SampledChoice(ids, lps, info), chat.turns.prompt(messages[:idx], tools,
                                                                     info.model_extra.get("chat_template_kwargs"))
        found = chat.turns.recover(messages, idx, tools)
    except (RenderError, TemplateError) as e:
        raise AssemblyError(f"messages before choice {idx}: {e}")
    if found is None:
        return None, None
    turn, prompt = found
    sampling = SamplingInfo.model_validate(turn.record["sampling"])
    return SampledChoice(list(turn.token_ids), list(turn.record["logprobs"]), sampling, recovered=True), prompt


def assemble_history(history: History, chat: ChatFormat, mask_truncated: bool = False
                     ) -> tuple[list[TrainSequence], AssemblyStats]:
    stats = AssemblyStats()
    items = history.messages_and_choices
    messages = [as_message(i) for i in items]
    sequences: list[TrainSequence] = []
    current: TrainSequence | None = None
    rewritten: set[int] = set()
    for idx, item in enumerate(items):
        if not isinstance(item, Choice):
            stats.context_only_assistant_messages += item.get("role") == "assistant"
            continue
        stats.choices += 1
        s, prompt = _resolve(item, messages, idx, history.tools, chat)
        if s is None or prompt is None:
            stats.unsampled_choices += 1
            continue
        messages[idx] = {**messages[idx], "token_ids": s.ids}  # later prompts splice these exact ids
        stats.recovered_choices += s.recovered
        rewritten |= {i for i, ok in prompt.spliced.items() if not ok}
        matches = fingerprint(prompt.ids) == s.sampling.prompt_fingerprint
        truncated = item.finish_reason == "length"
        trained = matches and not (truncated and mask_truncated)
        stats.truncated_choices += truncated
        stats.prompt_mismatches += not matches
        stats.trained_choices += trained
        if current is not None and prompt.ids[: len(current.ids)] == current.ids:
            current.extend(prompt.ids[len(current.ids):], trained=False)
        else:
            stats.non_extending_turns += current is not None
            current = TrainSequence()
            sequences.append(current)
            current.extend(prompt.ids, trained=False)
        current.extend(s.ids, trained, s.logprobs, s.sampling.logprob_temperature)
    stats.rewritten_turns = len(rewritten)
    stats.trajectories_without_choices = int(stats.choices == 0)
    sequences = [s for s in sequences if s.n_loss_tokens > 0]
    stats.sequences = len(sequences)
    return sequences, stats


def assemble_sft(conversation: Conversation, chat: ChatFormat) -> list[TrainSequence]:
    """A demonstration conversation: every assistant turn's tokens (through the token that ends
    the turn) are trained, everything else is context. Turns share a sequence while the rendered
    conversation grows by appending."""
    messages, sequences = conversation.messages, []
    seq: TrainSequence | None = None
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        try:
            prompt = chat.renderer.render(messages[:i], conversation.tools, True).ids
            full = chat.renderer.render(messages[: i + 1], conversation.tools, False).ids
        except (RenderError, TemplateError) as e:
            raise AssemblyError(f"messages[{i}]: {e}")
        if full[: len(prompt)] != prompt:
            raise AssemblyError(f"messages[{i}]: the chat template renders this turn unlike its generation prompt")
        if seq is None or prompt[: len(seq.ids)] != seq.ids:
            seq = TrainSequence()
            sequences.append(seq)
        seq.extend(prompt[len(seq.ids):], trained=False)
        completion = full[len(prompt):]
        # The template closes a turn with its end token and maybe a newline; the newline is template.
        ends = [k for k, t in enumerate(completion) if t in chat.stop_ids]
        end = ends[0] + 1 if ends else len(completion)
        seq.extend(completion[:end], trained=True)
        seq.extend(completion[end:], trained=False)
    return sequences
