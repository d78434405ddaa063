"""The torch engine's prefill, in process on the embedded model and on SmolLM2's real weights: short
prompts of different lengths admitted together are one forward (left-padded, each distinct prompt
computed once however many rows sample from it), and every logprob is still the model's over
exactly prompt + completion (within float32 rounding where one row decodes through the weights' transposed copy)."""

from __future__ import annotations

import threading

import pytest
import torch

from server.engine.base import GenRequest
from server.engine.sampling import SamplingParams
from server.engine.prefix_cache import MIN_TOKENS as PREFIX_CACHE_MIN
from server.engine.torch_engine import TorchEngine
from server.model import decode_copy
from server.model.host import ModelHost
from server.sampling.served_names import Policy
from server.settings import DEFAULT_MODEL_DIR


@pytest.fixture(scope="module", params=["embedded", "smollm2", "smollm2-decode-copy"])
def host(request):
    if request.param == "embedded":
        return ModelHost(DEFAULT_MODEL_DIR, device="cpu", dtype="float32")
    from tests.real_models import converted, smollm2_gguf

    host = ModelHost(converted(smollm2_gguf()), device="cpu", dtype="float32")
    if request.param.endswith("decode-copy"):  # as art-server decodes on a CPU by default
        decode_copy.copy_for_decode(host.base_model)
    return host


def _reference(host: ModelHost, prompt: list[int], completion: list[int], temperature: float) -> torch.Tensor:
    with torch.no_grad():
        logits = host.base_model(torch.tensor([prompt + completion])).logits[0].float()
    lp = torch.log_softmax(logits[len(prompt) - 1:-1] / temperature, dim=-1)
    return lp.gather(-1, torch.tensor(completion)[:, None]).squeeze(-1)


def test_prompts_of_different_lengths_prefill_in_one_forward_with_each_row_s_exact_logprobs(host, monkeypatch):
    tokens = host.tokenizer("the price of the apple is seven dollars and the pear costs two more " * 4).input_ids
    prompts = [tokens[:5], tokens[:23], tokens[:41], tokens[:23], tokens[:12]]  # one prompt twice, by two requests
    forwards: list[tuple[int, int]] = []
    forward, decode_step = host.forward, host.decode_step

    def counted(input_ids, adapters, **kwargs):
        forwards.append(tuple(input_ids.shape))
        return forward(input_ids, adapters, **kwargs)

    def counted_step(input_ids, *args):  # a decode step, through the model's forward or the decode pass
        if host.exact_decode_pass:
            forwards.append(tuple(input_ids.shape))
        return decode_step(input_ids, *args)

    monkeypatch.setattr(host, "forward", counted)
    monkeypatch.setattr(host, "decode_step", counted_step)
    engine = TorchEngine(host, max_batch=32, max_waiting=64, prefix_cache_mb=0, kv_cache_mb=1024,
                         prefix_state_every=0)
    done = threading.Semaphore(0)
    requests = []
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=0.7 if i % 2 else 1.0, max_tokens=6, seed=i, ignore_eos=True)
        req = GenRequest(prompt_ids=prompt, params=params, policy=Policy("base", None, None, 0), n=2 if i == 2 else 1,
                         emit=lambda kind, _: done.release() if kind in ("finished", "error") else None)
        requests.append(req)
        engine.submit(req)  # all waiting before the loop starts: admitted together
    engine.start()
    try:
        for _ in range(sum(r.n for r in requests)):
            assert done.acquire(timeout=120)
    finally:
        engine.stop()

    assert forwards[0] == (4, 41)  # the first forward: the 4 distinct prompts, padded to the longest
    assert len(forwards) > 1 and all(shape[1] == 1 for shape in forwards[1:])  # then only decode steps
    for req in requests:
        for seq in req.sequences:
            assert seq.finish_reason == "length" and len(seq.token_ids) == 6
            want = _reference(host, req.prompt_ids, seq.token_ids, req.params.temperature)
            assert (torch.tensor(seq.logprobs) - want).abs().max().item() <= 1e-4


