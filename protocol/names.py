"""The served-name grammar: a run's latest step is served as `run`, its step N as `run@N`.

Run names cannot hold '@' (protocol/config.py RUN_NAME), so the last '@' splits a name; the base
model's names (which may hold anything) are told apart by whoever serves them, not here.
"""

from __future__ import annotations


def policy_name(run: str, step: int) -> str:
    """The name step `step` of run `run` is served under."""
    return f"{run}@{step}"


def split_policy(model: str) -> tuple[str, int | None]:
    """`run@N` -> (run, N); any other name -> (the name, None). `run@x` (no step number) is a name
    of its own, which no run has."""
    run, at, step = model.rpartition("@")
    if not at or not run or not step.isdigit():
        return model, None
    return run, int(step)


def run_of(model: str) -> str:
    """The run a served name belongs to: whatever stands before its last '@' (`run@N` -> run), or
    the whole name."""
    return model.rpartition("@")[0] or model


def names_run(model: str, run: str) -> bool:
    """Whether `model` is one of `run`'s served names (its latest, or any step)."""
    return run_of(model) == run
