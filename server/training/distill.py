"""On-policy distillation in an RL step (protocol/config.py: Distill). The teacher, a model this
server serves on the same base, scores the student's sampled tokens at the temperature each was
sampled at; each gets coef * (log p_teacher - log p_sampler) as an advantage of its own
(server/training/advantages.py), beside its trajectory's reward advantage or alone."""

from __future__ import annotations

from typing import Callable

from protocol.config import Distill
from server.model import scoring
from server.model.host import ModelHost
from server.runs.facade import NotServed, OtherBaseModel, Runs
from server.training.advantages import reverse_kl_advantages
from server.training.assemble import TrainSequence

# (host, teacher name, [(token ids, first scored position, each scored token's temperature)]) ->
# the teacher's logprobs of each sequence's tokens from that position on, at those temperatures
Span = tuple[list[int], int, list[float]]
Teacher = Callable[[ModelHost, str, list[Span]], list[list[float]]]


class TeacherUnavailable(ValueError):
    """The named teacher cannot score this student's tokens: `missing` (a 404 at submission) or
    not usable here (a 409)."""

    def __init__(self, message: str, missing: bool = False):
        super().__init__(message)
        self.missing = missing


def _unavailable(name: str, e: NotServed | OtherBaseModel) -> TeacherUnavailable:
    if isinstance(e, OtherBaseModel):
        return TeacherUnavailable(f"teacher {name!r} cannot score this run's tokens: {e}, with another "
                                  f"tokenizer; a teacher must be this server's base model or a run of it")
    return TeacherUnavailable(f"teacher {name!r} is not a model this server serves (the base model, a run, "
                              f"or run@step)", missing=True)


def teacher_problem(runs: Runs, host: ModelHost, name: str) -> TeacherUnavailable | None:
    """Why `name` cannot teach a run of this server's base model; None when it can."""
    try:
        policy = runs.acquire(name)
    except (NotServed, OtherBaseModel) as e:
        return _unavailable(name, e)
    try:
        return None if scoring.adapter_here(host, policy.adapter) else TeacherUnavailable(
            f"teacher {scoring.elsewhere(name)}")
    finally:
        runs.release(policy)


def teacher_of(runs: Runs) -> Teacher:
    """The teacher as the job worker calls it: resolved by name at each step, its adapter held
    while it scores."""
    def logprobs(host: ModelHost, name: str, spans: list[Span]) -> list[list[float]]:
        try:
            policy = runs.acquire(name)
        except (NotServed, OtherBaseModel) as e:
            raise _unavailable(name, e)
        try:
            if not scoring.adapter_here(host, policy.adapter):
                raise TeacherUnavailable(f"teacher {scoring.elsewhere(name)}")
            return [s.logprobs for s in scoring.score(host, policy.adapter, [(ids, first) for ids, first, _ in spans],
                                                      temperatures=[temps for _, _, temps in spans])]
        finally:
            runs.release(policy)
    return logprobs


def scored_span(seq: TrainSequence) -> Span | None:
    """The sequence's ids, its first trained position and the temperatures its tokens from there
    were sampled at; None when nothing in it is trained. The teacher is read at the temperature the
    student sampled at: the student's logprobs are its tempered ones, and against a teacher at 1
    the confident tokens of a student equal to its teacher would still get negative advantages
    (a T=0.6 student learned, then declined, as they flattened it)."""
    first = next((t for t in range(1, len(seq.ids)) if seq.mask[t]), None)
    return None if first is None else (seq.ids, first, seq.temperatures[first:])


def apply(host: ModelHost, sequences: list[TrainSequence], cfg: Distill, teacher: Teacher) -> float | None:
    """Each sequence's trained tokens given their reverse-KL advantages, in place; the mean reverse
    KL (log p_sampler - log p_teacher) over them, or None when nothing is trained."""
    spans = [(s, span) for s in sequences if (span := scored_span(s)) is not None]
    if not spans:
        return None
    scored = teacher(host, cfg.teacher, [span for _, span in spans])
    total, n = 0.0, 0
    for (seq, (_, first, _)), teacher_lps in zip(spans, scored):
        trained = [t for t in range(first, len(seq.ids)) if seq.mask[t]]
        student = [seq.old_logprobs[t] for t in trained]
        teacher_at = [teacher_lps[t - first] for t in trained]
        seq.token_advantages = [0.0] * len(seq.ids)
        for t, a in zip(trained, reverse_kl_advantages(student, teacher_at, cfg.coef)):
            seq.token_advantages[t] = a
        total += sum(s - te for s, te in zip(student, teacher_at))
        n += len(trained)
    return total / n
