"""The replicas' router (server/engine/router.py): a conversation stays where its prefix is, the
rest go to the least loaded replica."""

from __future__ import annotations

import pytest

from server.engine.router import Candidate, PrefixMemory, common_prefix, route

pytestmark = pytest.mark.unit


def test_a_long_enough_prefix_wins_over_a_lighter_replica():
    assert route(10, [Candidate(load=0, match=0), Candidate(load=3, match=8)]) == 1


def test_a_short_prefix_goes_to_the_least_loaded():
    assert route(10, [Candidate(load=0, match=0), Candidate(load=3, match=4)]) == 0


def test_an_overloaded_prefix_holder_gives_way_to_the_least_loaded():
    assert route(10, [Candidate(load=0, match=0), Candidate(load=5, match=10)], max_imbalance=4) == 0
    assert route(10, [Candidate(load=1, match=0), Candidate(load=5, match=10)], max_imbalance=4) == 1


def test_without_any_prefix_the_least_loaded_wins_and_ties_go_to_the_first():
    assert route(10, [Candidate(2, 0), Candidate(1, 0), Candidate(1, 0)]) == 1
    assert route(10, [Candidate(0, 0), Candidate(0, 0)]) == 0


def test_of_two_prefix_holders_the_longer_match_wins():
    assert route(10, [Candidate(0, 6), Candidate(1, 9)]) == 1


def test_a_conversation_s_next_turn_matches_its_replica_s_memory():
    memory, other = PrefixMemory(), PrefixMemory()
    turn1 = [1, 5, 9, 2]  # prompt then answer, as the replica served it
    memory.add(turn1 + [40, 41, 42])
    other.add([1, 5, 7, 7, 7])
    turn2 = turn1 + [40, 41, 42, 3, 8, 8]
    assert (memory.match(turn2), other.match(turn2)) == (7, 2)
    assert route(len(turn2), [Candidate(2, other.match(turn2)), Candidate(3, memory.match(turn2))]) == 1


def test_memory_is_bounded_and_clears():
    memory = PrefixMemory(size=2)
    for seq in ([1, 2, 3], [4, 5], [6]):
        memory.add(seq)
    assert memory.match([1, 2, 3]) == 0  # the oldest went first
    assert memory.match([4, 5, 9]) == 2
    memory.clear()
    assert memory.match([4, 5]) == 0
    assert common_prefix([1, 2], [1, 2, 3]) == 2
