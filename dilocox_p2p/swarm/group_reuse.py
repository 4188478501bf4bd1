"""A round's group formed again without matchmaking: the members of the last round's whole group form the next
round's group themselves (issue 37, point 6).

hivemind's matchmaking is three network steps through two p2p daemons per member (a follower's join request, its
leader's acceptance, then its begin) and a DHT declaration: 0.16-0.21 s of every exchange at N=4 on the 100 Mbit/s
lab, the largest phase of a compressed exchange of `tiny` (docs/benchmarks.md, section 4). In a steady swarm it
finds the same group every round.

The rule (`reused_group`). A worker reuses round r's group for round r+1 when
- its round r ended averaged whole (`whole_group`: no failed reducer, outsider, refused or banned member, no client
  member, nothing missing, not off the group's majority) in a group G of two or more, kept by the stage worker;
- the members it expects for r+1 and itself are exactly G, and every other one has started r+1 (phase 1);
- every member's record for r+1 carries its `gathered`: the JoinRequest.gather of hivemind's matchmaking (bandwidth,
  mode and the signed GroupTicket) its join requests would carry, made when it started the round
  (stage.all_reduce). Low-rank's ranks in it are those the member held then: where its previous exchange was still
  running, the group agrees on ranks one round older than matchmaking would have (alike at every member).
Each such member builds the same group: the id a hash of (run, stage, round, G) (`reuse_group_id`), the members in
G's sorted order rotated by the round (`reuse_order`: the reducers' spans move), the gathered data in that order.
hivemind's step takes it in place of a search (averager.py, `_reused_group`), and the rest of the step runs as after
any matchmaking: the tickets are checked (group_admission._group_tickets), the ranks agreed, the butterfly run.
No join request, no DHT declaration: the matchmaking phase is the time to hand the group to the averager process.

Views that differ. A member that does not reuse (its previous round was not whole here, a record it had not read, a
restarted process that holds no last group) looks for the round's group through matchmaking. It knows the id the
others would use: that of the group its last round ran in (averager._reuse_next), or of the members it sees as it
starts the round (stage.all_reduce tells the averager process: averager.expect_group). A part (or a message request)
of that group that reaches it
- before it looks for that round (its previous exchange still ending) waits, as a part that comes before its
  leader's answer does (group_admission._joining_maybe), up to request_timeout + 1 s;
- while it looks through matchmaking, makes it ask the sender which group began and join it late
  (group_admission._join_begun), as a member whose leader's answer was lost does.
Otherwise it is outside that group, and the paths for a member outside a group take over: the group leaves it out
(allreduce.py, gather.py), and it borrows the group's average (exchange.py). A member that joins while the others
reuse their group (their views of the stage did not hold it yet when they started the round) is left out of that
round the same way: it borrows, and the next round's group, no longer the last one's, is found by matchmaking.
The other way round, a member that reuses while the others, which read a joiner's record in time, look through
matchmaking and follow the joiner: its parts wait at them for a group that never begins there. They answer that they
are outside it once their own group begins (it looks again, finds nobody and borrows), or its timeouts end first and
they are failed reducers; asked for its missing spans, they answer with their group's average, and it borrows that
(RoundResult.alone_with_outsiders, group_round.py): its own partial average was its pseudo-gradient alone, and
applied, it split the swarm.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hivemind.utils import MSGPackSerializer

from ..average import Average, AverageKind
from ..wire import swarm_pb2
from .member_push import claimed_round

__all__ = ["REUSE_ID_BYTES", "ReusedGroup", "RoundTicket", "WholeGroup", "gathered_round", "reuse_group_id", "reuse_order", "reused_group", "whole_group"]

REUSE_ID_BYTES = 20  # as long as hivemind's own group ids (a DHTID)


@dataclass(frozen=True)
class WholeGroup:
    """A round whose group averaged whole at this worker: its members, sorted."""

    round: int
    members: tuple[str, ...]


@dataclass(frozen=True)
class RoundTicket:
    """This worker's signed GroupTicket for a round, made when it started the round, and the JoinRequest.gather that
    carries it (in its member record)."""

    round: int
    ticket: bytes
    gathered: bytes
    ranks: tuple[int, ...]


@dataclass(frozen=True)
class ReusedGroup:
    """The group a round forms without matchmaking: its id, its members in group order, and their gathered data
    (hivemind's JoinRequest.gather) in that order; `ticket`: this worker's own signed ticket in it (its step's)."""

    group_id: bytes
    members: tuple[str, ...]
    gathered: tuple[bytes, ...]
    ticket: bytes = b""


def whole_group(round: int, average: Average, result: Any) -> WholeGroup | None:
    """Round `round`'s group, if it averaged whole at this worker (`average` as the exchange ended, `result` the
    all-reduce's RoundResult, None where none came): what the next round may reuse."""
    if result is None or average.kind is not AverageKind.AVERAGED or average.missing or average.off_majority:
        return None
    if result.failed_reducers or result.outsiders or result.offenders or result.banned_senders or result.clients:
        return None
    if result.missing or len(result.group) < 2 or set(average.group) != set(result.group):
        return None
    return WholeGroup(round, tuple(sorted(result.group)))


def reuse_group_id(run_id: str, stage: int, round: int, members: Sequence[str]) -> bytes:
    """The id of round `round`'s group of `members` formed without matchmaking: the same at every member."""
    blob = "\n".join(["dilocox reused group", run_id, str(stage), str(round), *sorted(members)]).encode()
    return hashlib.sha256(blob).digest()[:REUSE_ID_BYTES]


def reuse_order(members: Sequence[str], round: int) -> list[str]:
    """The group order of a reused group: sorted, rotated by the round, so that each member's span moves."""
    ordered = sorted(members)
    k = round % len(ordered)
    return ordered[k:] + ordered[:k]


def gathered_round(gathered: bytes) -> int | None:
    """The round the ticket inside a JoinRequest.gather (bandwidth, mode, user data) names, unverified (None: not
    such data)."""
    try:
        _, _, user = MSGPackSerializer.loads(gathered)
        return claimed_round(MSGPackSerializer.loads(user))
    except Exception:  # noqa: BLE001 - malformed bytes of any kind
        return None


def reused_group(
    *, run_id: str, stage: int, round: int, me: str, mine: RoundTicket | None, last: WholeGroup | None,
    records: Mapping[str, swarm_pb2.MemberRecord],
) -> tuple[ReusedGroup | None, str]:  # fmt: skip
    """Round `round`'s group without matchmaking (module docstring), or None and why not. `mine`: the ticket this
    worker made when it started the round (None: none); `last`: the last round that averaged whole here; `records`:
    the member records of the other members this worker expects in the round."""
    if last is None or last.round != round - 1:
        return None, "the last round did not average whole here"
    if mine is None or mine.round != round or not mine.gathered:
        return None, "this worker made no ticket when it started the round"
    if set(records) | {me} != set(last.members):
        return None, "the members expected are not the last round's group"
    by_member = {me: mine.gathered}
    for peer, record in records.items():
        if record.averaging_round != round or record.client or record.sitting_out == round + 1:
            return None, f"{peer[-8:]} has not started this round, sits it out or is a client member"
        if gathered_round(record.gathered) != round:
            return None, f"{peer[-8:]}'s record holds no ticket of this round"
        by_member[peer] = record.gathered
    order = reuse_order(last.members, round)
    group_id = reuse_group_id(run_id, stage, round, order)
    return ReusedGroup(group_id, tuple(order), tuple(by_member[p] for p in order), mine.ticket), ""
