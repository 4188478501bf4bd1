"""The swarm's small rules: which hash is the majority, how faults are counted and logged,
how a config difference is named, how faults are armed.

    pytest tests/unit/test_swarm_rules.py -q
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import socket
import time

import pytest

from dilocox_p2p import injection
from dilocox_p2p.compression.codec import NOT_RECEIVED
from dilocox_p2p.swarm import dial
from dilocox_p2p.swarm.agreement import held_by_most, majority_hash, split_evenly, tied_with
from dilocox_p2p.swarm.dht import HEARTBEAT_S, MEMBER_TTL_S, Member
from dilocox_p2p.swarm.exchange import gather_suspects, mending_order, suspects_after
from dilocox_p2p.swarm.faults import FAULTS, FaultCounter
from dilocox_p2p.swarm.group_round import RoundResult
from dilocox_p2p.swarm.held import AverageService, Collected
from dilocox_p2p.swarm.membership import Suspicion, config_diff, suspected
from dilocox_p2p.wire import swarm_pb2

pytestmark = pytest.mark.unit


def test_the_majority_is_the_most_held_hash_and_a_tie_goes_to_the_smallest_peer_ids_hash():
    assert majority_hash({"a": "h2", "b": "h1", "c": "h2"}) == "h2"
    assert majority_hash({"a": "h2", "b": "h1"}) == "h2"  # a tie goes to the smallest peer id's hash
    assert majority_hash({"a": "h9", "b": "h1"}) == "h9"  # whatever the hashes: one worker wins every tie
    assert majority_hash({"z": "h1", "a": "h2", "b": "h2", "c": "h1"}) == "h2"
    assert majority_hash({"a": "", "b": "h3"}) == "h3"  # an empty hash (not known yet) does not vote
    assert majority_hash({}) is None and majority_hash({"a": ""}) is None


def test_a_tie_at_the_top_is_split_evenly_and_a_hash_held_by_more_than_any_other_is_not():
    # a member never gives up its copy or state for a tie (vote.py, agreement.py): a tie is kept
    assert split_evenly({"a": "h1", "b": "h2"}) and split_evenly({"a": "h1", "b": "h2", "c": "h3"})
    assert split_evenly({"z": "h1", "a": "h2", "b": "h2", "c": "h1"})
    assert not split_evenly({"a": "h1", "b": "h1", "c": "h2"}) and not split_evenly({"a": "h1", "b": "h1"})
    assert not split_evenly({"a": "h1", "b": ""}) and not split_evenly({})  # an empty hash does not vote


def test_a_peers_requests_are_taken_up_to_a_burst_then_at_its_rate_and_each_peer_has_its_own_bucket():
    from dilocox_p2p.swarm.request_limits import RequestRate

    rate, started = RequestRate(per_s=20.0, burst=5), time.monotonic()
    taken = sum(rate.take("a") for _ in range(50))
    assert 5 <= taken <= 5 + 20.0 * (time.monotonic() - started) + 1
    assert rate.take("b"), "another peer's bucket is its own"
    time.sleep(0.2)  # 4 tokens back
    taken_after = sum(rate.take("a") for _ in range(50))
    assert 3 <= taken_after <= 5


def test_each_family_of_requests_has_its_own_bucket_and_its_own_count_of_held_requests():
    from dilocox_p2p.swarm.request_limits import PeerLimits

    limits = PeerLimits(per_s=1.0, burst=2, max_held=1)
    assert limits.refusal("pushes", "a") == "" and limits.refusal("pushes", "a") == ""
    assert "too many requests" in limits.refusal("pushes", "a")
    assert limits.refusal("matchmaking", "a") == "", "a flood of pushes does not refuse a join request"
    with limits.held("matchmaking", "a"):
        assert "busy" in limits.refusal("matchmaking", "a")
        assert limits.refusal("matchmaking", "b") == "", "another peer's held requests are its own"
        assert limits.refusal("parts", "a") == "", "nor another family's"
    time.sleep(1.05)  # a token back, and nothing held any more
    assert limits.refusal("matchmaking", "a") == ""


def test_a_suspected_member_counts_again_once_it_heartbeats_after_its_failure_begins_a_later_round_or_restarts():
    failed_at, life = 1000.0, 900.0

    def member(published_at: float, joined_at: float) -> Member:
        return Member("b", swarm_pb2.MemberRecord(joined_at=joined_at), expiration=published_at + MEMBER_TTL_S)

    suspicion = Suspicion(failed_at, joined_at=life)
    assert not suspected(member(failed_at, life), None)
    assert suspected(member(failed_at + 1, life), suspicion)  # a heartbeat that may have left before the failure
    assert not suspected(member(failed_at + HEARTBEAT_S, life), suspicion)  # a heartbeat after it
    # restarted at once with the same key (--resume): its new life counts from its first record
    assert not suspected(member(failed_at + 1, failed_at + 0.5), suspicion)
    # the life of the failure unknown (no record of it seen yet): only a later heartbeat counts
    assert suspected(member(failed_at + 1, failed_at + 0.5), Suspicion(failed_at, joined_at=None))
    # failed in round 6's all-reduce: a record that began round 7's came after it (a member that lost one group to
    # the network, not one that is gone); one still at round 6 says nothing new
    in_round = Suspicion(failed_at, joined_at=life, round=6)
    started = swarm_pb2.MemberRecord(joined_at=life, averaging_round=7)
    assert not suspected(Member("b", started, expiration=failed_at + 1 + MEMBER_TTL_S), in_round)
    started.averaging_round = 6
    assert suspected(Member("b", started, expiration=failed_at + 1 + MEMBER_TTL_S), in_round)


def test_a_member_mends_from_the_others_whose_reducers_delivered_first_and_never_asks_one_outside_the_group():
    result = RoundResult(round=7, group=["a", "b", "c", "d", "e"], group_id=b"g", missing=((0, 4),),
                         failed_reducers=["b", "e"], banned_senders=["e"], outsiders=["e"])  # fmt: skip
    assert mending_order(result, "c") == ["a", "d", "b"]  # e never learnt of the group: it holds no copy


def test_a_member_mends_from_client_members_last_and_the_others_reduce_the_whole_vector():
    # a client member answers only where it opened a connection to the asker (swarm/client_member.py)
    result = RoundResult(round=7, group=["a", "b", "c", "d"], group_id=b"g", missing=((0, 4),),
                         failed_reducers=["b"], clients=["a", "d"])  # fmt: skip
    assert mending_order(result, "c") == ["b", "a", "d"]
    assert result.reducers == ["b", "c"]


def test_a_failed_reducer_is_suspected_unless_it_answered_or_was_in_no_such_group():
    result = RoundResult(round=3, group=["a", "b", "c", "d"], group_id=b"g", missing=((0, 4),),
                         failed_reducers=["b", "c", "d"], outsiders=["d"])  # fmt: skip
    # d answered that it is in no such group: alive, and expected in the next round like any member
    assert suspects_after(result, answered=["c"], mended=False) == ["b"]
    assert suspects_after(result, answered=[], mended=True) == []  # mended: every reducer delivered to someone
    banned = RoundResult(round=3, group=["a", "b"], group_id=b"g", missing=(), banned_senders=["b"])
    assert suspects_after(banned, answered=[], mended=True) == ["b"]


def test_a_member_that_answers_a_request_for_the_average_without_a_copy_is_alive_and_not_suspected():
    out = Collected(average=None)
    # b still waits for its own average, c failed too, d cannot be dialed, e closed its connection
    for peer, reason in [("b", "STATE_NOT_READY"), ("c", "STATE_LACKING"), ("d", "TimeoutError()"),
                         ("e", "ConnectionResetError()")]:  # fmt: skip
        assert not AverageService._noted(out, peer, None, reason, 0)
    assert out.replied == ["b", "c"] and out.lacking == ["c"] and len(out.failures) == 4
    result = RoundResult(round=2, group=["a", "b", "c", "d", "e"], group_id=b"g", missing=((0, 4),),
                         failed_reducers=["b", "c", "d", "e"])  # fmt: skip
    assert suspects_after(result, answered=out.alive, mended=False) == ["d", "e"]


def test_a_compressed_rounds_member_whose_message_never_came_is_suspected_unless_it_was_in_no_such_group():
    group = ["a", "b", "c", "d"]
    # b's message never came; d's never existed (it answered it is in no such group); a is this worker
    never = {0: NOT_RECEIVED, 1: NOT_RECEIVED, 3: NOT_RECEIVED}
    assert gather_suspects(group, never, ["d"], me="a") == ["b"]
    assert gather_suspects(group, {}, [], me="a") == []
    # c's message came and was refused: a strike for its author (exchange.py), who is alive and expected next round
    assert gather_suspects(group, {1: NOT_RECEIVED, 2: "it holds NaN or Inf"}, [], me="a") == ["b"]


def test_a_member_whose_every_other_member_was_in_no_such_group_holds_no_average_of_a_group():
    pair = RoundResult(round=2, group=["a", "b"], group_id=b"g", missing=((0, 4),), outsiders=["b"])
    trio = RoundResult(round=2, group=["a", "b", "c"], group_id=b"g", missing=((0, 4),), outsiders=["b"])
    assert pair.alone_with_outsiders("a")  # b averaged in another group of the round: a borrows from it
    assert not trio.alone_with_outsiders("a")  # a and c averaged together without b
    assert not RoundResult(round=2, group=["a", "b"], group_id=b"g", missing=()).alone_with_outsiders("a")
    # b was a failed reducer, and asked for its span it answered with another group's average of the round
    failed = RoundResult(round=2, group=["a", "b", "c"], group_id=b"g", missing=((0, 4),), failed_reducers=["b"])
    assert dataclasses.replace(failed, outsiders=["c"]).alone_with_outsiders("a", elsewhere=["b"])
    assert not failed.alone_with_outsiders("a", elsewhere=["b"])  # c averaged with a


def test_a_strict_majority_is_counted_from_the_hash_held_most_often():
    assert held_by_most(["h1", "h2", "h1"]) == 2  # 2 x 2 > 3: settled
    assert held_by_most(["h1", "h2"]) == 1  # 2 x 1 > 2 fails: a pair that differs has no majority
    assert held_by_most([]) == 0


def test_a_worker_whose_hash_ties_the_most_held_one_is_not_outvoted_by_records_that_do_not_settle_the_check():
    # two of three workers' records in and split: the third may hold either hash, so the check waits for it
    assert tied_with({"a": "x", "b": "h"}, "h") and tied_with({"a": "x", "b": "h"}, "x")
    assert not tied_with({"a": "x", "c": "x", "b": "h"}, "h")  # outvoted
    assert tied_with({"a": "h", "b": "h", "c": "x", "d": "x"}, "h")
    assert not tied_with({"a": "x", "b": ""}, "h")  # an empty hash does not vote; this worker's is not among them


def test_faults_are_counted_per_take_and_every_counter_is_reported(caplog):
    faults = FaultCounter()
    with caplog.at_level(logging.WARNING):
        faults.count("lookups_failed", "member lookup failed: %s", "timeout")
        faults.count("repairs", "took the state of round %d", 4)
    counts = faults.take()
    assert set(counts) == set(FAULTS)
    assert counts["lookups_failed"] == 1 and counts["repairs"] == 1 and sum(counts.values()) == 2
    assert sum(faults.take().values()) == 0
    assert "member lookup failed: timeout [lookups_failed]" in caplog.text


def test_a_fault_repeating_with_the_same_reason_is_logged_once_a_minute_but_counted_every_time(caplog):
    faults = FaultCounter()
    with caplog.at_level(logging.WARNING):
        for _ in range(5):
            faults.count("records_refused", "refused a record from %s", "QmBad")
        faults.count("records_refused", "refused a record from %s", "QmOther")
    assert faults.take()["records_refused"] == 6
    assert caplog.text.count("QmBad") == 1 and caplog.text.count("QmOther") == 1


def test_an_unknown_fault_counter_is_a_programming_error():
    with pytest.raises(AssertionError):
        FaultCounter().count("no_such_counter", "x")


def test_a_config_difference_names_each_field_and_both_values():
    ours = json.dumps({"inner": {"lr": 0.003, "steps": 100}, "model": {"preset": "tiny"}})
    theirs = json.dumps({"inner": {"lr": 0.001, "steps": 100}, "model": {"preset": "tiny"}})
    assert config_diff(ours, theirs) == ["inner.lr: 0.003 here, 0.001 in the run"]


def test_faults_are_armed_by_name_and_conditions_and_an_unknown_name_is_refused(monkeypatch):
    monkeypatch.setenv(injection.ENV, "withhold_average:round=2:stage=0; corrupt_state:round=1:stage=1")
    assert injection.armed("withhold_average", round=2, stage=0)
    assert not injection.armed("withhold_average", round=2, stage=1)
    assert injection.armed("corrupt_state", round=1, stage=1)
    assert not injection.armed("kill_peer_in_allreduce", round=2, stage=0)
    monkeypatch.setenv(injection.ENV, "kill_peer_inallreduce:round=2")
    with pytest.raises(ValueError, match="unknown fault 'kill_peer_inallreduce'"):
        injection.armed("kill_peer_in_allreduce", round=2)


def _stalling_reply(chunks: int, stall_after: int, stall_s: float):
    from dilocox_p2p.proto_gen import swarm_pb2

    async def reply():
        for i in range(chunks):
            if i == stall_after:
                await asyncio.sleep(stall_s)
            yield swarm_pb2.Chunk(head=b"signed header") if i == 0 else swarm_pb2.Chunk()

    return reply()


def test_a_reply_that_stalls_costs_one_chunk_timeout_not_the_whole_budget():
    from dilocox_p2p.swarm.transfer import read_stream

    limits = dict(first_within=0.5, each_within=0.2, total_within=30.0, max_bytes=1 << 20)
    reply = asyncio.run(read_stream(_stalling_reply(1, 1, 0.0), **limits))
    assert reply.head == b"signed header" and reply.tensors == []
    started = time.monotonic()
    with pytest.raises(TimeoutError, match="no next chunk within 0.2s"):
        asyncio.run(read_stream(_stalling_reply(3, 1, 20.0), **limits))
    with pytest.raises(TimeoutError, match="no header within 0.5s"):
        asyncio.run(read_stream(_stalling_reply(3, 0, 20.0), **limits))
    assert time.monotonic() - started < 3.0
    with pytest.raises(TimeoutError, match="no header within 0.1s"):  # never past the whole budget
        asyncio.run(read_stream(_stalling_reply(3, 0, 0.3), first_within=1.0, each_within=1.0, total_within=0.1,
                                 max_bytes=1 << 20))


def test_a_peer_that_could_not_be_dialed_is_asked_again_until_it_answers_or_the_deadline():
    # the dial backoff's timings scaled down 20x (retry 1 s -> 0.05 s, window 6 s -> 0.3 s): the same rules
    fast = dict(what="test", retry_s=0.05, window_s=0.3)
    replies = iter([(None, "ControlFailure('failed to dial ... dial backoff')", 0), (None, "Connect failed", 0),
                    ("copy", "", 7)])  # fmt: skip
    calls = []

    async def call():
        calls.append(1)
        return next(replies)

    got = asyncio.run(dial.redial(call, time.monotonic() + 10, **fast))
    assert got == ("copy", "", 7) and len(calls) == 3
    assert _calls(dial.redial, [(None, "refused: altered", 0)], 10, **fast) == (1, "refused: altered")
    short, _ = _calls(dial.redial, [(None, "dial backoff", 0)], 0.15, **fast)
    assert short <= 1 + 0.15 / 0.05  # the deadline comes first (a late wake-up only means fewer calls)
    started = time.monotonic()
    _, why = _calls(dial.redial, [(None, "dial backoff", 0)], 60, **fast)  # a peer that never comes back ...
    assert why == "dial backoff" and time.monotonic() - started >= 0.25  # ... costs the window
    refused = [(None, "failed to dial: dial tcp4 127.0.0.1:1: connect: connection refused", 0)]
    assert _calls(dial.redial, refused, 60, **fast)[0] == 1  # nothing listens there: not asked again
    assert dial.REDIAL_WINDOW_S > 5.0  # the real window outlasts go-libp2p's first dial backoff (5 s)


def test_a_peer_in_dial_backoff_whose_every_address_refuses_a_connection_is_gone_and_not_asked_again():
    # a member killed in an all-reduce: the dial that put it in backoff found nothing listening, and every
    # survivor asked it again for the whole window (dial.py); a plain TCP probe of the addresses tells
    with socket.socket() as listening, socket.socket() as closed:
        listening.bind(("127.0.0.1", 0))
        listening.listen()
        closed.bind(("127.0.0.1", 0))  # bound, never listening: connections to it are refused
        live, dead = listening.getsockname()[1], closed.getsockname()[1]

        def backoff(*ports: int) -> str:
            named = "".join(f"\\n  * [/ip4/127.0.0.1/tcp/{p}] dial backoff" for p in ports)
            return f"ControlFailure('Connect failed. msg=failed to dial: failed to dial 12D3KooX: all dials failed{named}')"

        assert asyncio.run(dial.gone(backoff(dead)))
        assert not asyncio.run(dial.gone(backoff(dead, live)))  # one address still listens: maybe it is there
        assert not asyncio.run(dial.gone("failed to dial: dial backoff"))  # no address named: nothing to probe
        relayed = "all dials failed\\n  * [/ip4/1.2.3.4/tcp/4001/p2p/12D3KooR/p2p-circuit] dial backoff"
        assert not asyncio.run(dial.gone(relayed))
        assert not asyncio.run(dial.gone(backoff(dead) + relayed))  # a relay may still reach it
        refused = f"all dials failed\\n  * [/ip4/127.0.0.1/tcp/{dead}] dial tcp4 127.0.0.1:{dead}: connect: connection refused"
        assert asyncio.run(dial.gone(refused)) and asyncio.run(dial.gone(refused + backoff(dead)[-60:]))
        timed_out = "all dials failed\\n  * [/ip4/10.0.0.9/tcp/4001] dial tcp4 10.0.0.9:4001: i/o timeout"
        assert not asyncio.run(dial.gone(refused + timed_out))  # that address may still reach it
        fast = dict(what="test", retry_s=0.05, window_s=0.3)
        assert _calls(dial.redial, [(None, backoff(dead), 0)], 60, **fast)[0] == 1
        assert _calls(dial.redial, [(None, backoff(live), 0)], 60, **fast)[0] > 1


def _calls(redial, values, within: float, **kwargs) -> tuple[int, str]:
    """How many times `redial` called a request that always returns `values[0]` within `within` seconds, and the
    failure it ended with."""
    calls = []

    async def call():
        calls.append(1)
        return values[0]

    result = asyncio.run(redial(call, time.monotonic() + within, **kwargs))
    return len(calls), result[1]




def test_why_hivemind_ended_a_join_request_is_kept_for_the_requests_own_line_and_not_printed(caplog):
    import asyncio
    import logging

    from dilocox_p2p.swarm import join_reasons

    source = logging.getLogger("hivemind.averaging.matchmaking")
    level = source.level
    join_reasons.capture()
    join_reasons.capture()  # once per process, however often asked

    def _request_join_group(i: int) -> None:  # the function whose debug lines are reasons (hivemind's name)
        source.debug("requested leader %d to be my leader, but got rejected with NOT_LOOKING_FOR_GROUP", i)

    async def request(i: int) -> str:
        _request_join_group(i)
        await asyncio.sleep(0.01)  # the other request says its own reason meanwhile
        return join_reasons.take()

    async def both() -> list[str]:
        return list(await asyncio.gather(request(1), request(2)))

    try:
        with caplog.at_level(logging.DEBUG):
            assert asyncio.run(both()) == [
                "requested leader 1 to be my leader, but got rejected with NOT_LOOKING_FOR_GROUP",
                "requested leader 2 to be my leader, but got rejected with NOT_LOOKING_FOR_GROUP",
            ]
            source.debug("another function's debug line")
        assert not [r for r in caplog.records if r.name == source.name], "a reason was printed"
    finally:
        source.filters.clear()
        source.setLevel(level)
