"""Trajectories -> token sequences with a loss mask and the sampler's logprobs (invariant 1).

Each Choice's prompt is rebuilt with the renderer the server sampled with, splicing every earlier
sampled turn in as its exact ids, and checked against the fingerprint the sampler recorded. A
choice whose prompt cannot be reproduced is not trained on (its tokens stay in the context of
later turns) and is counted; with `train_mismatched` (TrainConfig.skip_mismatched_prompts=False)
it is trained after the prompt rebuilt here, and counted as that too. Consecutive turns whose
prompts extend each other share one sequence, so a multi-turn rollout costs one forward pass; a
turn whose prompt does not extend the last one (the template rewrote history) starts a sequence of
its own, with the same advantage.

A Choice that lost its token ids on the way (a streamed choice rebuilt by the client, litellm's
rebuilt choices) is matched to what this server sampled (server/chat/sampled_turns.py, the same
code that splices turns into prompts); one the server never sampled is context, counted.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field, fields
from typing import Any, Callable

from openai.types.chat.chat_completion import Choice

from protocol.choices import (SamplingInfo, as_message, check_choice_numbers, choice_logprobs, choice_sampling,
                              choice_token_ids)
from protocol.trajectory import Conversation, History, TrajectoryGroup, is_target
from server.chat.format import ChatFormat
from server.chat.render import RenderedPrompt
from server.chat.sampled_turns import PrefixFingerprints, fingerprint
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
    # Added to `advantage` token by token (aligned with ids; None: none): distillation's reverse KL.
    token_advantages: list[float] | None = None
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
    prompt_mismatches_trained: int = 0  # of those, trained anyway (TrainConfig.skip_mismatched_prompts=False)
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


class Cancelled(Exception):
    """The job was cancelled or ran past its time limit (checked between turns in assembly and
    between micro-batches in optimisation); the step is abandoned, not committed."""


class Interrupted(RuntimeError):
    """The step was cut short by what the job could not help (a training process lost with its
    machine): it is abandoned, not committed, and the same job may run again."""


@dataclass
class _Prompt:
    """A turn's prompt: the first `length` ids of `ids`, which is the whole history's render when
    `whole` is set (shared by the turns that extend each other) or the turn's own render."""

    ids: list[int]
    length: int
    whole: "_Whole | None" = None
    spliced: dict[int, bool] = field(default_factory=dict)


@dataclass
class _Whole:
    """The history rendered once, every sampled turn spliced in: under a template that extends a
    conversation by appending, each turn's prompt is a prefix of it, checked by its fingerprint
    (fed incrementally), so a history of n turns costs one render, not n."""

    prompt: RenderedPrompt
    fingerprints: PrefixFingerprints


class _Wholes:
    def __init__(self, chat: ChatFormat, messages: list[dict[str, Any]], tools: Any):
        self.chat, self.messages, self.tools = chat, messages, tools
        self._made: dict[str, _Whole | None] = {}

    def get(self, kwargs: dict[str, Any] | None) -> _Whole | None:
        key = json.dumps(kwargs, sort_keys=True)
        if key not in self._made:
            try:
                rendered = self.chat.turns.prompt(self.messages, self.tools, kwargs)
                self._made[key] = _Whole(rendered, PrefixFingerprints(rendered.ids))
            except (RenderError, TemplateError):  # each turn's own render names the place
                self._made[key] = None
        return self._made[key]


def _resolve(choice: Choice, messages: list[dict[str, Any]], idx: int, tools: Any, chat: ChatFormat,
             wholes: _Wholes) -> tuple[SampledChoice | None, _Prompt | None]:
    """The turn as sampled, and the prompt rebuilt for it: the choice's own record, or, for a
    choice that lost it, what this server sampled with that text after that very prompt. A prompt
    is a prefix of the whole history's render when its fingerprint says so, else rendered alone
    (a template that rewrote history, or a choice that lost its record)."""
    ids, lps, info = choice_token_ids(choice), choice_logprobs(choice), choice_sampling(choice)
    try:
        if ids is not None and lps is not None and info is not None:
            kwargs = info.model_extra.get("chat_template_kwargs")
            whole = wholes.get(kwargs)
            offset = whole.prompt.offsets.get(idx) if whole is not None else None
            if offset is not None and whole.fingerprints.of(offset) == info.prompt_fingerprint:
                return SampledChoice(ids, lps, info), _Prompt(whole.prompt.ids, offset, whole)
            own = chat.turns.prompt(messages[:idx], tools, kwargs)
            return SampledChoice(ids, lps, info), _Prompt(own.ids, len(own.ids), spliced=own.spliced)
        found = chat.turns.recover(messages, idx, tools)
    except (RenderError, TemplateError) as e:
        raise AssemblyError(f"messages before choice {idx}: {e}")
    if found is None:
        return None, None
    turn, prompt = found
    sampling = SamplingInfo.model_validate(turn.record["sampling"])
    return (SampledChoice(list(turn.token_ids), list(turn.record["logprobs"]), sampling, recovered=True),
            _Prompt(prompt.ids, len(prompt.ids), spliced=prompt.spliced))