@pytest.mark.unit
def test_a_left_padded_prefill_s_padding_is_zeroed_and_its_rows_are_kept():
    from server.engine.kv_cache import BatchKV

    kv = BatchKV.empty(n_layers=2, rows=3, heads=1, head_dim=2, capacity=8, dtype=torch.float32, device="cpu")
    for buf in (*kv.kbufs, *kv.vbufs):
        buf[:, :, :5] = float("nan")  # what a forward may leave where only padding was
        buf[:, :, 5 - 2:5] = 1.0
        buf[0, :, :5] = 1.0  # row 0 is 5 long: no padding
    kv.fill(5, [5, 2, 2])
    assert kv.width == 5 and kv.lengths == [5, 2, 2]
    for buf in (*kv.kbufs, *kv.vbufs):
        assert (buf[1:, :, :3] == 0).all() and (buf[:, :, 3:5] == 1).all() and (buf[0, :, :5] == 1).all()
    assert kv.attention_mask().tolist() == [[1] * 5, [0, 0, 0, 1, 1], [0, 0, 0, 1, 1]]


def _sample(engine: TorchEngine, prompt: list[int], seed: int, n: int = 1) -> GenRequest:
    done = threading.Semaphore(0)
    req = GenRequest(prompt_ids=prompt, params=SamplingParams(temperature=1.0, max_tokens=6, seed=seed, ignore_eos=True),
                     policy=Policy("base", None, None, 0), n=n,
                     emit=lambda kind, _: done.release() if kind in ("finished", "error") else None)
    engine.submit(req)
    for _ in range(n):
        assert done.acquire(timeout=120)
    return req


def test_a_finished_turn_s_kv_serves_the_next_turn_which_prefills_only_its_new_tokens(host):
    tokens = host.tokenizer("the price of the apple is seven dollars and the pear costs two more " * 40).input_ids
    prompt = tokens[:PREFIX_CACHE_MIN + 4]
    engine = TorchEngine(host, max_batch=8, max_waiting=16, prefix_cache_mb=256, kv_cache_mb=1024,
                         prefix_state_every=0)
    engine.start()
    try:
        first = _sample(engine, prompt, seed=1, n=2)  # two replies: each its own entry
        reused = engine.prefix.tokens_reused
        for i, seq in enumerate(first.sequences):
            # the next turn: this turn with its reply spliced in as the same ids, then a tool result
            history = prompt + seq.token_ids + tokens[400 + 10 * i:410 + 10 * i]
            nxt = _sample(engine, history, seed=2 + i)
            # all but the reply's last token (never forwarded) came from the cache
            assert engine.prefix.tokens_reused - reused == len(prompt) + len(seq.token_ids) - 1
            reused = engine.prefix.tokens_reused
            (reply,) = nxt.sequences
            want = _reference(host, history, reply.token_ids, 1.0)
            assert (torch.tensor(reply.logprobs) - want).abs().max().item() <= 1e-4
    finally:
        engine.stop()


def _submit(engine: TorchEngine, prompt: list[int], max_tokens: int, seed: int | None = None) -> GenRequest:
    """One request of exactly `max_tokens` at temperature 1 (seeded by its length unless `seed`)."""
    params = SamplingParams(temperature=1.0, max_tokens=max_tokens, seed=len(prompt) if seed is None else seed,
                            ignore_eos=True)
    req = GenRequest(prompt_ids=prompt, params=params, policy=Policy("base", None, None, 0), n=1, emit=lambda *a: None)
    engine.submit(req)
    return req


def _assert_exact(host: ModelHost, requests: list[GenRequest]) -> None:
    """Each request sampled all its tokens, each logprob the model's over exactly prompt + completion."""
    for req in requests:
        seq = req.sequences[0]
        assert seq.finish_reason == "length" and len(seq.token_ids) == req.params.max_tokens
        want = _reference(host, req.prompt_ids, seq.token_ids, 1.0)
        assert (torch.tensor(seq.logprobs) - want).abs().max().item() <= 1e-4


def _step(engine: TorchEngine) -> None:
    """One iteration of the engine's loop, in this thread."""
    with torch.inference_mode():
        engine._step(engine._admit())


