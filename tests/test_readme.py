"""The README as a newcomer follows it: every command and code block of its "Quick start" and
"Using it" sections runs as written, against servers on loopback ports, on the embedded model.

A line that starts `art-server` is a server: it runs in the background until the section's other
commands are done. The README's port 8000 becomes a free port; everything runs in a scratch
folder with the project's environment on PATH, as after `source .venv/bin/activate`. A Python
block names the file under examples/ it shows, and must be that file.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from conftest import ROOT, free_port

README = ROOT / "README.md"
WALKED = ("Quick start", "Using it")
FENCE = re.compile(r"```(\w+)\n(.*?)```", re.S)


def section(text: str, title: str) -> str:
    match = re.search(rf"^## {re.escape(title)}\b.*?$(.*?)(?=^## |\Z)", text, re.M | re.S)
    assert match, f"README has no '## {title}' section"
    return match.group(1)


def blocks(title: str) -> list[tuple[str, str]]:
    return FENCE.findall(section(README.read_text(), title))


def commands(block: str) -> list[str]:
    lines = [line.split("  #")[0].strip() for line in block.splitlines()]
    return [line for line in lines if line and not line.startswith("#")]


def walk_env(tmp: Path) -> dict[str, str]:
    env = {**os.environ, "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}", "PYTHONPATH": str(ROOT)}
    env.pop("ARTISAN_API_KEY", None)
    return env


def wait_healthy(url: str, proc: subprocess.Popen, log: Path, timeout: float = 180) -> None:
    deadline = time.time() + timeout
    while time.time() < deadline:
        assert proc.poll() is None, f"art-server exited {proc.returncode}:\n{log.read_text()[-2000:]}"
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise AssertionError(f"art-server did not answer within {timeout}s")


@pytest.mark.parametrize("title", WALKED)
def test_readme_section_runs_as_written(title, tmp_path):
    found = blocks(title)
    assert found, f"'## {title}' shows no command"
    port = str(free_port())
    env, servers = walk_env(tmp_path), []
    try:
        for lang, body in found:
            if lang == "python":
                shown = body.splitlines()[0].removeprefix("# ").split(":")[0]
                assert (ROOT / shown).read_text() == body, f"the README's block is not {shown} as it is"
                continue
            assert lang == "bash", f"unexpected block language {lang!r} in '## {title}'"
            for command in commands(body):
                command = command.replace("8000", port).removesuffix("&").strip()
                log = tmp_path / f"cmd-{len(servers)}-{abs(hash(command))}.log"
                if command.startswith("art-server"):
                    with open(log, "wb") as out:
                        proc = subprocess.Popen(shlex.split(command), cwd=tmp_path, env=env, stdout=out,
                                                stderr=subprocess.STDOUT)
                    servers.append(proc)
                    wait_healthy(f"http://127.0.0.1:{port}", proc, log)
                    continue
                done = subprocess.run(command, shell=True, cwd=tmp_path, env=env, capture_output=True, text=True,
                                      timeout=900, executable="/bin/bash")
                assert done.returncode == 0, f"`{command}` exited {done.returncode}:\n{(done.stdout + done.stderr)[-3000:]}"
                if "examples.quickstart" in command:
                    assert "trained True" in done.stdout, done.stdout
                if "-m client.train" in command:  # the first line the section shows is the one it prints
                    shown = re.search(r"^run \S+: created on .*$", section(README.read_text(), title), re.M)
                    assert shown and done.stdout.splitlines()[0] == shown.group(0), done.stdout[:500]
    finally:
        for proc in servers:
            proc.terminate()
            proc.wait(timeout=30)


@pytest.mark.unit
def test_readme_names_only_files_that_exist():
    text = README.read_text()
    for path in re.findall(r"(?<![\w/.-])((?:tests|examples|bench|server|client|docs)/[\w./-]+\.(?:py|jinja|png|md))", text):
        assert (ROOT / path).exists(), f"README names {path}, which does not exist"
