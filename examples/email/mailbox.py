"""A generated mailbox in SQLite with FTS5 full-text search, and the facts its questions come from.

The mailbox is a pure function of its seed: one owner's inbox for 2024, several thousand messages
from colleagues, shops, billing departments and airlines, in date order. Some messages state
facts (an order's number, total and delivery date; a meeting's place and date; an invoice's amount
and due date; a flight's confirmation code); the rest are chatter and promotions that share their
words (the same shops, items and topics, other amounts), so finding the right message takes a
search that names what the question names.

The SQLite file is built on first use into a cache folder (`ARTISAN_EMAIL_CACHE`, by default
`~/.cache/artisan/email`), named by seed, size and `VERSION`, written to a temporary file and
renamed into place, so concurrent first users never read half a database.
"""

from __future__ import annotations

import datetime as dt
import os
import random
import re
import sqlite3
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any

VERSION = 1  # bump when generation changes: the cache file name carries it
DEFAULT_SEED = 2024
DEFAULT_SIZE = 4000
OWNER = ("Jordan Lee", "jordan.lee@northwind.example")
YEAR = 2024

FIRST = ["Ava", "Ben", "Chloe", "Daniel", "Elena", "Felix", "Grace", "Hugo", "Iris", "Jonas", "Kara", "Liam",
         "Maya", "Noah", "Olivia", "Priya", "Quinn", "Rosa", "Samir", "Tara", "Umar", "Vera", "Wes", "Yara"]
LAST = ["Novak", "Okafor", "Patel", "Quist", "Reyes", "Sato", "Tanaka", "Ueda", "Varga", "Weber", "Xu", "Young"]
SHOPS = ["Parcel Peak", "Gadget Barn", "Home Harbor", "Trail Outfitters", "Page & Quill", "Kitchen Craft",
         "Bright Pixel", "Green Thumb"]
ITEMS = ["desk lamp", "standing desk", "coffee grinder", "hiking boots", "rain jacket", "bookshelf", "monitor arm",
         "wireless keyboard", "noise-cancelling headphones", "cast iron skillet", "chef's knife", "yoga mat",
         "water filter", "office chair", "camping stove", "backpack", "electric kettle", "webcam", "trail map set",
         "garden hose", "plant pots", "sleeping bag", "blender", "paper notebook set", "fountain pen",
         "portable charger", "smart thermostat", "bike helmet", "air purifier", "french press"]
PLACES = ["Room 4B", "the Harbor Cafe", "Conference Room Maple", "the Blue Door Bistro", "Room 12A",
          "the rooftop terrace", "Conference Room Cedar", "the library lounge", "Room 7C", "the Corner Bakery",
          "Conference Room Birch", "the lobby coffee bar", "Room 3F", "the Riverside Diner", "Studio 2",
          "the Oak Street office", "Conference Room Pine", "the atrium", "Room 9D", "the Lantern Tea House"]
TOPICS = ["the Q3 budget", "the vendor contract", "the onboarding plan", "the website redesign", "the hiring plan",
          "the product roadmap", "the customer survey", "the security audit", "the office move", "the launch checklist",
          "the pricing review", "the partner workshop", "the annual report", "the data migration",
          "the support backlog", "the sales forecast", "the training schedule", "the design sprint"]
CITIES = ["Lisbon", "Denver", "Toronto", "Osaka", "Nairobi", "Oslo", "Austin", "Seoul", "Dublin", "Lima",
          "Prague", "Boston", "Perth", "Madrid", "Chicago"]
AIRLINES = [("Skyline Air", "SK"), ("Northwind Airways", "NW"), ("Coastal Jet", "CJ")]
MONTHS = ["January", "February", "March", "April", "May", "June", "July", "August", "September", "October",
          "November", "December"]
CHATTER = [
    ("Lunch on {weekday}?", "Hi Jordan,\n\nAnyone up for lunch on {weekday}? I was thinking somewhere near {place}.\n\n{first}"),
    ("Notes from today", "Hi all,\n\nQuick notes from today's sync on {topic}: we agreed to keep going as planned and "
     "check in again next week.\n\nBest,\n{first}"),
    ("Re: {topic}", "Thanks Jordan, I'll take a look at {topic} and get back to you by the end of the week.\n\n{first}"),
    ("Slides", "Hi Jordan,\n\nAttached are the slides about {topic}. Let me know what you think.\n\n{first}"),
    ("Out of office", "Hi,\n\nI am out of the office until {date}. For anything urgent about {topic}, please "
     "contact the team.\n\n{first}"),
]
PROMOS = [
    ("{shop} deals this week", "Hi Jordan,\n\nThis week at {shop}: the {item} is now ${price}. Don't miss out!\n\n"
     "The {shop} team"),
    ("Back in stock at {shop}", "Good news! The {item} you looked at is back in stock for ${price}.\n\nThe {shop} team"),
    ("How did we do?", "Hi Jordan,\n\nThanks for shopping with {shop}. Tell us about your {item} and get ${price} "
     "off your next order.\n\nThe {shop} team"),
]


