"""Ctrl-C ends `client.train` even when something it awaits swallows asyncio's cancellation."""

import asyncio
import os
import signal

import pytest

from client.loop.interrupt import run_interruptible

pytestmark = pytest.mark.unit


async def _swallows_one_cancel() -> str:
    asyncio.get_running_loop().call_later(0.2, os.kill, os.getpid(), signal.SIGINT)
    try:
        await asyncio.sleep(30)
    except asyncio.CancelledError:
        pass  # a library's except that eats the cancel: plain asyncio.run would return "finished"
    await asyncio.sleep(30)
    return "finished"


def test_ctrl_c_ends_a_run_that_swallowed_the_first_cancellation():
    with pytest.raises(KeyboardInterrupt):
        run_interruptible(_swallows_one_cancel())


def test_without_ctrl_c_the_result_and_errors_pass_through():
    async def value() -> int:
        return 7

    async def fails() -> None:
        raise ValueError("bad")

    assert run_interruptible(value()) == 7
    with pytest.raises(ValueError, match="bad"):
        run_interruptible(fails())
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler  # the handler is given back
