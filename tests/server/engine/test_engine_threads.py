"""The torch engine decodes a few rows on its own thread alone, and sets that for no other thread."""

from __future__ import annotations

import threading

import pytest
import torch

from server.engine.base import GenRequest
from server.engine.sampling import SamplingParams
from server.model.threads import own_threads
from server.engine.torch_engine import FEW_ROWS, TorchEngine
from server.model.host import ModelHost
from server.sampling.served_names import Policy
from server.settings import DEFAULT_MODEL_DIR

pytestmark = pytest.mark.unit


def test_own_threads_sets_the_calling_thread_s_count_and_no_other_s():
    default = torch.get_num_threads()
    seen: dict[str, int] = {}
    with own_threads(default + 1):
        seen["inside"] = torch.get_num_threads()
        # torch.set_num_threads would hand its count to every thread started from now on
        other = threading.Thread(target=lambda: seen.setdefault("other", torch.get_num_threads()))
        other.start()
        other.join()
    assert seen == {"inside": default + 1, "other": default}
    assert torch.get_num_threads() == default


def test_a_decode_step_of_few_rows_runs_on_one_thread_and_a_full_batch_on_the_engine_s_count(monkeypatch):
    host = ModelHost(DEFAULT_MODEL_DIR, device="cpu", dtype="float32")
    engine = TorchEngine(host, max_batch=2 * (FEW_ROWS + 4), max_waiting=64, prefix_cache_mb=0, kv_cache_mb=1024,
                         prefix_state_every=0)
    threads_by_rows: dict[int, set[int]] = {}
    decode_step = host.decode_step

    def counted(input_ids, *args):
        threads_by_rows.setdefault(input_ids.shape[0], set()).add(torch.get_num_threads())
        return decode_step(input_ids, *args)

    monkeypatch.setattr(host, "decode_step", counted)
    prompt = host.tokenizer("the price of the apple is seven dollars").input_ids
    with own_threads(2), torch.inference_mode():  # the engine thread's count, whatever OMP_NUM_THREADS says
        for n in (1, FEW_ROWS + 4):
            req = GenRequest(prompt_ids=prompt, params=SamplingParams(max_tokens=3, ignore_eos=True),
                             policy=Policy("base", None, None, 0), n=n)
            engine.submit(req)
            while engine._waiting or engine._rows:  # the engine's loop, in this thread
                engine._step(engine._admit())
            assert all(len(s.token_ids) == 3 for s in req.sequences)
        assert torch.get_num_threads() == 2
    assert threads_by_rows == {1: {1}, FEW_ROWS + 4: {2}}