@dataclass
class Message:
    id: str
    sender_name: str
    sender: str
    date: dt.datetime
    subject: str
    body: str


@dataclass
class Fact:
    """A fact one message states, with what a question about it must name to be unambiguous."""

    kind: str  # what the answer is: "amount", "date", "order_number", "invoice_number", "place", "code"
    answer: str  # as the message writes it
    message_id: str
    question: str
    key: tuple[str, ...] = ()  # what the question names; unique in the mailbox


def long_date(day: dt.date) -> str:
    return f"{MONTHS[day.month - 1]} {day.day}, {day.year}"


def _slug(text: str) -> str:
    return re.sub(r"[^a-z0-9]+", ".", text.lower()).strip(".")


class _Generator:
    def __init__(self, seed: int):
        self.rng = random.Random(seed)
        self.people = [(f"{f} {ln}", f"{_slug(f)}.{_slug(ln)}@northwind.example") for f in FIRST for ln in LAST]
        self.used_ids: set[str] = set()

    def day(self) -> dt.datetime:
        start = dt.datetime(YEAR, 1, 1, 7, 0)
        return start + dt.timedelta(days=self.rng.randrange(365), minutes=self.rng.randrange(12 * 60))

    def unique(self, make) -> str:
        while True:
            value = make()
            if value not in self.used_ids:
                self.used_ids.add(value)
                return value

    def amount(self) -> str:
        return f"{self.rng.randint(12, 1900)}.{self.rng.choice(['00', '49', '95', '99', str(self.rng.randint(10, 89))])}"

    def order(self, when: dt.datetime) -> tuple[dict[str, Any], list[Fact]]:
        shop, item = self.rng.choice(SHOPS), self.rng.choice(ITEMS)
        number = self.unique(lambda: f"W{self.rng.randint(1_000_000, 9_999_999)}")
        total = self.amount()
        arrives = long_date((when + dt.timedelta(days=self.rng.randint(2, 9))).date())
        msg = dict(sender_name=shop, sender=f"orders@{_slug(shop)}.example",
                   subject=self.rng.choice([f"Your {shop} order has shipped", f"{shop}: shipping confirmation",
                                            "Your order is on its way"]),
                   body=f"Hi Jordan,\n\nGood news: your order #{number} ({item}) has shipped. Order total: ${total}. "
                        f"Expected delivery: {arrives}.\n\nThanks for shopping with {shop}.")
        key = ("order", shop, item)
        return msg, [
            Fact("order_number", f"#{number}", "", f"What is the order number of the {item} I ordered from {shop}?", key),
            Fact("amount", f"${total}", "", f"How much was the order total for the {item} from {shop}?", key),
            Fact("date", arrives, "", f"On what date is the {item} from {shop} expected to be delivered?", key),
        ]

    def meeting(self, when: dt.datetime) -> tuple[dict[str, Any], list[Fact]]:
        (name, address), topic, place = self.rng.choice(self.people), self.rng.choice(TOPICS), self.rng.choice(PLACES)
        day = (when + dt.timedelta(days=self.rng.randint(1, 14))).date()
        time = f"{self.rng.randint(9, 16)}:{self.rng.choice(['00', '15', '30', '45'])}"
        msg = dict(sender_name=name, sender=address,
                   subject=self.rng.choice([f"Meeting about {topic}", f"Catch up on {topic}", f"Re: {topic}"]),
                   body=f"Hi Jordan,\n\nCan we meet on {day.strftime('%A')}, {long_date(day)} at {time} in {place} to go "
                        f"over {topic}?\n\nThanks,\n{name.split()[0]}")
        key = ("meeting", name, topic)
        return msg, [
            Fact("place", place, "", f"Where is my meeting with {name} about {topic}?", key),
            Fact("date", long_date(day), "", f"On what date is my meeting with {name} about {topic}?", key),
        ]

    def invoice(self, when: dt.datetime) -> tuple[dict[str, Any], list[Fact]]:
        shop = self.rng.choice(SHOPS)
        number = self.unique(lambda: f"INV-{self.rng.randint(10_000, 99_999)}")
        total, due = self.amount(), long_date((when + dt.timedelta(days=self.rng.choice([14, 30]))).date())
        msg = dict(sender_name=f"{shop} Billing", sender=f"billing@{_slug(shop)}.example",
                   subject=self.rng.choice([f"Invoice {number}", f"{shop} invoice", "Your invoice is ready"]),
                   body=f"Hello Jordan,\n\nInvoice {number} for ${total} is attached. Payment is due on {due}.\n\n"
                        f"{shop} Billing")
        key = ("invoice", number)
        return msg, [
            Fact("amount", f"${total}", "", f"How much is invoice {number} from {shop} for?", key),
            Fact("date", due, "", f"When is payment for invoice {number} due?", key),
        ]

    def flight(self, when: dt.datetime) -> tuple[dict[str, Any], list[Fact]]:
        (airline, prefix), city = self.rng.choice(AIRLINES), self.rng.choice(CITIES)
        day = (when + dt.timedelta(days=self.rng.randint(7, 40))).date()
        letters = "ABCDEFGHJKLMNPQRSTUVWXYZ"

        def code() -> str:  # letters and at least one digit, so it is not a word
            chars = [self.rng.choice(letters + "23456789") for _ in range(5)] + [self.rng.choice("23456789")]
            self.rng.shuffle(chars)
            return "".join(chars)

        confirmation = self.unique(code)
        msg = dict(sender_name=airline, sender=f"trips@{_slug(airline)}.example",
                   subject=f"Your trip to {city}",
                   body=f"Dear Jordan Lee,\n\nYour flight {prefix}{self.rng.randint(100, 999)} to {city} departs on "
                        f"{long_date(day)}. Confirmation code: {confirmation}.\n\n{airline}")
        month = MONTHS[day.month - 1]
        return msg, [Fact("code", confirmation, "", f"What is the confirmation code of my flight to {city} in {month}?",
                          ("flight", city, month))]

    def filler(self, when: dt.datetime) -> dict[str, Any]:
        if self.rng.random() < 0.5:
            subject, body = self.rng.choice(PROMOS)
            shop = self.rng.choice(SHOPS)
            values = dict(shop=shop, item=self.rng.choice(ITEMS), price=self.amount())
            sender_name, sender = shop, f"news@{_slug(shop)}.example"
        else:
            subject, body = self.rng.choice(CHATTER)
            sender_name, sender = self.rng.choice(self.people)
            values = dict(weekday=when.strftime("%A"), place=self.rng.choice(PLACES), topic=self.rng.choice(TOPICS),
                          first=sender_name.split()[0],
                          date=long_date((when + dt.timedelta(days=self.rng.randint(2, 10))).date()))
        return dict(sender_name=sender_name, sender=sender, subject=subject.format(**values),
                    body=body.format(**values))


