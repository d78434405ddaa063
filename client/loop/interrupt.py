"""Ctrl-C ends a training run, even when something it awaits swallows the cancellation.

asyncio.run turns Ctrl-C into one cancellation of the main task. A single `except` that catches
it in any library the loop awaits (an HTTP client's timeout racing the cancel, a retry) and the run
goes on training as if nothing was pressed: `make test` once saw a run train two more steps for
two minutes after SIGINT. Here the signal is kept, and the main task is cancelled again every
RECANCEL_SECONDS until it ends, so no single swallowed cancellation can keep it alive.
"""

from __future__ import annotations

import asyncio
import signal
from typing import Any, Coroutine, TypeVar

T = TypeVar("T")
RECANCEL_SECONDS = 1.0


def run_interruptible(coro: Coroutine[Any, Any, T]) -> T:
    """`asyncio.run(coro)`, where Ctrl-C raises KeyboardInterrupt here once `coro` has unwound."""
    pressed = False

    async def main() -> T:
        task, loop = asyncio.current_task(), asyncio.get_running_loop()
        assert task is not None

        def cancel_until_done() -> None:
            if not task.done():
                task.cancel()
                loop.call_later(RECANCEL_SECONDS, cancel_until_done)

        def on_sigint() -> None:
            nonlocal pressed
            if not pressed:
                pressed = True
                cancel_until_done()

        loop.add_signal_handler(signal.SIGINT, on_sigint)
        try:
            return await coro
        finally:
            loop.remove_signal_handler(signal.SIGINT)

    try:
        return asyncio.run(main())
    except BaseException:
        if pressed:  # whatever the cancellation surfaced as on its way out, the user asked to stop
            raise KeyboardInterrupt from None
        raise