def _never() -> bool:
    return False


def assemble_history(history: History, chat: ChatFormat, mask_truncated: bool = False,
                     should_stop: Callable[[], bool] = _never, train_mismatched: bool = False
                     ) -> tuple[list[TrainSequence], AssemblyStats]:
    stats = AssemblyStats()
    items = history.messages_and_choices
    messages = [as_message(i) for i in items]
    last = max((i for i, item in enumerate(items) if isinstance(item, Choice)), default=-1)
    for i, item in enumerate(items):  # later prompts splice these exact ids
        if isinstance(item, Choice) and (ids := choice_token_ids(item)) is not None and choice_sampling(item):
            messages[i] = {**messages[i], "token_ids": ids}
    wholes = _Wholes(chat, messages[: last + 1], history.tools)
    sequences: list[TrainSequence] = []
    current: TrainSequence | None = None
    along: _Whole | None = None  # the whole render `current` is a prefix of, when it is one
    rewritten: set[int] = set()
    reach: dict[int, tuple[_Whole, int]] = {}
    for idx, item in enumerate(items):
        if not isinstance(item, Choice):
            stats.context_only_assistant_messages += item.get("role") == "assistant"
            continue
        if should_stop():
            raise Cancelled()
        stats.choices += 1
        s, prompt = _resolve(item, messages, idx, history.tools, chat, wholes)
        if s is None or prompt is None:
            stats.unsampled_choices += 1
            continue
        if s.recovered:  # the others' ids went in before the loop
            messages[idx] = {**messages[idx], "token_ids": s.ids}
        stats.recovered_choices += s.recovered
        if prompt.whole is None:
            rewritten |= {i for i, ok in prompt.spliced.items() if not ok}
        else:  # counted once, at the end, up to the last turn that used it
            reach[id(prompt.whole)] = (prompt.whole, idx)
        matches = (prompt.whole is not None or
                   fingerprint(prompt.ids[: prompt.length]) == s.sampling.prompt_fingerprint)
        truncated = item.finish_reason == "length"
        trained = (matches or train_mismatched) and not (truncated and mask_truncated)
        stats.truncated_choices += truncated
        stats.prompt_mismatches += not matches
        stats.prompt_mismatches_trained += trained and not matches
        stats.trained_choices += trained
        n = len(current.ids) if current is not None else 0
        if current is not None and n <= prompt.length and (
                (along is not None and along is prompt.whole) or prompt.ids[:n] == current.ids):
            current.extend(prompt.ids[n: prompt.length], trained=False)
        else:
            stats.non_extending_turns += current is not None
            current = TrainSequence()
            sequences.append(current)
            current.extend(prompt.ids[: prompt.length], trained=False)
        current.extend(s.ids, trained, s.logprobs, s.sampling.logprob_temperature)
        # `current` stays a prefix of the whole render while the render continues with these very ids.
        spliced_as_sampled = prompt.ids[prompt.length: prompt.length + len(s.ids)] == s.ids
        along = prompt.whole if spliced_as_sampled else None
    for whole, upto in reach.values():
        rewritten |= {i for i, ok in whole.prompt.spliced.items() if not ok and i < upto}
    stats.rewritten_turns = len(rewritten)
    stats.trajectories_without_choices = int(stats.choices == 0)
    sequences = [_through_last_trained(s) for s in sequences if s.n_loss_tokens > 0]
    stats.sequences = len(sequences)
    return sequences, stats


def _through_last_trained(seq: TrainSequence) -> TrainSequence:
    """The sequence without the context after its last trained token: in a causal model it changes
    no trained token's logprob, and a long history of untrained turns would cost a forward pass
    over all of it."""
    end = len(seq.mask) - seq.mask[::-1].index(True)
    for name in ("ids", "mask", "old_logprobs", "temperatures"):
        del getattr(seq, name)[end:]
    return seq


def assemble_sft(conversation: Conversation, chat: ChatFormat, should_stop: Callable[[], bool] = _never
                 ) -> list[TrainSequence]:
    """A demonstration conversation: every assistant turn's tokens (through the token that ends
    the turn) are trained, but for a turn of weight 0; everything else is context. Turns share a
    sequence while the rendered conversation grows by appending; a sequence with nothing to train is
    left out. (A closing turn of weight 0 is still encoded: cutting it would change how every other
    demonstration's sequences are packed, and so every seeded warm start's figures.)"""
    messages, sequences = conversation.messages, []
    seq: TrainSequence | None = None
    for i, m in enumerate(messages):
        if m.get("role") != "assistant":
            continue
        if should_stop():
            raise Cancelled()
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
        seq.extend(completion[:end], trained=is_target(m))
        seq.extend(completion[end:], trained=False)
    return [s for s in sequences if any(s.mask)]
