"""The replicas' router (server/engine/router.py): a conversation stays where its prefix is, the
rest go to the least loaded replica. And a request on a replica that died is never waited on forever."""

from __future__ import annotations

import asyncio
import threading

import pytest

from server.engine.base import GenRequest, ReplicaLost
from server.engine.replicas import Replica, ReplicatedEngine
from server.engine.router import Candidate, PrefixMemory, common_prefix, route
from server.engine.sampling import SamplingParams
from server.sampling.served_names import Policy

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


class _Stream:
    """A replica's stream that never yields: Ray's stream of an actor that died without saying so."""

    def __anext__(self):
        return asyncio.get_running_loop().create_future()


class _Method:
    def __init__(self, result=None):
        self.result = result

    def remote(self, *args):
        return self.result


class _Handle:
    generate = _Method(_Stream())
    cancel = _Method()


def _on_a_replica_that_goes_quiet(lost_after: float | None) -> list[tuple[str, object]]:
    """What one request on a silent replica emitted within 1.5 s; the replica is restarted (a new
    incarnation, as the monitor records it) after `lost_after` seconds, or never."""
    engine = ReplicatedEngine.__new__(ReplicatedEngine)
    engine._lock = threading.Lock()
    replica = Replica(0, "replica-0", _Handle(), state="up", incarnation="first", in_flight=1)
    emitted = []
    req = GenRequest([1, 2, 3], SamplingParams(max_tokens=4), Policy("base", None, None, 0),
                     emit=lambda kind, x: emitted.append((kind, x)))

    async def scenario():
        task = asyncio.create_task(engine._request(replica, req))
        if lost_after is not None:
            await asyncio.sleep(lost_after)
            replica.incarnation = "second"
        await asyncio.wait({task}, timeout=1.5)
        task.cancel()

    asyncio.run(scenario())
    return emitted


def test_a_request_on_a_replica_the_monitor_saw_restart_fails_as_lost_even_if_its_stream_never_ends():
    emitted = _on_a_replica_that_goes_quiet(lost_after=0.1)
    assert [(kind, type(x)) for kind, x in emitted] == [("error", ReplicaLost)]
    assert "retry the request" in str(emitted[0][1])
    assert _on_a_replica_that_goes_quiet(lost_after=None) == []  # a slow replica that lives is waited for
