"""A run's trajectories as JSONL, one line per trajectory with its step, split and group, token ids
and logprobs included: archive a run, move it to another server, or train on it again.

    text = await download_jsonl(model)                       # GET /v1/runs/{name}/export.jsonl
    await import_jsonl(other_model, text)                    # POST /v1/runs/{other}/import
    await other_model.train(groups_from_jsonl(text, step=1))
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Iterable

from client.model import TrainableModel, raise_for_status
from protocol.trajectory import Trajectory, TrajectoryGroup

Source = str | bytes | Path | Iterable[str] | Iterable[dict[str, Any]]


def _is_path(source: Any) -> bool:
    # JSONL text has a newline or starts with "{"; anything else given as a string is a file name
    return isinstance(source, Path) or (isinstance(source, str) and "\n" not in source
                                        and not source.lstrip().startswith("{"))


def read_jsonl(source: Source) -> list[dict[str, Any]]:
    """Records from a path, JSONL text or bytes, or an iterable of lines or already-parsed records."""
    if _is_path(source):
        source = Path(source).read_text()
    if isinstance(source, bytes):
        source = source.decode()
    lines = source.splitlines() if isinstance(source, str) else source
    out = []
    for n, line in enumerate(lines, 1):
        if isinstance(line, dict):
            out.append(line)
        elif line.strip():
            try:
                out.append(json.loads(line))
            except ValueError as e:
                raise ValueError(f"line {n}: not JSON ({e})") from None
    return out


def groups_from_jsonl(source: Source, split: str | None = "train", step: int | None = None) -> list[TrajectoryGroup]:
    """Trajectory groups as they were trained or logged (grouped by step and group index, in
    order), ready for `model.train()`. `split=None` or `step=None` keeps every split or step."""
    groups: dict[tuple[int, int], list[tuple[int, Trajectory]]] = {}
    for rec in read_jsonl(source):
        if (split is not None and rec.get("split") != split) or (step is not None and rec.get("step") != step):
            continue
        key = (rec.get("step", 0), rec.get("group_index", 0))
        groups.setdefault(key, []).append((rec.get("traj_index", 0), Trajectory.model_validate(rec["trajectory"])))
    return [TrajectoryGroup(trajectories=[t for _, t in sorted(trajs, key=lambda x: x[0])],
                            metadata={"step": s, "group_index": g})
            for (s, g), trajs in sorted(groups.items())]


async def download_jsonl(model: TrainableModel, path: str | Path | None = None, *, step: int | None = None,
                         split: str | None = None) -> str | Path:
    """The run's stored trajectories as JSONL: written to `path` (returned), or returned as text."""
    params = {k: v for k, v in (("step", step), ("split", split)) if v is not None}
    async with model.http(timeout=None) as http:
        async with http.stream("GET", f"/v1/runs/{model.name}/export.jsonl", params=params) as resp:
            if resp.status_code >= 400:
                await resp.aread()
                raise_for_status(resp)
            if path is None:
                return (await resp.aread()).decode()
            path = Path(path)
            with path.open("wb") as f:  # streamed: a long run's export need not fit in memory
                async for chunk in resp.aiter_bytes():
                    f.write(chunk)
            return path


async def import_jsonl(model: TrainableModel, source: Source, *, split: str | None = None) -> dict[str, Any]:
    """Store exported trajectories into this model's run (which must exist); nothing is trained.
    `split` replaces the split of every line (e.g. "imported")."""
    if _is_path(source):
        body = Path(source).read_bytes()
    elif isinstance(source, (str, bytes)):
        body = source.encode() if isinstance(source, str) else source
    else:
        body = "".join(json.dumps(r) + "\n" for r in read_jsonl(source)).encode()
    params = {"split": split} if split else None
    # Sent once, not retried: an import adds rows, so a retry after a lost reply would add them twice.
    async with model.http(timeout=300.0) as http:
        resp = await http.post(f"/v1/runs/{model.name}/import", content=body, params=params,
                               headers={"Content-Type": "application/x-ndjson"})
    raise_for_status(resp)
    return resp.json()