def generate(seed: int = DEFAULT_SEED, size: int = DEFAULT_SIZE) -> tuple[list[Message], list[Fact]]:
    """The mailbox's messages in date order (ids m0001, m0002, ...) and the facts they state."""
    gen = _Generator(seed)
    drafts: list[tuple[dt.datetime, dict[str, Any], list[Fact]]] = []
    makers = [(gen.order, 0.16), (gen.meeting, 0.14), (gen.invoice, 0.10), (gen.flight, 0.04)]
    for _ in range(size):
        when, roll = gen.day(), gen.rng.random()
        for make, share in makers:
            if roll < share:
                msg, facts = make(when)
                break
            roll -= share
        else:
            msg, facts = gen.filler(when), []
        drafts.append((when, msg, facts))
    drafts.sort(key=lambda d: d[0])
    # A question names its fact by a key (a shop and an item, a colleague and a topic); a key two
    # messages share would make the question ambiguous, so it asks nothing.
    senders: dict[tuple[str, ...], int] = {}
    for _, _, found in drafts:
        for key in {f.key for f in found}:
            senders[key] = senders.get(key, 0) + 1
    messages, facts = [], []
    for i, (when, msg, found) in enumerate(drafts, start=1):
        mid = f"m{i:04d}"
        messages.append(Message(id=mid, date=when, **msg))
        facts += [Fact(f.kind, f.answer, mid, f.question, f.key) for f in found if senders[f.key] == 1]
    return messages, facts


def cache_dir() -> Path:
    return Path(os.environ.get("ARTISAN_EMAIL_CACHE") or Path.home() / ".cache" / "artisan" / "email")


def build(path: Path, seed: int = DEFAULT_SEED, size: int = DEFAULT_SIZE) -> Path:
    """Write the mailbox's SQLite file at `path` (atomically)."""
    messages, _ = generate(seed, size)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    os.close(fd)
    try:
        with sqlite3.connect(tmp) as db:
            db.executescript("""
                CREATE TABLE messages (id TEXT PRIMARY KEY, sender_name TEXT, sender TEXT, recipient TEXT,
                                       date TEXT, subject TEXT, body TEXT);
                CREATE INDEX messages_date ON messages(date);
                CREATE VIRTUAL TABLE messages_fts USING fts5(subject, body, sender_name,
                                                             content='messages', content_rowid='rowid',
                                                             tokenize='porter unicode61');
            """)
            db.executemany("INSERT INTO messages VALUES (?, ?, ?, ?, ?, ?, ?)",
                           [(m.id, m.sender_name, m.sender, OWNER[1], m.date.isoformat(timespec="minutes"),
                             m.subject, m.body) for m in messages])
            db.execute("INSERT INTO messages_fts(messages_fts) VALUES ('rebuild')")
        db.close()
        os.chmod(tmp, 0o644)
        os.replace(tmp, path)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    return path


