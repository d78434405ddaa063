"""The pure parts of Ray rollouts (client/loop/ray_rollouts.py) and their flags; the pool itself runs in
tests/ray/test_ray_rollouts.py on a local cluster."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

import client
from client.errors import ConfigError
from client.loop.ray_rollouts import (CLIENT_PACKAGES, RayWorkers, address_host_port, least_busy, lost_message,
                                 loopback_unreachable, not_started_line, package_dirs, packages_to_ship,
                                 started_within)
from client.loop.config import LoopConfig
from client.train import loop_config, ray_options
from tests.conftest import ROOT, free_port

pytestmark = pytest.mark.unit


def test_workers_get_our_client_side_packages_and_the_examples_own():
    assert packages_to_ship("examples.demo.task") == list(CLIENT_PACKAGES)
    assert packages_to_ship("my_pkg.tasks.shop") == [*CLIENT_PACKAGES, "my_pkg"]
    assert packages_to_ship("__main__") == list(CLIENT_PACKAGES)  # a script's classes: nothing to ship by name
    assert "server" not in CLIENT_PACKAGES  # the server's packages carry model weights, and workers never need them


def test_the_code_shipped_is_the_code_the_driver_imports():
    assert package_dirs(["client", "no_such_package_here"]) == [str(Path(client.__file__).parent)]
    assert all(Path(d).is_dir() for d in package_dirs(list(CLIENT_PACKAGES)))


def test_a_rollout_goes_to_the_least_busy_worker_and_waits_when_all_are_full():
    assert least_busy([3, 1, 2], limit=4) == 1
    assert least_busy([2, 2, 2], limit=4) == 0  # the first among equals
    assert least_busy([4, 4], limit=4) is None
    assert least_busy([0], limit=1) == 0


def test_a_loopback_server_address_is_refused_when_workers_run_elsewhere():
    other = ["10.0.0.7/ab12cd34", "10.0.0.5/ffee0011"]
    msg = loopback_unreachable("http://127.0.0.1:8000", "10.0.0.5", other)
    assert msg is not None and "10.0.0.7" in msg and "10.0.0.5," not in msg and "\n" not in msg
    assert loopback_unreachable("http://localhost:8000", "10.0.0.5", other) is not None
    assert loopback_unreachable("http://[::1]:8000", "10.0.0.5", other) is not None
    # every worker on the driver's machine, or a server address the cluster can reach: fine
    assert loopback_unreachable("http://127.0.0.1:8000", "10.0.0.5", ["10.0.0.5/ab12cd34"]) is None
    assert loopback_unreachable("http://10.0.0.5:8000", "10.0.0.5", other) is None
    assert loopback_unreachable("https://gpu-box.internal", "10.0.0.5", other) is None


def test_a_lost_worker_is_named_on_one_line():
    msg = lost_message("run.rollouts.ab12cd.1", "10.0.0.7/ab12cd34", RuntimeError("The actor died.\nDetails..."))
    assert msg == "rollout worker run.rollouts.ab12cd.1 (node 10.0.0.7/ab12cd34) was lost mid-rollout: The actor died."
    assert lost_message("w", "n", RuntimeError()).endswith("mid-rollout: RuntimeError")


def test_the_ray_flags_become_loop_config():
    assert ray_options(None, None, None) is None
    with pytest.raises(ConfigError, match="--ray-workers and --ray-worker-concurrency need --ray-address"):
        ray_options(None, 3, None)
    assert ray_options("10.0.0.5:6379", None, None) == {"address": "10.0.0.5:6379"}
    cfg = LoopConfig(ray=ray_options("10.0.0.5:6379", 4, None))
    assert cfg.ray == RayWorkers(address="10.0.0.5:6379", workers=4, concurrency=32)
    assert LoopConfig().ray is None  # without --ray-address rollouts run here, as before


def test_a_bad_ray_flag_is_one_line_naming_it():
    base = dict(server="http://127.0.0.1:8000", run="r", project="default", reward="env",
                train={"loss": "ppo"})
    with pytest.raises(ConfigError, match=r"^--ray-workers 0: Input should be greater than or equal to 1$"):
        loop_config(**base, ray=ray_options("10.0.0.5:6379", 0, None))
    with pytest.raises(ConfigError, match=r"^--ray-worker-concurrency -1: "):
        loop_config(**base, ray=ray_options("10.0.0.5:6379", None, -1))


def test_the_client_imports_ray_only_when_asked():
    proc = subprocess.run([sys.executable, "-c", "import sys, client.train, client.loop.ray_rollouts; "
                           "print(sorted(m for m in sys.modules if m.split('.')[0] in ('ray', 'torch')))"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "[]"


def test_the_host_and_port_of_a_ray_address():
    assert address_host_port("10.0.0.5:6379") == ("10.0.0.5", 6379)
    assert address_host_port("ray://head.internal:10001") == ("head.internal", 10001)
    assert address_host_port("auto") is None and address_host_port("local") is None
    assert address_host_port("head:notaport") is None


def test_a_ray_address_where_nothing_answers_is_one_line_at_once():
    """ray.init retries such an address for minutes; the run says so before it starts anything
    (here, before it even contacts the server, which is not there either)."""
    port = free_port()
    proc = subprocess.run([sys.executable, "-m", "client.train", "--server", f"http://127.0.0.1:{free_port()}",
                           "--ray-address", f"127.0.0.1:{port}", "--no-progress"],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2, proc.stdout + proc.stderr
    assert proc.stderr.startswith(f"error: --ray-address 127.0.0.1:{port}: nothing answers there")
    assert proc.stderr.count("\n") == 1


async def test_a_start_that_waits_for_the_cluster_says_what_it_waits_for(capsys):
    """`--ray-address auto` beside `art-server --replicas 2` on a 2-CPU machine: the replicas held
    both CPUs and the client printed nothing for 150 s. A start that takes longer than a few
    seconds says so once, with the CPUs it needs and the cluster's free ones."""
    import asyncio

    async def slow(seconds: float) -> str:
        await asyncio.sleep(seconds)
        return "started"

    line = not_started_line(2, {"CPU": 0.0}, {"CPU": 2.0})
    assert line.startswith("ray: waiting for 2 CPUs for the 2 rollout workers (0 of the cluster's 2 are free")
    assert "--ray-workers" in line and "ray start --num-cpus" in line
    assert "installing" in not_started_line(2, {"CPU": 6.0}, {"CPU": 8.0})  # CPUs are free: something else
    assert await started_within(slow(0.3), 5.0, lambda: line, notice_after=0.05) == "started"
    assert capsys.readouterr().err == line + "\n"
    assert await started_within(slow(0.0), 5.0, lambda: line, notice_after=0.5) == "started"
    assert capsys.readouterr().err == ""  # a quick start says nothing
    with pytest.raises(asyncio.TimeoutError):
        await started_within(slow(5.0), 0.2, lambda: line, notice_after=0.05)
