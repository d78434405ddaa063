"""Which base model a run belongs to, told before anything is loaded.

A run's adapter only means something on the model it was trained on. run.json records that
model's name and fingerprint (server/model/host.py `base_fingerprint`: architecture, parameter
names and shapes); a run from before they were recorded is judged by its newest checkpoint's
shapes, read from the file's header (no weights read). Either way a run of another model is
never loaded into this one: it is listed, in one line, as not served by this model, and a
request or a registration that names it gets a 409 that names both models.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pydantic import ValidationError
from safetensors import safe_open

from protocol.config import RunSpec

if TYPE_CHECKING:
    from server.model.host import ModelHost

_KEY = re.compile(r"^base_model\.model\.(?P<module>.+)\.lora_(?P<ab>[AB])\.weight$")
Misfit = tuple[Literal["model", "settings"], str]  # another model's checkpoint, or other LoRA settings


class RunConflict(ValueError):
    """A run of that name exists with other settings (a 409)."""

    param, code = "lora", "run_conflict"  # what the 409 names


class NameCaseConflict(RunConflict):
    """A run's name differs from an existing run's only by case (a 409 naming it): on a case-blind
    filesystem (macOS, Windows) the two would be one folder, and to a reader they are one name."""

    param, code = "name", "run_name_taken"

    def __init__(self, name: str, existing: str):
        super().__init__(f"run name {name!r} differs only by case from the existing run {existing!r}; run names "
                         f"are told apart without case: use {existing!r}, or choose another name")


class OtherModel(RunConflict):
    """A run trained on another base model than the one this server serves (a 409 naming both)."""

    def __init__(self, run: str, trained_on: str, serving: str, why: str | None = None):
        self.run, self.trained_on, self.serving, self.why = run, trained_on, serving, why
        super().__init__(f"run {run!r} was trained on {trained_on}, and this server serves {serving}, which cannot "
                         f"load it: start art-server with that model on this data directory to use the run, or "
                         f"choose another run name" + (f" ({why})" if why else ""))

    @property
    def line(self) -> str:
        """How /health and the log list it."""
        return f"run {self.run}: trained on {self.trained_on}; not served by this model ({self.serving})"

    def again(self) -> OtherModel:
        return OtherModel(self.run, self.trained_on, self.serving, self.why)


class RunRecord(RunSpec):
    """run.json: the run's spec, and the base model it belongs to (None in runs made before)."""

    base_fingerprint: str | None = None


def read_record(run_dir: Path) -> RunRecord | None:
    """The run's run.json; None when it is missing or cannot be read."""
    try:
        return RunRecord.model_validate_json((run_dir / "run.json").read_text())
    except (OSError, UnicodeDecodeError, ValidationError):
        return None


def write_record(run_dir: Path, record: RunRecord) -> None:
    """run.json, replaced whole: a crash leaves the old one or the new one."""
    run_dir.mkdir(parents=True, exist_ok=True)
    tmp = run_dir / "run.json.tmp"
    tmp.write_text(record.model_dump_json(indent=2))
    os.replace(tmp, run_dir / "run.json")


def checkpoint_shapes(adapter_file: Path) -> dict[str, tuple[int, ...]]:
    """Each tensor's shape in a checkpoint's adapter.safetensors (its header only)."""
    with safe_open(str(adapter_file), "pt") as f:
        return {k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}


def misfit(shapes: dict[str, tuple[int, ...]], linear: dict[str, tuple[int, int]], rank: int,
           targets: list[str]) -> Misfit | None:
    """Why a LoRA checkpoint of these shapes cannot be this run's on this model, or None when it
    fits. `linear`: the model's linear layers (path -> in, out features); `rank`, `targets`: the
    run's LoRA settings. Another model's layers or widths come first: then its settings are moot."""
    modules: dict[str, dict[str, tuple[int, ...]]] = {}
    for key, shape in shapes.items():
        m = _KEY.match(key)
        if m is None or len(shape) != 2:
            return "model", f"its checkpoint holds {key!r}, which is no LoRA layer of this model"
        modules.setdefault(m["module"], {})[m["ab"]] = shape
    ranks: Counter[int] = Counter()
    for path, ab in sorted(modules.items()):
        if path not in linear:
            return "model", f"its checkpoint adapts {path}, a layer this model does not have"
        (a_rank, a_in), (b_out, b_rank) = ab.get("A", (0, -1)), ab.get("B", (-1, 0))
        if (a_in, b_out) != linear[path]:
            return "model", (f"its {path} is {a_in} -> {b_out} wide, and this model's is "
                             f"{linear[path][0]} -> {linear[path][1]}")
        ranks[a_rank] += 1
        ranks[b_rank] += 1
    leaves = {p.rsplit(".", 1)[-1] for p in modules}
    want = {p for p in linear if p.rsplit(".", 1)[-1] in leaves}
    if set(modules) != want:  # this model has more layers of those kinds
        return "model", f"its checkpoint adapts {len(modules)} layers, and this model has {len(want)} of those kinds"
    if set(ranks) != {rank}:
        return "settings", f"its checkpoints have LoRA rank {ranks.most_common(1)[0][0]}, not {rank}"
    if leaves != set(targets):
        return "settings", (f"its checkpoints adapt {', '.join(sorted(leaves))}, not "
                            f"{', '.join(sorted(targets))}")
    return None


def check_fit(spec: RunSpec, adapter_file: Path, host: ModelHost, recorded_base: str | None) -> None:
    """Refuse a run whose checkpoint (its newest) this model, or the run's LoRA settings, cannot load."""
    shapes = checkpoint_shapes(adapter_file)
    found = misfit(shapes, host.linear_modules, spec.lora.rank, spec.lora.target_modules or host.lora_targets)
    if found is None:
        return
    kind, why = found
    if kind == "model":
        raise OtherModel(spec.name, recorded_base or describe(shapes), host.name, why)
    raise RunConflict(f"run {spec.name!r} was trained with other LoRA settings than these: {why}; give the "
                      f"settings it was trained with, or delete the run")


def describe(shapes: dict[str, tuple[int, ...]]) -> str:
    """A name for the model an unrecorded run was trained on: the embedded model when its shapes
    fit (the Quick start's), else what the shapes tell."""
    found = misfit(shapes, _embedded_linear(), 0, []) if shapes else ("model", "")
    if found is None or found[0] != "model":
        return f"{_embedded_name()} (the embedded model)"
    layers = {m.group(1) for k in shapes if (m := re.search(r"\.layers\.(\d+)\.", k))}
    widths = Counter(s[1] for k, s in shapes.items() if ".lora_A." in k and len(s) == 2)
    width = f", width {widths.most_common(1)[0][0]}" if widths else ""
    return f"an unrecorded model ({len(layers)} layers{width}; its run.json predates recorded base models)"


@functools.cache
def _embedded_linear() -> dict[str, tuple[int, int]]:
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    from server.model.architecture import linear_modules
    from server.settings import DEFAULT_MODEL_DIR

    with torch.device("meta"):  # shapes only: no memory, no weights read
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(DEFAULT_MODEL_DIR))
    return linear_modules(model)


def _embedded_name() -> str:
    from server.settings import DEFAULT_MODEL_DIR

    try:
        return json.loads((DEFAULT_MODEL_DIR / "artisan.json").read_text())["name"]
    except (OSError, ValueError, KeyError):
        return "the embedded model"