def mailbox_path(seed: int = DEFAULT_SEED, size: int = DEFAULT_SIZE, folder: Path | None = None) -> Path:
    """The mailbox's SQLite file, built if this cache does not hold it yet."""
    path = (folder or cache_dir()) / f"mailbox-v{VERSION}-seed{seed}-n{size}.sqlite"
    return path if path.exists() else build(path, seed, size)


class SearchError(ValueError):
    """A search or read the mailbox cannot do (bad date, unknown id, nothing to search for)."""


_DAY = re.compile(r"^\d{4}-\d{2}-\d{2}$")


def _day(value: str | None, name: str) -> str | None:
    if value in (None, ""):
        return None
    if not isinstance(value, str) or not _DAY.match(value):
        raise SearchError(f"{name} must be a date like 2024-03-31, got {value!r}")
    try:
        dt.date.fromisoformat(value)
    except ValueError:
        raise SearchError(f"{name} {value!r} is not a calendar date") from None
    return value


class Mailbox:
    """Read-only access to one mailbox file: full-text search and reading by id."""

    def __init__(self, path: Path):
        self.db = sqlite3.connect(f"file:{path}?mode=ro", uri=True, check_same_thread=False)

    def close(self) -> None:
        self.db.close()

    def search(self, keywords: str | list[str] | None = None, sender: str | None = None,
               sent_after: str | None = None, sent_before: str | None = None, max_results: int = 10) -> list[dict[str, str]]:
        """Messages matching any of the keywords (best BM25 rank first), optionally only from a
        sender (a part of the name or address) and within dates (inclusive, YYYY-MM-DD).

        Any keyword, not all: a small model's searches carry words the message does not have, and
        BM25 still ranks the messages that have most of them first."""
        if isinstance(keywords, list):
            keywords = " ".join(str(k) for k in keywords)
        if keywords is not None and not isinstance(keywords, str):
            raise SearchError("keywords must be a string or a list of strings")
        words = re.findall(r"\w+", keywords or "")
        after, before = _day(sent_after, "sent_after"), _day(sent_before, "sent_before")
        if not isinstance(max_results, int) or isinstance(max_results, bool) or not 1 <= max_results <= 50:
            raise SearchError("max_results must be a whole number from 1 to 50")
        if not words and not sender and not after and not before:
            raise SearchError("give keywords, a sender or a date range to search for")
        where, params = [], []
        if words:
            where.append("messages_fts MATCH ?")
            params.append(" OR ".join(f'"{w}"' for w in words))
        if sender:
            where.append("(m.sender LIKE ? OR m.sender_name LIKE ?)")
            params += [f"%{sender}%"] * 2
        if after:
            where.append("m.date >= ?")
            params.append(after)
        if before:
            where.append("m.date < date(?, '+1 day')")
            params.append(before)
        if words:
            sql = ("SELECT m.id, m.sender, m.date, m.subject, snippet(messages_fts, 1, '', '', '...', 12) "
                   "FROM messages_fts JOIN messages m ON m.rowid = messages_fts.rowid "
                   f"WHERE {' AND '.join(where)} ORDER BY rank LIMIT ?")
        else:
            sql = (f"SELECT m.id, m.sender, m.date, m.subject, substr(m.body, 1, 80) FROM messages m "
                   f"WHERE {' AND '.join(where)} ORDER BY m.date DESC LIMIT ?")
        rows = self.db.execute(sql, [*params, max_results]).fetchall()
        return [{"message_id": r[0], "from": r[1], "date": r[2], "subject": r[3], "snippet": " ".join(r[4].split())}
                for r in rows]

    def read(self, message_id: str) -> dict[str, str]:
        if not isinstance(message_id, str):
            raise SearchError("message_id must be a string like m0042")
        row = self.db.execute("SELECT id, sender_name, sender, recipient, date, subject, body FROM messages WHERE id = ?",
                              (message_id.strip(),)).fetchone()
        if row is None:
            raise SearchError(f"no message with id {message_id!r}; ids look like m0042 (from search_inbox)")
        keys = ("message_id", "from_name", "from", "to", "date", "subject", "body")
        return dict(zip(keys, row))

    def count(self) -> int:
        return self.db.execute("SELECT count(*) FROM messages").fetchone()[0]
