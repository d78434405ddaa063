"""The torch engine's prefix cache as a data structure: which entry a prompt reuses, and when
entries go. That a reused prefix samples what a full prefill would is shown on real weights in
test_real_models
(test_a_turn_after_a_long_prompt_reuses_its_prefix_and_samples_as_a_full_prefill_would)."""

from __future__ import annotations

import pytest
import torch

from server.engine.prefix_cache import PrefixCache

pytestmark = pytest.mark.unit

LAYERS, HEADS, DIM = 2, 1, 4
TOKEN_BYTES = LAYERS * 2 * HEADS * DIM * 4  # float32 keys and values


def kv(n: int, fill: float = 1.0) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    return ([torch.full((HEADS, n, DIM), fill) for _ in range(LAYERS)],
            [torch.full((HEADS, n, DIM), -fill) for _ in range(LAYERS)])


def test_the_longest_shared_prefix_of_the_same_adapter_is_reused_and_the_last_token_computed():
    cache = PrefixCache(max_bytes=10**6, min_tokens=4)
    a, b = list(range(10)), list(range(6)) + [99, 98, 97, 96]
    cache.add("run@1", a, *kv(10, 1.0))
    cache.add("run@1", b, *kv(10, 2.0))
    hit = cache.find("run@1", a + [50, 51])
    assert hit.length == 10 and hit.entry.keys[0][0, 0, 0] == 1.0
    assert cache.find("run@1", b[:8] + [0]).length == 8
    assert cache.find("run@1", a).length == 9  # the whole prompt is cached; its last token's logits are needed
    assert cache.find("run@2", a + [50]) is None and cache.find(None, a + [50]) is None
    assert cache.find("run@1", [7] * 12) is None
    assert cache.find("run@1", list(range(3)) + [55] * 8) is None  # 3 shared tokens: fewer than min_tokens
    assert cache.figures["hits"] == 3 and cache.figures["tokens_reused"] == 27


def test_short_prompts_never_enter_and_a_longer_prompt_replaces_its_own_prefix():
    cache = PrefixCache(max_bytes=10**6, min_tokens=4)
    cache.add("a", [1, 2, 3], *kv(3))
    assert len(cache) == 0 and cache.find("a", [1, 2, 3, 4, 5]) is None
    cache.add("a", [1, 2, 3, 4], *kv(4))
    cache.add("a", [1, 2, 3, 4, 5, 6], *kv(6))
    assert len(cache) == 1 and cache.nbytes == 6 * TOKEN_BYTES
    cache.add("a", [1, 2, 3, 4, 5], *kv(5))  # already covered
    assert len(cache) == 1 and cache.nbytes == 6 * TOKEN_BYTES


def test_entries_go_least_recently_used_first_within_the_budget_and_with_their_adapter():
    cache = PrefixCache(max_bytes=20 * TOKEN_BYTES, min_tokens=4)
    first, second, third = [1] * 8, [2] * 8, [3] * 8
    cache.add("a", first, *kv(8))
    cache.add("b", second, *kv(8))
    assert cache.find("a", first + [0]) is not None  # `first` is now the most recently used
    cache.add("a", third, *kv(8))
    assert cache.find("b", second + [0]) is None
    assert cache.find("a", first + [0]) is not None and cache.find("a", third + [0]) is not None
    assert cache.nbytes == 16 * TOKEN_BYTES
    cache.add("a", [4] * 30, *kv(30))  # larger than the whole budget: not kept, nothing evicted for it
    assert len(cache) == 2
    cache.drop("a")
    assert len(cache) == 0 and cache.nbytes == 0
    off = PrefixCache(max_bytes=0, min_tokens=4)
    off.add("a", first, *kv(8))
    assert not off.wants(first) and len(off) == 0


def test_an_entry_with_states_is_reused_only_where_it_holds_them():
    """A linear attention's state holds its whole prefix and cannot be cut back: a prompt that
    shares only part of an entry without states there prefills from scratch, one that extends all of
    it reuses it."""
    cache = PrefixCache(max_bytes=10**6, min_tokens=4, stateful=True)
    state = [({0: torch.ones(3, 2)}, {0: torch.ones(2, 2, 2)})]
    cache.add("run@1", list(range(10)), *kv(10), states=state)
    assert cache.find("run@1", list(range(8)) + [50, 51, 52]) is None  # 8 shared of 10
    assert cache.find("run@1", list(range(10))) is None  # its last token must be computed: 9 of 10
    hit = cache.find("run@1", list(range(10)) + [50, 51])
    assert hit.length == 10 and hit.states is state
    assert cache.nbytes == 10 * TOKEN_BYTES + (6 + 8) * 4  # the states count against the budget


def _states(fill: float) -> list:
    return [({0: torch.full((3, 2), fill)}, {0: torch.full((2, 2, 2), fill)})]


def test_a_prompt_sharing_part_of_an_entry_resumes_from_the_furthest_states_it_kept():
    """A prefill keeps the states every `checkpoint_every` tokens: the tasks of one tau2 domain share a
    long system prompt, then differ, and each resumes after the shared part but for fewer than that."""
    cache = PrefixCache(max_bytes=10**6, min_tokens=4, stateful=True, checkpoint_every=4)
    assert cache.checkpoints(0, 12) == [4, 8] and cache.checkpoints(5, 9) == [8] and cache.checkpoints(8, 9) == []
    assert PrefixCache(max_bytes=10**6, checkpoint_every=4).checkpoints(0, 12) == []  # no states to keep
    first = list(range(12))
    cache.add("run@1", first, *kv(12), states=_states(12.0), checkpoints={4: _states(4.0), 8: _states(8.0)})
    assert cache.nbytes == 12 * TOKEN_BYTES + 3 * (6 + 8) * 4
    hit = cache.find("run@1", first[:10] + [50, 51])  # 10 shared: the states after 8 of them
    assert hit.length == 8 and hit.states[0][1][0][0, 0, 0] == 8.0
    assert cache.find("run@1", first[:6] + [50, 51]).length == 4
    assert cache.find("run@1", first[:3] + [50, 51, 52, 53]) is None
    # The next turn, extending the whole entry, replaces it and keeps what it held as its own.
    cache.add("run@1", first + [60, 61, 62], *kv(15), states=_states(15.0))
    (entry,) = cache._entries.values()
    assert sorted(entry.checkpoints) == [4, 8, 12] and entry.checkpoints[12][0][1][0][0, 0, 0] == 12.0
    assert cache.find("run@1", first + [60, 70, 71]).length == 12
