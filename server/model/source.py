"""Where `--model` points: a local model directory, a Hugging Face hub id, or a `.gguf` file.

Everything ends as a local directory transformers loads. A hub id is downloaded (once, into the
hub cache) where the hub is reachable; a GGUF file is dequantised once into a plain model
directory cached beside the server's data, keyed by the file's content. Neither directory's name
says what the model is (a commit hash, a content hash), so such a model is served under the name
the user gave: the hub id, or the GGUF file's stem.
"""

from __future__ import annotations

import hashlib
import logging
import os
import re
import shutil
from pathlib import Path

log = logging.getLogger("artisan.model")
HUB_ID = re.compile(r"^[A-Za-z0-9][\w.-]*/[\w.-]+$")


class ModelSourceError(SystemExit):
    """`--model` names nothing this server can load; the message says what to do instead."""


def check(model: str | Path) -> None:
    """Refuse at once (before anything is loaded) what `--model` cannot name."""
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return
    if path.is_dir():
        if not (path / "config.json").exists():
            raise ModelSourceError(f"--model {path}: no config.json in that directory (is it a model directory?)")
        return
    if path.exists():
        raise ModelSourceError(f"--model {path}: expected a model directory or a .gguf file")
    if not HUB_ID.match(str(model)):
        raise ModelSourceError(f"--model {model}: no such file or directory, and not a Hugging Face hub id "
                               f"(owner/name)")


def resolve(model: str | Path, cache_dir: Path) -> Path:
    """A local directory holding config.json, tokenizer files and weights."""
    check(model)
    path = Path(model).expanduser()
    if path.is_file():
        return from_gguf(path, cache_dir)
    return path if path.is_dir() else from_hub(str(model))


def served_name(model: str | Path) -> str | None:
    """The name a model is served under unless `--served-model-name` says: a GGUF file's stem
    (`SmolLM2-135M-Instruct.Q4_1`), a hub id as given; None for a directory (its own name)."""
    path = Path(model).expanduser()
    if path.is_file() and path.suffix == ".gguf":
        return path.stem
    if not path.exists() and HUB_ID.match(str(model)):
        return str(model)
    return None


def hub_patterns(files: list[str]) -> list[str]:
    """What to download of a hub repo's files: config, tokenizer, template, and one copy of the
    weights (safetensors where the repo has them, else PyTorch .bin), never the duplicates some
    repos ship for other runtimes (Mistral's consolidated.safetensors, Llama's original/). With no
    listing (offline, answered from the local cache), the safetensors there."""
    weights = [f for f in files if f.endswith(".safetensors") and "/" not in f and not f.startswith("consolidated")]
    if not weights:
        weights = [f for f in files if f.startswith("pytorch_model") and f.endswith(".bin")] or ["*.safetensors"]
    return ["*.json", "*.jinja", "*.model", "*.txt", "*.tiktoken", *weights]


def from_hub(repo_id: str) -> Path:
    from huggingface_hub import list_repo_files, snapshot_download

    try:
        files = list_repo_files(repo_id)
    except Exception:  # offline: snapshot_download may still find it in the local cache
        files = []
    try:
        return Path(snapshot_download(repo_id, allow_patterns=hub_patterns(files)))
    except Exception as e:  # offline, unknown repo, gated: all end the same way for the user
        raise ModelSourceError(f"--model {repo_id}: could not download it from the Hugging Face hub "
                               f"({type(e).__name__}: {str(e).splitlines()[0][:200]}); download it elsewhere and "
                               f"pass the local directory") from None


def _digest(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(1 << 22):
            h.update(block)
    return h.hexdigest()[:16]


def from_gguf(path: Path, cache_dir: Path) -> Path:
    """Dequantise a GGUF file into a float32 model directory, once per file content."""
    target = cache_dir / f"{path.stem}-{_digest(path)}"
    if (target / "config.json").exists():
        return target
    try:
        import torch
        from transformers import AutoModelForCausalLM, AutoTokenizer
    except ImportError as e:  # pragma: no cover - the server's own dependencies
        raise ModelSourceError(f"--model {path}: {e}") from None
    log.info("dequantising %s into %s (once)", path, target)
    tmp = target.with_name(target.name + f".tmp-{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    try:
        tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
        model = AutoModelForCausalLM.from_pretrained(path.parent, gguf_file=path.name, dtype=torch.float32)
    except ImportError as e:
        raise ModelSourceError(f"--model {path}: reading GGUF needs the `gguf` and `accelerate` packages ({e})") from None
    # The weights are plain float32 now; nothing about them is quantised any more.
    model.config.quantization_config = None
    del model.config.quantization_config
    model.hf_quantizer, model.is_quantized = None, False
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        os.replace(tmp, target)
    except OSError:  # another server dequantised the same file first, or the disk is full
        if not (target / "config.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)  # a GB-sized half-written copy never stays behind
    return target
