"""Scoring a group: skip one with nothing to compare, judge the rest, fold the verdicts into rewards."""

from __future__ import annotations

from protocol.trajectory import TrajectoryGroup
from rewards.ruler.config import JudgeConfig, judgment
from rewards.ruler.prompt import DEFAULT_RUBRIC, build_judge_prompt
from rewards.ruler.transport import ask_judge


def _skip(group: TrajectoryGroup, reason: str) -> TrajectoryGroup:
    out = group.model_copy(deep=True)
    for traj in out.trajectories:
        traj.logs.append(f"RULER: not judged ({reason})")
    out.metadata["ruler"] = judgment(skipped=1)
    return out


async def score_group(
    group: TrajectoryGroup,
    judge: str | JudgeConfig,
    rubric: str = DEFAULT_RUBRIC,
    *,
    weight: float = 1.0,
    max_retries: int = 3,
    backoff_s: float = 1.0,
    backoff_max_s: float = 30.0,
    judge_single: bool = False,
    max_tool_output_chars: int = 2000,
    max_trajectory_chars: int = 20000,
) -> TrajectoryGroup:
    """Score a group relative to itself; returns a new group (the input is never mutated).

    Each trajectory gets ``metrics["independent_reward"]`` (its reward before), ``metrics["ruler_score"]``,
    the judge's explanation in ``logs`` and ``reward = weight * ruler_score + (1 - weight) * independent``.
    The ``ruler_*`` call figures (latency_s, prompt/completion tokens, cost_usd when litellm knows the
    price, attempts, malformed replies) describe the one judge call of the whole group, repeated on
    each trajectory: sum them over groups, not over trajectories. The group's ``metadata["ruler"]``
    counts the judgment once (judged, or skipped with nothing to compare; attempts; malformed
    replies), and a :class:`JudgeError` carries the same for a judgment that failed (``group_metadata``).

    ``max_retries`` is the number of retries after the first attempt (invalid replies and transient
    errors alike); then :class:`JudgeError` is raised.
    """
    if not 0.0 <= weight <= 1.0:
        raise ValueError(f"weight must be in [0, 1], got {weight}")
    if max_retries < 0:
        raise ValueError("max_retries must be >= 0")
    config = JudgeConfig.parse(judge)
    if len(group.trajectories) < 2 and not judge_single:
        return _skip(group, f"{len(group.trajectories)} trajectories in the group, nothing to compare")

    prompt = build_judge_prompt(
        group, rubric, max_tool_output_chars=max_tool_output_chars, max_trajectory_chars=max_trajectory_chars
    )
    if len(prompt.ids) < 2 and not judge_single:
        return _skip(group, "all trajectories are identical, nothing to compare")

    scores, usage = await ask_judge(config, prompt, max_retries=max_retries, backoff_s=backoff_s, backoff_max_s=backoff_max_s)

    out = group.model_copy(deep=True)
    for traj, tid in zip(out.trajectories, prompt.id_of):
        verdict = scores[tid]
        independent = traj.reward
        traj.metrics.update({
            "independent_reward": independent,
            "ruler_score": verdict.score,
            "ruler_latency_s": usage.latency_s,
            "ruler_attempts": usage.attempts,
            "ruler_malformed": usage.malformed,
            "ruler_unique_trajectories": len(prompt.ids),
        })
        for name in ("prompt_tokens", "completion_tokens", "cost_usd"):
            if getattr(usage, name) is not None:
                traj.metrics[f"ruler_{name}"] = getattr(usage, name)
        traj.reward = weight * verdict.score + (1.0 - weight) * independent
        traj.logs.append(f"RULER [{tid}] score={verdict.score:.3f} (judge {config.model}): {verdict.explanation or ''}")
    out.metadata["ruler"] = judgment(judged=1, attempts=usage.attempts, malformed=usage.malformed)
    return out
