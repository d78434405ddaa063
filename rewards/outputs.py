"""Check that the agent's answer states what the task requires (a price, a status, an id).

Matching is case-insensitive and forgiving about how numbers are written ("1,234.50" states
"1234.5"), but a number never matches inside a longer one ("54.1" is not in "$254.10").
"""

from __future__ import annotations

import re
from typing import Iterable, Sequence

from pydantic import BaseModel

_THOUSANDS_COMMA = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
_DECIMAL = re.compile(r"(?<![\d.])(\d+)\.(\d+)(?![\d.]*\d)")
_SPACES = re.compile(r"\s+")


class OutputsCheck(BaseModel):
    found: list[str]
    missing: list[str]
    fraction: float  # found / required; 1.0 when nothing is required

    @property
    def all_found(self) -> bool:
        return not self.missing


def normalize_text(text: str) -> str:
    """Lower-case, single spaces, numbers without thousands separators or trailing decimal zeros."""
    text = _THOUSANDS_COMMA.sub("", text.casefold())
    text = _DECIMAL.sub(_trim_decimal, text)
    return _SPACES.sub(" ", text).strip()


def contains_output(answer: str, required: str) -> bool:
    needle = normalize_text(required)
    if not needle:
        return True
    # Digit boundaries only where the needle itself starts or ends with a digit.
    before = r"(?<!\d)(?<!\d\.)" if needle[0].isdigit() else ""
    after = r"(?!\.?\d)" if needle[-1].isdigit() else ""
    return re.search(before + re.escape(needle) + after, normalize_text(answer)) is not None


def check_outputs(answers: str | Iterable[str], required: Sequence[str]) -> OutputsCheck:
    """Which required outputs appear in the answer (or in any of several answers)."""
    texts = [answers] if isinstance(answers, str) else list(answers)
    found = [r for r in required if any(contains_output(t, r) for t in texts)]
    missing = [r for r in required if r not in found]
    return OutputsCheck(found=found, missing=missing, fraction=len(found) / len(required) if required else 1.0)


def _trim_decimal(m: re.Match[str]) -> str:
    frac = m.group(2).rstrip("0")
    return f"{m.group(1)}.{frac}" if frac else m.group(1)
