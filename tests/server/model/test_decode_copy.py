"""The engine's one-row decode through a transposed copy of the weights (server/model/decode_copy.py):
the same product as F.linear within float32 rounding while one row decodes, and exactly F.linear's
in every other pass (more rows, training, the reference model, scoring); a weight written in place
is never multiplied stale; an adapter wrapped around a copied layer still adds its part."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from server.model.decode_copy import DecodeCopyLinear, copy_for_decode, decoding

pytestmark = pytest.mark.unit


def layers() -> torch.nn.Sequential:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(64, 96, bias=False), torch.nn.Linear(96, 32, bias=True))


def test_one_row_decodes_as_f_linear_within_rounding_and_every_other_pass_exactly(monkeypatch):
    model = layers()
    plain = [(m.weight.clone(), None if m.bias is None else m.bias.clone()) for m in model]
    assert copy_for_decode(model) == (64 * 96 + 96 * 32) * 4
    assert all(type(m) is DecodeCopyLinear for m in model)
    row, rows = torch.randn(1, 1, 64), torch.randn(3, 5, 64)

    def reference(x):
        for w, b in plain:
            x = F.linear(x, w, b)
        return x

    linear, calls = F.linear, []
    monkeypatch.setattr(F, "linear", lambda *a: calls.append(1) or linear(*a))
    with torch.inference_mode():
        assert torch.equal(model(row), reference(row)) and len(calls) == 4  # not decoding: F.linear itself
        calls.clear()
        with decoding():
            got = model(row)
            assert not calls, "one row went through F.linear, not the copy"
            torch.testing.assert_close(got, reference(row), rtol=1e-5, atol=1e-5)
            calls.clear()
            assert torch.equal(model(rows), reference(rows)) and len(calls) == 4  # more rows: F.linear's
    with decoding():  # a pass with gradients (training) is F.linear's, whatever the thread says
        out = model(row.clone().requires_grad_(True))
        assert torch.equal(out.detach(), reference(row)) and out.requires_grad


def test_a_weight_written_in_place_is_copied_again_before_it_multiplies():
    model = layers()
    copy_for_decode(model)
    x = torch.randn(1, 64)
    with torch.no_grad():
        model[0].weight.mul_(2.0)
        want = F.linear(F.linear(x, model[0].weight), model[1].weight, model[1].bias)
        with decoding():
            torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-5)


def test_an_adapter_wrapped_around_a_copied_layer_still_adds_its_part():
    from peft import LoraConfig, get_peft_model

    class Tiny(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.proj = torch.nn.Linear(64, 64, bias=False)

        def forward(self, x):
            return self.proj(x)

    torch.manual_seed(0)
    base = Tiny()
    copy_for_decode(base)
    model = get_peft_model(base, LoraConfig(r=4, target_modules=["proj"], init_lora_weights=False))
    x = torch.randn(1, 64)
    with torch.inference_mode():
        want = model(x)
        with model.disable_adapter():
            assert not torch.allclose(model(x), want)  # the adapter's part is not nothing
        with decoding():
            torch.testing.assert_close(model(x), want, rtol=1e-5, atol=1e-5)


def test_a_copy_as_large_as_a_vocabulary_projection_multiplies_on_the_process_s_threads_with_the_same_bits(
        monkeypatch):
    from server.model import decode_copy

    torch.manual_seed(0)
    head, layer = torch.nn.Linear(576, 49152, bias=False), torch.nn.Linear(576, 1536, bias=False)  # SmolLM2's
    copy_for_decode(torch.nn.Sequential(head, layer))
    assert (head.threads, layer.threads) == (decode_copy.PROCESS_THREADS, None)
    asked, own = [], decode_copy.own_threads
    monkeypatch.setattr(decode_copy, "own_threads", lambda n: asked.append(n) or own(n))
    head.threads = 2  # whatever OMP_NUM_THREADS says
    row = torch.randn(1, 1, 576)
    with torch.inference_mode(), decoding():
        with own(1):  # as the engine decodes a few rows
            shared = head(row)
            layer(row)
            head.threads = None
            alone = head(row)
    assert asked == [2, None, None]
    assert torch.equal(shared, alone)