def test_rows_leave_and_join_through_free_slots_without_copying_the_batch(host, monkeypatch):
    from server.engine.kv_cache import BatchKV

    copies = []
    for name in ("keep", "extend"):
        original = getattr(BatchKV, name)
        monkeypatch.setattr(BatchKV, name, lambda self, *a, _f=original, _n=name: (copies.append(_n), _f(self, *a))[1])
    tokens = host.tokenizer("the price of the apple is seven dollars and the pear costs two more " * 4).input_ids
    engine = TorchEngine(host, max_batch=8, max_waiting=16, prefix_cache_mb=0, kv_cache_mb=1024,
                         prefix_state_every=0)

    long_a, short_b, long_c = (_submit(engine, tokens[:30], 14, 1), _submit(engine, tokens[:20], 3, 2),
                               _submit(engine, tokens[:25], 12, 3))
    _step(engine)
    slot = next(i for i, s in enumerate(engine._rows) if s is short_b.sequences[0])
    for _ in range(2):  # b finishes after its third token: its slot is free, nothing copied
        _step(engine)
    assert short_b.sequences[0].finish_reason == "length" and engine._rows[slot] is None and copies == []
    joined = _submit(engine, tokens[:12], 5, 4)  # shorter than the batch's width: it takes b's slot
    _step(engine)
    assert engine._rows[slot] is joined.sequences[0] and copies == []
    while engine._rows:
        _step(engine)
    assert copies == ["keep"]  # one compaction, when more slots were free than in use
    _assert_exact(host, [long_a, short_b, long_c, joined])


def test_rows_join_only_while_the_batch_s_kv_fits_its_budget_and_keep_their_order(host):
    tokens = host.tokenizer("the price of the apple is seven dollars and the pear costs two more " * 8).input_ids
    engine = TorchEngine(host, max_batch=8, max_waiting=16, prefix_cache_mb=0, kv_cache_mb=1024,
                         prefix_state_every=0)
    engine.kv_budget = engine.kv_bytes(2, 40)  # two rows of a 40-token prompt, not three

    first, second = _submit(engine, tokens[:40], 3), _submit(engine, tokens[1:41], 8)
    # wide waits; short, though it would fit, waits behind it
    wide, short = _submit(engine, tokens[:60], 4), _submit(engine, tokens[2:22], 4)
    _step(engine)
    assert engine._live() == [*first.sequences, *second.sequences] and len(engine._waiting) == 2
    while first.sequences[0].finish_reason is None:
        _step(engine)
    _step(engine)  # first's slot is free, but second and wide at 60 columns do not fit
    assert engine._live() == second.sequences and list(engine._waiting) == [*wide.sequences, *short.sequences]
    while second.sequences[0].finish_reason is None:
        _step(engine)
    _step(engine)  # an empty batch takes the head of the queue whatever its size; short comes after it
    assert engine._live()[0] is wide.sequences[0]
    while engine._rows or engine._waiting:
        assert len(engine._live()) <= 2
        _step(engine)
    _assert_exact(host, [first, second, wide, short])


def test_a_retired_row_s_slot_counts_against_the_budget_until_the_batch_is_compacted(host):
    tokens = host.tokenizer("the price of the apple is seven dollars and the pear costs two more " * 8).input_ids
    engine = TorchEngine(host, max_batch=8, max_waiting=16, prefix_cache_mb=0, kv_cache_mb=1024,
                         prefix_state_every=0)
    engine.kv_budget = engine.kv_bytes(4, 40)

    short = [_submit(engine, tokens[i:i + 40], 2) for i in range(2)]
    long = [_submit(engine, tokens[i:i + 40], 12) for i in range(2, 4)]
    _step(engine)
    while any(r.sequences[0].finish_reason is None for r in short):
        _step(engine)
    assert len(engine._rows) == 4 and len(engine._live()) == 2  # two free slots, not yet compacted
    wider = _submit(engine, tokens[:50], 2)  # three live rows would fit at 50 columns; four slots do not
    _step(engine)
    assert wider.sequences[0] not in engine._live() and list(engine._waiting) == wider.sequences
    while engine._rows or engine._waiting:
        _step(engine)
    assert all(r.sequences[0].finish_reason == "length" for r in (*short, *long, wider))


