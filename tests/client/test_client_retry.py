"""The client waits out a server restart (20-140 s for a real model) and says that it is waiting;
how long it waits is the caller's to set. It used to give up after about 15 s."""

from __future__ import annotations

import threading
import time

import pytest

from client import TrainableModel
from client.errors import ServerUnreachable
from conftest import ServerProcess

OUTAGE = 20.0  # seconds the server stays down, before its own start-up time


async def test_a_call_during_a_restart_waits_for_the_server_and_says_so(tmp_path, capsys):
    first = ServerProcess(tmp_path / "data").start()
    again = ServerProcess(tmp_path / "data", port=first.port)

    def restart() -> None:
        time.sleep(OUTAGE)
        again.start()

    try:
        model = await TrainableModel("restarting").register(first.url)
        first.stop()
        thread = threading.Thread(target=restart)
        thread.start()
        try:
            assert await model.get_step() == 0  # asked while nothing listens on the port
        finally:
            thread.join()
    finally:
        first.stop()
        again.stop()
    err = capsys.readouterr().err
    assert f"waiting for the server at {first.url}" in err and "ARTISAN_RETRY_SECONDS" in err, err


async def test_the_wait_is_bounded_by_retry_seconds(tmp_path):
    srv = ServerProcess(tmp_path / "data").start()

    with pytest.raises(ServerUnreachable):
        model = await TrainableModel("bounded", retry_seconds=2).register(srv.url)
        srv.stop()
        await model.get_step()
