"""The client's errors, and how the command line says each of them in one line.

Library code raises typed errors whose messages say what to do (`ServerError` with the HTTP
status, `ServerUnreachable`, `ConfigError`), so a user of `TrainableModel` gets the same advice as
a user of the CLI. `cli_errors()` is the one place that turns any of them into one line on
stderr and an exit status; the traceback is shown only with `--debug` or ARTISAN_DEBUG=1.
"""

from __future__ import annotations

import os
import sys
from contextlib import contextmanager
from typing import Iterator

from pydantic import ValidationError

from client.gather import TooManyExceptions

# Exit statuses of `python -m client.train`, so that scripts can tell them apart.
EXIT_ERROR = 1  # the server, a rollout or the code failed
EXIT_USAGE = 2  # an option that cannot work (as click reports its own usage errors)
EXIT_CANNOT_LEARN = 3  # the run trained nothing for --patience attempts in a row


class ServerError(RuntimeError):
    """The server refused a request (a 4xx with its message, `status` set) or a job failed."""

    def __init__(self, message: str, status: int | None = None):
        super().__init__(message)
        self.status = status


class ServerUnreachable(ServerError):
    """No answer at all from the server's address: nothing listens there, or the network is down."""

    def __init__(self, url: str, cause: BaseException):
        reason = "connection refused" if "refused" in str(cause).lower() or "all connection attempts" in \
            str(cause).lower() else f"{type(cause).__name__}: {cause}".rstrip(": ")
        super().__init__(f"cannot reach art-server at {url} ({reason}): start it with `art-server` on that "
                         f"host and port, or point the client at the address it runs on")
        self.url = url


class ConfigError(ValueError):
    """A setting that cannot work; the message names it and says what to write instead."""


class RunInUse(ConfigError):
    """Another client is training the run (it holds the run's lease, server/runs/leases.py)."""


class RunCannotLearn(RuntimeError):
    """Training attempts in a row trained nothing; the message says why (see client/loop/patience.py)."""

    def __init__(self, message: str, cause: str):
        super().__init__(message)
        self.cause = cause


def validation_line(exc: ValidationError, flags: dict[str, str] | None = None) -> str:
    """A pydantic error as `--flag VALUE: what is wrong`, one clause per field, on one line.
    `flags` maps a field name to the option that sets it, where they differ."""
    parts = []
    for err in exc.errors():
        field = str(err["loc"][-1]) if err["loc"] else ""
        flag = (flags or {}).get(field, "--" + field.replace("_", "-"))
        parts.append(f"{flag} {err.get('input')!r}: {err['msg']}")
    return "; ".join(parts)


def one_line(exc: BaseException) -> str:
    """What the CLI prints for `exc`: a sentence a user can act on, never a traceback."""
    if isinstance(exc, ServerError) and exc.status == 401:
        msg = ("the server refused the API key (401): pass --api-key KEY or set ARTISAN_API_KEY to the key "
               "art-server was started with")
    elif isinstance(exc, ValidationError):
        msg = validation_line(exc)
    elif isinstance(exc, (ServerError, ConfigError, RunCannotLearn, TooManyExceptions)):
        msg = str(exc)
    else:
        msg = f"{type(exc).__name__}: {exc} (run with --debug for the traceback)"
    return " ".join(msg.split())


def exit_status(exc: BaseException) -> int:
    if isinstance(exc, RunCannotLearn):
        return EXIT_CANNOT_LEARN
    if isinstance(exc, (ConfigError, ValidationError)):
        return EXIT_USAGE
    return EXIT_ERROR


def debugging(flag: bool = False) -> bool:
    return flag or os.environ.get("ARTISAN_DEBUG", "").lower() in ("1", "true", "yes")


@contextmanager
def cli_errors(debug: bool = False) -> Iterator[None]:
    """Run a CLI command: any error becomes `error: <one line>` on stderr and its exit status."""
    try:
        yield
    except Exception as exc:
        if debugging(debug):
            raise
        prefix = "" if isinstance(exc, RunCannotLearn) else "error: "  # a finding, not a failure of the tool
        print(prefix + one_line(exc), file=sys.stderr, flush=True)
        raise SystemExit(exit_status(exc)) from None
