"""litellm, imported so that it never reaches for the network on import."""

from __future__ import annotations

import os
from typing import Any


def import_litellm() -> Any:
    # litellm fetches its model price list at import unless told to use the bundled copy; on an
    # offline box (CI, a GPU node behind a firewall) that fetch only waits and fails.
    os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
    import litellm

    return litellm
