"""Exact match of an answer against a fact, after normalising how the fact is written.

An answer matches when it states the reference value and no other value of the same kind:
"$1,234.50", "1234.5 dollars" and "USD 1234.50" are one amount; "March 4, 2024", "2024-03-04",
"4 March" and "3/4/2024" one date; "#W1234567" and "w1234567" one order number. Listing several
candidates is not an answer ("$12.00 or $14.00" does not match either).
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from examples.email.mailbox import MONTHS, PLACES

_MONTH = {m.lower(): i for i, m in enumerate(MONTHS, start=1)} | {m[:3].lower(): i for i, m in enumerate(MONTHS, start=1)}
_MONTH_RE = "|".join(sorted(_MONTH, key=len, reverse=True))
_DATES = [
    (re.compile(r"\b(\d{4})-(\d{1,2})-(\d{1,2})\b"), lambda m: (int(m[1]), int(m[2]), int(m[3]))),
    (re.compile(rf"\b({_MONTH_RE})\.?\s+(\d{{1,2}})(?:st|nd|rd|th)?\b(?:,?\s*(\d{{4}}))?", re.I),
     lambda m: (int(m[3]) if m[3] else None, _MONTH[m[1].lower()], int(m[2]))),
    (re.compile(rf"\b(\d{{1,2}})(?:st|nd|rd|th)?\s+(?:of\s+)?({_MONTH_RE})\b\.?(?:,?\s*(\d{{4}}))?", re.I),
     lambda m: (int(m[3]) if m[3] else None, _MONTH[m[2].lower()], int(m[1]))),
    (re.compile(r"\b(\d{1,2})/(\d{1,2})/(\d{4})\b"), lambda m: (int(m[3]), int(m[1]), int(m[2]))),  # US order
]
_MONEY = re.compile(r"(?:\$|usd\s*)\s*(\d[\d,]*(?:\.\d+)?)|(\d[\d,]*(?:\.\d+)?)\s*(?:dollars|usd)\b", re.I)
_NUMBER = re.compile(r"(?<![\w.])(\d[\d,]*(?:\.\d+)?)(?![\w])")
_ORDER = re.compile(r"#?\b(W\d{7})\b", re.I)
_CODE = re.compile(r"\b([A-Z0-9]{6})\b")


def _decimal(text: str) -> Decimal | None:
    try:
        return Decimal(text.replace(",", "")).normalize()
    except InvalidOperation:
        return None


def amounts(text: str) -> set[Decimal]:
    found = {_decimal(a or b) for a, b in _MONEY.findall(text)}
    if not found:  # a bare number is an amount only when nothing is marked as money
        found = {_decimal(n) for n in _NUMBER.findall(text)}
    return {d for d in found if d is not None}


def dates(text: str) -> set[tuple[int | None, int, int]]:
    found: set[tuple[int | None, int, int]] = set()
    spans: list[tuple[int, int]] = []
    for pattern, parse in _DATES:
        for m in pattern.finditer(text):
            if any(s <= m.start() < e for s, e in spans):  # "2024-03-04" is not also "3/4"
                continue
            year, month, day = parse(m)
            if 1 <= month <= 12 and 1 <= day <= 31:
                found.add((year, month, day))
                spans.append(m.span())
    return found


def _same_dates(found: set[tuple[int | None, int, int]], reference: tuple[int | None, int, int]) -> bool:
    # "March 4" names the same day as "March 4, 2024": a year left out is not another date.
    return bool(found) and all(d[1:] == reference[1:] and d[0] in (None, reference[0]) for d in found)


def _words(text: str) -> str:
    text = re.sub(r"[^a-z0-9]+", " ", text.lower()).strip()
    return re.sub(r"^(?:the|at|in)\s+", "", text)


def places(text: str) -> set[str]:
    words = f" {_words(text)} "
    return {p for p in PLACES if f" {_words(p)} " in words}


def exact_match(kind: str, answer: str | None, reference: str) -> bool:
    """True when `answer` states `reference` (a fact of kind `kind`) and no other value of that kind."""
    if not answer:
        return False
    if kind == "amount":
        return amounts(answer) == amounts(reference)
    if kind == "date":
        (ref,) = dates(reference)
        return _same_dates(dates(answer), ref)
    if kind == "order_number":
        return {m.upper() for m in _ORDER.findall(answer)} == {m.upper() for m in _ORDER.findall(reference)}
    if kind == "code":  # six letters and digits, at least one digit (a word is not a code)
        return {c for c in _CODE.findall(answer.upper()) if re.search(r"\d", c)} == {reference.upper()}
    if kind == "place":
        return places(answer) == {reference}
    raise ValueError(f"unknown answer kind {kind!r}")