def test_the_kv_budget_is_the_setting_or_an_eighth_of_the_memory_available_at_the_start_with_a_floor(host, monkeypatch):
    from server.engine import torch_engine
    from server.settings import Settings

    engine = TorchEngine.from_settings(host, Settings(kv_cache_mb=3))
    assert engine.kv_budget == 3 * 2**20 and engine.load["kv_cache"] == {"budget_mb": 3, "held_mb": 0}  # /health's
    monkeypatch.setattr(torch_engine, "available_memory", lambda device: 32 * 2**30)
    assert TorchEngine.from_settings(host, Settings()).kv_budget == 4 * 2**30
    monkeypatch.setattr(torch_engine, "available_memory", lambda device: 2**30)  # a busy machine: the floor
    assert TorchEngine.from_settings(host, Settings()).kv_budget == 2 * 2**30


@pytest.mark.unit
def test_a_placed_row_is_right_aligned_and_a_former_row_s_columns_are_zeroed():
    from server.engine.kv_cache import BatchKV

    kv = BatchKV.empty(n_layers=1, rows=2, heads=1, head_dim=1, capacity=8, dtype=torch.float32, device="cpu")
    kv.kbufs[0][:, :, :6] = float("nan")  # a former row that failed on non-finite values
    kv.width, kv.lengths = 6, [6, 4]
    kv.free([1])
    assert kv.attention_mask(extra=1)[1].tolist() == [0] * 6 + [1]  # a free slot attends to nothing before
    new = BatchKV.empty(n_layers=1, rows=1, heads=1, head_dim=1, capacity=4, dtype=torch.float32, device="cpu")
    new.kbufs[0][0, 0, :3, 0] = torch.tensor([1.0, 2.0, 3.0])
    new.width, new.lengths = 3, [3]
    kv.place([1], new)
    assert kv.kbufs[0][1, 0, :6, 0].tolist() == [0, 0, 0, 1, 2, 3] and kv.lengths == [6, 3]
    assert torch.isnan(kv.kbufs[0][0, 0, :6]).all()  # the other row untouched


def _batch_with_states(values: list[float]):
    """A batch of one state layer (before one attention layer) whose rows' states hold `values`."""
    from server.engine.kv_cache import BatchKV

    kv = BatchKV.empty(n_layers=1, rows=len(values), heads=1, head_dim=1, capacity=8, dtype=torch.float32,
                       device="cpu", kinds=("state", "kv"))
    [layer] = kv.states
    rows = torch.tensor(values).view(-1, 1, 1)
    layer.update_conv_state(rows.expand(-1, 1, 2).contiguous())  # a window of two columns
    layer.update_recurrent_state(rows[..., None].clone())
    kv.width, kv.lengths = 1, [1] * len(values)
    return kv


@pytest.mark.unit
def test_a_rows_state_follows_it_through_joins_and_compaction():
    """Qwen3.5's and LFM2's layers keep a state per row: it moves with its row when rows are appended,
    placed in free slots and compacted, and the model sees the layers in its own order."""
    from transformers.cache_utils import LinearAttentionLayer

    from server.engine.kv_cache import SlabLayer

    kv = _batch_with_states([1.0, 2.0])
    kv.extend(_batch_with_states([3.0]))
    kv.keep([2, 0])
    kv.free([1])
    kv.place([1], _batch_with_states([7.0]))
    [layer] = kv.states
    assert layer.conv_states[0][:, 0, 0].tolist() == [3.0, 7.0] and layer.conv_states[0].shape == (2, 1, 2)
    assert layer.recurrent_states[0].flatten().tolist() == [3.0, 7.0]
    cache = kv.cache()
    assert [type(lay) for lay in cache.layers] == [LinearAttentionLayer, SlabLayer]
    assert cache.get_recurrent_state(0) is layer.recurrent_states[0]
    assert kv.nbytes == sum(b.nelement() * 4 for b in (*kv.kbufs, *kv.vbufs)) + (2 * 2 + 2) * 4  # and the states
    with pytest.raises(ValueError):
        kv.write_prefix([torch.zeros(1, 1, 1)], [torch.zeros(1, 1, 1)], 1)  # a state cannot start from keys
