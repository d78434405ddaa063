"""Atomic, checksummed checkpoints: adapter, optimizer state and step metadata.

A checkpoint is written to a temporary directory, fsynced and renamed into place, so after a
kill -9 at any moment a step directory is either complete or absent. The newest intact step is the
run's state; nothing else (no "latest" pointer file) can disagree with it.

Files can still be damaged at rest (a bad disk, an operator's mistake): meta.json records the
SHA-256 of each weight file, and `damage` says what is wrong with a step before anything loads it.
A damaged step is set aside under a name that keeps its number (`damaged-step_N-...`), so the
number is never given to another step: clients may have sampled from it, exported it, or stored
its figures.

A disk that cannot take a step's file whole (full, over quota, or a write torch cut short) is one
error, DiskFull, naming the file and the space left (server/runs/disk_full.py).
"""

from __future__ import annotations

import hashlib
import json
import os
import re
import shutil
import uuid
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

from server.faults import crash_point
from server.runs.disk_full import DiskFull, ShortWrite, free_bytes, writing

_STEP_DIR = re.compile(r"^step_(\d{6,})$")
_USED_DIR = re.compile(r"^(?:damaged-)?step_(\d{6,})")  # a step's number, kept or set aside
WEIGHT_FILES = ("adapter.safetensors", "optimizer.pt")


class CheckpointDamaged(RuntimeError):
    """A checkpoint's files are missing, unreadable or not what was written."""


def step_dir(root: Path, step: int) -> Path:
    return root / f"step_{step:06d}"


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write(root: Path, step: int, adapter_state: dict[str, torch.Tensor], optimizer_state: dict[str, Any],
          meta: dict[str, Any]) -> Path:
    root.mkdir(parents=True, exist_ok=True)
    tmp = root / f".tmp-{step:06d}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        _write_files(tmp, step, adapter_state, optimizer_state, meta)
    except BaseException as exc:  # a full disk or an I/O error: nothing half-written stays behind
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, ShortWrite):
            raise DiskFull(step_dir(root, step) / exc.path.name, free_bytes(root)) from exc.__cause__
        raise
    crash_point("checkpoint_written")
    final = step_dir(root, step)
    if final.exists():  # a step is written once; a leftover from a crashed rewrite is replaced
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    crash_point("checkpoint_renamed")
    return final


def _write_files(tmp: Path, step: int, adapter_state: dict[str, torch.Tensor], optimizer_state: dict[str, Any],
                 meta: dict[str, Any]) -> None:
    """The step's three files in `tmp`, fsynced; ShortWrite names the one the disk could not take."""
    with writing(tmp / "adapter.safetensors"):
        save_file({k: v.detach().contiguous().cpu() for k, v in adapter_state.items()},
                  str(tmp / "adapter.safetensors"))
    with writing(tmp / "optimizer.pt"):
        torch.save(optimizer_state, tmp / "optimizer.pt")
    sums = {name: _sha256(tmp / name) for name in WEIGHT_FILES}
    with writing(tmp / "meta.json"):
        (tmp / "meta.json").write_text(json.dumps({"step": step, **meta, "sha256": sums}, default=str))
    for f in tmp.iterdir():
        with writing(f), open(f, "rb") as fh:  # a filesystem that allocates late says ENOSPC here
            os.fsync(fh.fileno())
    _fsync_dir(tmp)


def _sha256(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def steps(root: Path) -> list[int]:
    """Every step directory, intact or not (`damage` tells them apart)."""
    if not root.exists():
        return []
    return sorted(int(m.group(1)) for p in root.iterdir() if (m := _STEP_DIR.match(p.name)))


def highest_used(root: Path) -> int:
    """The highest step number ever written here, set-aside damaged steps included."""
    if not root.exists():
        return 0
    return max((int(m.group(1)) for p in root.iterdir() if (m := _USED_DIR.match(p.name))), default=0)


def damage(root: Path, step: int) -> str | None:
    """What is wrong with this step's checkpoint, or None when it is as written."""
    try:
        meta = read_meta(root, step)
    except CheckpointDamaged as exc:
        return str(exc)
    path = step_dir(root, step)
    for name in WEIGHT_FILES:
        if not (path / name).is_file():
            return f"{path / name} is missing"
        expected = meta.get("sha256", {}).get(name)
        if expected is not None and _sha256(path / name) != expected:  # checkpoints before checksums have none
            return f"{path / name} is not the file that was written (its SHA-256 differs)"
    return None


def check(root: Path, step: int) -> None:
    why = damage(root, step)
    if why is not None:
        raise CheckpointDamaged(f"step {step}'s checkpoint is damaged: {why}")


def set_aside(root: Path, step: int, why: str) -> Path:
    """Move a damaged step out of the run's steps, keeping its number taken and the reason beside it."""
    aside = root / f"damaged-{step_dir(root, step).name}-{uuid.uuid4().hex[:8]}"
    os.rename(step_dir(root, step), aside)
    (aside / "DAMAGED.txt").write_text(why + "\n")
    _fsync_dir(root)
    return aside


def clean_partial(root: Path) -> None:
    """Remove temporary directories a crash left behind."""
    if root.exists():
        for p in root.glob(".tmp-*"):
            shutil.rmtree(p, ignore_errors=True)


def read_meta(root: Path, step: int) -> dict[str, Any]:
    path = step_dir(root, step) / "meta.json"
    try:
        meta = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointDamaged(f"{path} is missing") from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise CheckpointDamaged(f"{path} cannot be read ({exc})") from None
    if not isinstance(meta, dict) or meta.get("step") != step:
        raise CheckpointDamaged(f"{path} is not this step's metadata")
    return meta


def read_adapter(root: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(step_dir(root, step) / "adapter.safetensors"))


def read_optimizer(root: Path, step: int) -> dict[str, Any]:
    return torch.load(step_dir(root, step) / "optimizer.pt", weights_only=False)


def delete(root: Path, step: int) -> None:
    shutil.rmtree(step_dir(root, step))
