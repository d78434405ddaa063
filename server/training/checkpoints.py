"""Atomic checkpoints: adapter, optimizer state and step metadata.

A checkpoint is written to a temporary directory and renamed into place, so after a kill -9 at
any moment a step directory is either complete or absent. The newest complete step is the run's
state; nothing else (no "latest" pointer file) can disagree with it.
"""

from __future__ import annotations

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

_STEP_DIR = re.compile(r"^step_(\d{6,})$")


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
    save_file({k: v.detach().contiguous().cpu() for k, v in adapter_state.items()}, str(tmp / "adapter.safetensors"))
    torch.save(optimizer_state, tmp / "optimizer.pt")
    (tmp / "meta.json").write_text(json.dumps({"step": step, **meta}, default=str))
    for f in tmp.iterdir():
        with open(f, "rb") as fh:
            os.fsync(fh.fileno())
    crash_point("checkpoint_written")
    final = step_dir(root, step)
    if final.exists():  # a step is written once; a leftover from a crashed rewrite is replaced
        shutil.rmtree(final)
    os.rename(tmp, final)
    _fsync_dir(root)
    crash_point("checkpoint_renamed")
    return final


def steps(root: Path) -> list[int]:
    if not root.exists():
        return []
    found = []
    for p in root.iterdir():
        m = _STEP_DIR.match(p.name)
        if m and (p / "meta.json").exists():
            found.append(int(m.group(1)))
    return sorted(found)


def clean_partial(root: Path) -> None:
    """Remove temporary directories a crash left behind."""
    if root.exists():
        for p in root.glob(".tmp-*"):
            shutil.rmtree(p, ignore_errors=True)


def read_meta(root: Path, step: int) -> dict[str, Any]:
    return json.loads((step_dir(root, step) / "meta.json").read_text())


def read_adapter(root: Path, step: int) -> dict[str, torch.Tensor]:
    return load_file(str(step_dir(root, step) / "adapter.safetensors"))


def read_optimizer(root: Path, step: int) -> dict[str, Any]:
    return torch.load(step_dir(root, step) / "optimizer.pt", weights_only=False)


def delete(root: Path, step: int) -> None:
    shutil.rmtree(step_dir(root, step))
