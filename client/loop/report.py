"""What `python -m client.train` prints: the run's first line, one line per training attempt, and
the lines that say why it stops or does nothing. Pure functions of figures; the loop is client/loop/training_loop.py.

A step line's time is the step's wall time, from the end of the previous attempt to this one's
result, split into the phases it waited on: sampling (rollouts), scoring (the group judge, after
the rollouts), queue (at the server, behind other runs' jobs) and training (the rest of the train
call: upload, the step, the checkpoint). Phases that overlap another (a pipelined run samples
while the previous step trains) count only where the step waited on them.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from protocol.jobs import TrainResult
from protocol.metrics import StepMetrics


@dataclass(frozen=True)
class StepTiming:
    """Seconds of one attempt (see the module's docstring)."""

    wall: float
    sample: float
    score: float
    queue: float
    train: float

    @classmethod
    def measure(cls, begun: float, ended: float, groups: list[tuple[float, float]], submitted: float | None,
                train_seconds: float | None, queue_seconds: float | None) -> "StepTiming":
        """`begun`..`ended`: the attempt's window (monotonic clock); `groups`: when each group's
        rollouts ended and when it was scored; `submitted`: when the batch was sent to train, and
        `train_seconds` how long that call took, of which `queue_seconds` waiting at the server."""
        last_done = max((d for d, _ in groups), default=begun)
        last_scored = max((s for _, s in groups), default=begun)
        cut = submitted if submitted is not None else ended
        sample = max(0.0, min(last_done, cut) - begun)
        score = max(0.0, min(last_scored, cut) - max(last_done, begun))
        queue = min(queue_seconds or 0.0, train_seconds or 0.0)
        return cls(wall=max(0.0, ended - begun), sample=sample, score=score, queue=queue,
                   train=max(0.0, (train_seconds or 0.0) - queue))

    def part(self) -> str:
        return (f" | {self.wall:.1f}s (sample {self.sample:.1f}, score {self.score:.1f}, queue {self.queue:.1f}, "
                f"train {self.train:.1f})")

    def figures(self) -> dict[str, float]:
        return {f"{k}_seconds": round(v, 3) for k, v in vars(self).items()}


def dropped_part(m: StepMetrics) -> str:
    """The dropped groups by why: constant rewards as solved (all at the top reward), failed (all
    at the bottom) and same (another value), then groups of one, all-errored, too stale."""
    same = m.groups_dropped_constant - m.groups_constant_solved - m.groups_constant_failed
    parts = [(m.groups_constant_solved, "solved"), (m.groups_constant_failed, "failed"), (same, "same reward"),
             (m.groups_dropped_single, "one rollout"), (m.groups_dropped_failed, "errored"),
             (m.groups_dropped_stale, "too stale")]
    shown = [f"{n} {what}" for n, what in parts if n]
    return f" ({', '.join(shown)})" if shown else ""


def solved_line(m: StepMetrics) -> str | None:
    """Good news, when most of a batch that still trained was solved by every rollout (a batch
    all solved trains nothing, and the server's warning says so)."""
    solved, total = m.groups_constant_solved, m.groups_total
    if not total or solved * 2 < total or m.groups_dropped_constant == total:
        return None
    return f"{solved} of {total} groups solved by every rollout: the task is nearly learned; raise the difficulty or stop."


def step_line(result: TrainResult, extra: str = "", timing: StepTiming | None = None) -> str:
    m = result.metrics
    gap = "None" if m.logprob_gap is None else f"{m.logprob_gap:.1e}"
    head = f"step {result.step:3d}" if result.trained else f"step {result.step + 1:3d} not trained"
    dropped = m.groups_dropped_constant + m.groups_dropped_single + m.groups_dropped_failed + m.groups_dropped_stale
    stale = (f" | staleness mean {m.staleness_mean:.2f} max {m.staleness_max}, {m.groups_dropped_stale} too stale"
             if m.staleness_bound and m.staleness_mean is not None else "")
    # Without the client's clock (a library caller), the server's own: training alone, named so.
    took = timing.part() if timing is not None else f" | train {m.step_seconds or 0:.1f}s"
    good = solved_line(m)
    return (f"{head} | reward {m.reward_mean or 0:.3f} | groups {m.groups_trainable}/{m.groups_total} "
            f"trainable, {dropped} dropped{dropped_part(m)} | exceptions {m.trajectories_excluded} | logprob_gap "
            f"{gap}{stale}{_advantage_part(m)}{_teacher_part(m)}{extra}{took}" + "".join(domain_lines(m.domains))
            + (f"\n  {good}" if good else "") + "".join(f"\n  warning: {w}" for w in result.warnings))


def _teacher_part(m: StepMetrics) -> str:
    """Distilling: the student's reverse KL to its teacher on this step's tokens (falls as it learns)."""
    return "" if m.teacher_kl is None else f" | teacher KL {m.teacher_kl:.3f}"


def _advantage_part(m: StepMetrics) -> str:
    if m.baseline != "given" or m.advantage_mean is None:
        return ""
    return (f" | V* {m.value_mean:.3f} advantage {m.advantage_mean:+.3f} "
            f"({m.advantage_positive_fraction:.0%} > 0)")


def set_aside_part(n: int) -> str:
    """Dynamic sampling: how many groups were sampled in place of groups whose rollouts all scored alike."""
    return f" | {n} set aside (scored alike)"


def curriculum_part(level: int, success: float | None) -> str:
    return f" | level {level}" + ("" if success is None else f" (held-out success {success:.2f})")


def figure(value: Any) -> str:
    return "-" if value is None else f"{value:.3g}" if isinstance(value, float) else str(value)


def domain_lines(domains: dict[str, dict[str, Any]]) -> list[str]:
    """One line per domain of a batch that names them (protocol/domains.py)."""
    return [f"\n  {name}: " + ", ".join(f"{k} {figure(v)}" for k, v in figures.items())
            for name, figures in domains.items()]


def run_line(run: str, created: bool, step: int, until: int, base_model: str | None, learning_rate: float | None,
             groups: int, group_size: int, loss: str) -> str:
    """The run's first line: made or found (at which step), on what, and how each step trains.
    `learning_rate`: the one the steps train at (given, or the server's default for the model)."""
    where = "created" if created else f"resumed at step {step} of {until}"
    lr = "lr ?" if learning_rate is None else f"lr {short_float(learning_rate)}"
    return (f"run {run}: {where} on {base_model or 'the server model'} | {lr} | {groups} groups x {group_size} "
            f"| loss {loss}")


def short_float(x: float) -> str:
    """2e-4, 4.9e-4, 1e-3: a learning rate as people write it."""
    mantissa, exponent = f"{x:.1e}".split("e")
    return f"{mantissa.rstrip('0').rstrip('.')}e{int(exponent)}"


def more_steps(step: int) -> int:
    """How many more steps to suggest to a run that has reached its --steps: as many again, at most 8."""
    return max(1, min(step, 8))


def warm_start_line(result: TrainResult, demonstrations: int, epochs: int, seconds: float) -> str:
    m = result.metrics
    return (f"warm start: step {result.step} | SFT on {demonstrations} demonstrations x {epochs} epoch{'s' * (epochs != 1)} "
            f"| loss {figure(m.loss)} | lr {short_float(m.learning_rate) if m.learning_rate else '-'} | {seconds:.1f}s")


def nothing_to_train_line(run: str, step: int, until: int) -> str:
    more = more_steps(step)
    return (f"run {run} is already at step {step} (--steps {until}): nothing to train; --steps {step + more} trains "
            f"{more} more")


def interrupted_line(step: int | None, in_flight: bool) -> str:
    if step is None:
        return "interrupted before the run was reached; the same command starts it"
    return (f"interrupted at step {step}; the same command resumes from step {step}"
            + (f" (or {step + 1}, if the batch it had submitted finishes training on the server: it is journalled "
               f"and trains once)" if in_flight else ""))


def retry_line(streak: int, limit: int, step: int) -> str:
    """Between attempts that trained nothing: how many so far, and what happens next."""
    return (f"  nothing trained ({streak} of {limit} attempts in a row, --patience {limit}): the run stays at step "
            f"{step}; sampling another batch")
