"""Phase 5 of an exchange: the members of a group agree on one copy of its average before anyone uses it.

Mending can reach some members and not others, so copies of one group's average can differ: each
member announces the hash of its copy in the DHT (AverageRecord), reads the others', and takes the
majority's copy (`GroupVote._majority` says how, and when it stops waiting). A mixin of
exchange.RoundExchange (its stage, averager, membership, round and clock).

With the compressed butterfly a copy is made of reduced parts whose reducers signed a digest of each. A member
announces the hash of those digests with its copy's, and the digests themselves apart (DigestRecord): every
member reads every AverageRecord of its group, every round, and N digests in each of N records made phase 5
most of a member's DHT traffic (N=4, `tiny`: 6.3 kB a read, against 1.3 kB for the members' records). Members
whose digests differ read each other's and convict a reducer that signed two different parts.

A member sends its AverageRecord, sealed as it stores it, to the group's other voters as well (member_push.py):
a voter waits for those pushes and reads the group's records from the DHT only every AGREE_POLL_S while the
majority is not settled (first after AGREE_POLL_S), so a clean round's vote ends as the last copy is announced,
without a read. A borrower, to whom nobody pushes, reads at once.
"""

from __future__ import annotations

import collections
import dataclasses
import hashlib
import logging
import threading
import time
from collections.abc import Sequence
from typing import Any

from .. import injection
from ..average import Average, AverageKind, applies_nothing, average_hash, intersect_spans, spans_by_tensor
from ..wire import swarm_pb2
from .agreement import held_by_most, majority_hash, split_evenly
from .equivocation import equivocators

__all__ = ["AGREE_POLL_S", "DIGESTS_WAIT_S", "GroupVote", "digests_hash"]

logger = logging.getLogger("dilocox_p2p.swarm.exchange")  # its logs read as the exchange's

AGREE_POLL_S = 0.2  # phase 5 reads the group's average records this often until the majority is settled
DIGESTS_WAIT_S = 3.0  # how long a member waits for the digests of members whose digests differ from its own


def digests_hash(digests: Sequence[bytes]) -> bytes:
    """SHA-256 of a copy's reducer digests, in any order (b"": none, as without the compressed butterfly)."""
    if not digests:
        return b""
    h = hashlib.sha256()
    for d in sorted(digests):
        h.update(len(d).to_bytes(8, "big") + d)
    return h.digest()


LIAR_LATE_S = 2.0  # fault injection (lie_to_borrowers): how late a liar announces its own copy


class GroupVote:
    """Phase 5 of RoundExchange."""

    def _agree(self, average: Average, voters: Sequence[str] | None = None) -> Average:
        agreed = self._majority(average, voters)
        self.clock.mark("agree")
        return agreed

    def _majority(self, average: Average, voters: Sequence[str] | None = None) -> Average:
        """Make this worker's average the one most of its group holds, before anyone uses it.

        Mending can reach some members and not others (a reducer on a crawling link delivers
        to a few before their timeouts), so copies of one group's average can differ. Each
        member (the `voters`: the group; a borrower votes in none) announces the hash of its
        copy and reads the others'. It is settled as soon as a strict majority of the group
        holds one hash, or every other member has announced its copy or is past this round
        without one (it took another copy). After `chunk_timeout`, members that failed in the
        round (suspects) or left are not waited for, members still mending are; after
        `allreduce_timeout` it decides with the records there are (a split left then is found
        by the hash check and repaired at the next boundary). The majority's copy (a tie: none, and
        nobody applies the round's average: `_tie`) is made from this worker's own where it covers
        more (the majority's missing spans left out again: no download), else downloaded from
        a holder and checked against its hash; if that fails too, the average is marked
        `off_majority` and the worker takes the swarm's state at the boundary, before theta_g is
        used or recorded (worker.py). A clean round costs a push to each voter and one
        DHT store in the background, overlapped with training in every mode but `sync`.
        """
        voters = set(average.group if voters is None else voters)
        me = self.stage.peer_id
        borrowed = me not in voters
        if borrowed and average.kind.applies and not self.abandoned():
            voters = self._borrowers_voters(voters, average.group_id)
        # a borrower votes with whoever its records show, however few it found yet (the members of the group may
        # not have announced their copies when it looks: a server that named only itself then went unchecked)
        if not average.kind.applies or (len(voters) < 2 and not borrowed) or self.abandoned():
            return average
        mine = average_hash(average.tensors, average.missing)
        if me in voters:
            self._announce(average, mine, voters)
        records = self._group_records(average.group_id, voters, mine if me in voters else None, grow=borrowed)
        if me in voters and not records and (elsewhere := self._elsewhere(average, voters)) is not None:
            return elsewhere
        convicted = self._convict_equivocators(average, records)
        hashes = {p: r.average_hash for p, r in records.items() if p not in convicted}  # a liar votes no more
        if me in voters:
            hashes[me] = mine
        if split_evenly(hashes):
            return self._tie(average, hashes)
        winner = majority_hash(hashes, self.stage.records.rank)
        if winner is None or winner == mine:
            return average
        clients = {m.peer_id for m in self.membership.members() if m.record.client}  # asked last: client_member.py
        holders = sorted((p for p, h in hashes.items() if h == winner and p != me), key=lambda p: (p in clients, p))
        adopted = self._restricted(average, records[holders[0]], winner) or self._downloaded(average, holders, winner)
        if adopted is None:  # the failures were counted as downloads_failed; the boundary repairs this worker
            logger.warning("round %d: this worker's average differs from its group's majority (%d of %d hold %s) and "
                           "theirs could not be had: taking the swarm's state at the boundary", self.round,
                           len(holders), len(hashes), winner[:12])  # fmt: skip
            return dataclasses.replace(average, off_majority=True)
        self.stage.faults.count(
            "averages_adopted", "round %d: this worker's average (%s, %.1f%% of coordinates) differed from its group's "
            "majority (%d of %d hold %s): took theirs (%s, %.1f%%)", self.round, average.kind.value,
            100 * average.coverage, len(holders), len(hashes), winner[:12], adopted.kind.value, 100 * adopted.coverage,
        )  # fmt: skip
        if me in voters:  # members still deciding count this worker in the majority now; the digests it got stay
            self._announce(dataclasses.replace(adopted, digests=average.digests), winner, voters, digests_too=False)
        return adopted

    def _elsewhere(self, average: Average, voters: set[str]) -> Average | None:
        """Where every other member of this worker's group announced a copy of another group's average of the round
        (none was ever in this one: its copy is its own pseudo-gradient's, a group of one), the copy most of them
        hold, downloaded as a borrower's, or off the majority if it could not be had (a repair at the boundary); None
        otherwise. The vote's side of RoundResult.alone_with_outsiders with `elsewhere`, for a worker that could not
        tell at mending (the others' copies not ready yet, or no mending: the compressed butterfly's spans nobody
        reduced)."""
        others = voters - {self.stage.peer_id}
        try:
            opened = self.stage.records.opened_averages(self.round)
        except Exception as e:  # noqa: BLE001 - read again at the boundary's hash check
            self.stage.faults.count("lookups_failed", "round %d: the average records could not be read: %r", self.round, e)
            return None
        theirs = {p: o.message for p, o in opened.items() if p in others and o.message.group_id != average.group_id}
        if not others or set(theirs) != others:
            return None
        winner = majority_hash({p: r.average_hash for p, r in theirs.items()}, self.stage.records.rank)
        if winner is None:
            return None
        holders = sorted(p for p, r in theirs.items() if r.average_hash == winner)
        adopted = self._downloaded(average, holders, winner)
        if adopted is None:
            logger.warning("round %d: the others of this worker's group averaged the round in another group, whose "
                           "average could not be had: taking the swarm's state at the boundary", self.round)  # fmt: skip
            return dataclasses.replace(average, off_majority=True)
        self.stage.faults.count("averages_adopted", "round %d: the others of this worker's group (%s) averaged the "
                                "round in another group: took its average (%s)", self.round,
                                ", ".join(p[-8:] for p in sorted(others)), winner[:12])  # fmt: skip
        return dataclasses.replace(adopted, kind=AverageKind.BORROWED)

    def _tie(self, average: Average, hashes: dict[str, str]) -> Average:
        """No copy is held by more members than another: nobody adopts another's copy (a key generated to rank first
        would win every tie its own lie forces), and nobody applies its own, so that the group stays as one. Every
        member that read the same records decides the same; the hash check settles any other."""
        counts = sorted(collections.Counter(h for h in hashes.values() if h).values(), reverse=True)
        self.stage.faults.count("ties_kept", "round %d: the group's copies of its average are split evenly (%s of %d "
                                "voters): nobody applies this round's average", self.round,
                                " / ".join(map(str, counts)), len(hashes))  # fmt: skip
        note = "the group's copies of its average were split evenly (a tie is never adopted)"
        started = average.window[0] if average.window else self._window_start
        return dataclasses.replace(applies_nothing(AverageKind.STRANDED, note, started), stranded_alike=True)

    def _announce(self, average: Average, average_hash_: str, voters: set[str], *, digests_too: bool = True) -> None:
        """Publish this worker's copy's hash (AverageRecord) with the hash of the reducers' digests of what it was
        sent, pushed to the other `voters` first; the digests themselves (DigestRecord) in the background: only
        members whose digests differ read them (`_convict_equivocators`), and wait for them."""
        record = swarm_pb2.AverageRecord(
            round=self.round, group_id=average.group_id, average_hash=average_hash_, kind=average.kind.value,
            missing=[swarm_pb2.Span(start=a, end=b) for a, b in average.missing],
            digests_hash=digests_hash(average.digests),
        )  # fmt: skip
        if injection.armed("lie_to_borrowers", round=self.round, stage=self.stage.records.stage, quiet=True):
            time.sleep(LIAR_LATE_S)  # a liar also announces its copy late: a borrower that looks early finds nobody
        sealed = self.stage.records.seal_average(record)
        others = sorted(voters - {self.stage.peer_id})
        try:
            self.averager.push_average(sealed, others)
        except Exception as e:  # the DHT holds it: the others read it there
            logger.debug("round %d: could not push this worker's average record: %r", self.round, e)
        digests = None
        if digests_too and average.digests:
            digests = swarm_pb2.DigestRecord(round=self.round, group_id=average.group_id,
                                             reduced_digests=average.digests)  # fmt: skip
        # stored in the background: the voters have it by push, and the store (a DHT walk, tens of ms) was most of
        # a clean round's phase 5; borrowers and members whose push was lost read it there a moment later. One
        # store at a time, in order: the DHT keeps a subkey's latest expiration, so an announcement after adopting
        # the majority's copy stored before the first would be overwritten by it
        earlier = getattr(self, "_announcing", None)
        if earlier is not None:
            earlier.join()
        self._announcing = threading.Thread(target=self._store_announcement, args=(record, sealed, digests),
                                            name="announce", daemon=True)  # fmt: skip
        self._announcing.start()

    def _store_announcement(
        self, record: swarm_pb2.AverageRecord, sealed: bytes, digests: swarm_pb2.DigestRecord | None
    ) -> None:  # fmt: skip
        self.stage.records.publish_average(record, sealed)
        if digests is not None:
            self.stage.records.publish_digests(digests)

    def _convict_equivocators(self, average: Average, records: dict[str, swarm_pb2.AverageRecord]) -> set[str]:
        """A reducer whose signed digests of one reduced part differ between this worker's copy and another
        member's announced one sent them different bytes: proven, it is banned (equivocation.py) and its own
        copy does not vote; phase 5 then gives the others one copy as it does for any split. Returns who was.
        Only the digests of members whose digests' hash differs from this worker's are read: any two different
        sets among the group's are then at hand (this worker's, or one of those)."""
        mine = digests_hash(average.digests)
        # a copy without digests (mended whole from another's, or alone) publishes none
        differing = {p for p, r in records.items() if r.digests_hash and r.digests_hash != mine}
        if not differing:
            return set()
        theirs = self._digests_of(differing, average.group_id)
        digests = [*average.digests, *(d for r in theirs.values() for d in r.reduced_digests)]
        proven = equivocators(self.stage.gate, average.group_id, digests)
        for reducer, proof in proven.items():
            self.stage.convict(reducer, f"round {self.round}: {proof}")
        return set(proven)

    def _digests_of(self, members: set[str], group_id: bytes) -> dict[str, swarm_pb2.DigestRecord]:
        """The DigestRecords of `members` for `group_id`, read until all are in or DIGESTS_WAIT_S has passed (each
        member publishes its own just after its AverageRecord)."""
        deadline, found = time.monotonic() + DIGESTS_WAIT_S, {}
        while not self.abandoned():
            try:
                read = self.stage.records.digest_records(self.round, sorted(members - set(found)))
                found |= {p: r for p, r in read.items() if r.group_id == group_id}
            except Exception as e:
                self.stage.faults.count("lookups_failed", "round %d: the group's digest records could not be read: %r",
                                        self.round, e)  # fmt: skip
            if set(found) == members or time.monotonic() >= deadline:
                break
            time.sleep(AGREE_POLL_S)
        return found

    def _borrowers_voters(self, claimed: set[str], group_id: bytes) -> set[str]:
        """Who votes on a borrowed copy: admitted members (signed member records, one per key, none banned) that
        the serving peer named, or whose own signed AverageRecord names the group. The group list comes from the
        peer that served the copy: one that names only itself would skip the vote, and its copy would be applied
        unchecked."""
        admitted = self.membership.voters()
        try:
            found = self.stage.records.average_records(self.round)
        except Exception as e:
            self.stage.faults.count("lookups_failed", "round %d: the group's average records could not be read: %r",
                                    self.round, e)  # fmt: skip
            found = {}
        announced = {p for p, r in found.items() if r.group_id == group_id}
        return (claimed | announced) & admitted - {self.stage.peer_id}

    def _group_records(
        self, group_id: bytes, voters: set[str], mine: str | None, *, grow: bool = False
    ) -> dict[str, swarm_pb2.AverageRecord]:
        """The other voters' AverageRecords for `group_id`, read until the majority is settled (this worker's
        own copy, `mine`, counts if it votes). With `grow` (a borrower), admitted members whose records name the
        group join `voters` as their records come in, and for one chunk timeout the majority is not settled while
        an admitted member that may still announce has announced nothing for this round: it may be of the group."""
        started = time.monotonic()
        deadline, others = started + self.stage.deadlines.allreduce, voters - {self.stage.peer_id}
        admitted = self.membership.voters() - {self.stage.peer_id} if grow else set()
        records: dict[str, swarm_pb2.AverageRecord] = {}
        unheard = set(admitted)
        probed = False
        opened: dict[str, Any] = {}  # sender -> its latest AverageRecord, read or pushed (dht.Opened)
        read_at = started if grow else started + AGREE_POLL_S  # a voter waits for the others' pushes first
        while not self.abandoned():
            try:
                if time.monotonic() >= read_at:
                    read_at = time.monotonic() + AGREE_POLL_S
                    _newest(opened, self.stage.records.opened_averages(self.round))
                found = {p: o.message for p, o in opened.items()}
                if grow:
                    voters |= {p for p, r in found.items() if p in admitted and r.group_id == group_id}
                    others, unheard = voters - {self.stage.peer_id}, admitted - set(found)
                records = {p: r for p, r in found.items() if p in others and r.group_id == group_id}
            except Exception as e:
                self.stage.faults.count("lookups_failed", "round %d: the group's average records could not be read: %r",
                                        self.round, e)  # fmt: skip
            hashes = [r.average_hash for r in records.values()] + ([mine] if mine is not None else [])
            waited = time.monotonic() - started
            # an unheard member is waited for one chunk timeout at most (another borrower announces nothing)
            maybe = unheard - others if waited < self.stage.deadlines.chunk else set()
            awaited = self._awaited((others - set(records)) | maybe, waited)
            if 2 * held_by_most(hashes) > len(voters | awaited) or not awaited:
                break
            if not probed and waited >= self.stage.deadlines.chunk:
                # a member killed in the round whose copy this worker never had to ask for was not found gone while
                # it collected, and its record still says it trains: probed once, it is not waited for either
                probed = True
                self._gone.update(self.membership.drop_gone(sorted(awaited), self.round))
                continue
            if time.monotonic() >= deadline:
                logger.info("round %d: %d of %d members' average records in after %.0fs; deciding with them",
                            self.round, len(records), len(voters), self.stage.deadlines.allreduce)  # fmt: skip
                break
            _newest(opened, self._pushed(max(0.0, min(read_at, deadline) - time.monotonic())))
        return records

    def _pushed(self, timeout: float) -> dict[str, Any]:
        """The AverageRecords of this round pushed since the last look, waiting up to `timeout` for one."""
        pushes = getattr(self.stage, "pushed_averages", None)
        if pushes is None:
            time.sleep(timeout)
            return {}
        return pushes.take(self.round, timeout)

    def _awaited(self, silent: set[str], waited: float) -> set[str]:
        """Those of the `silent` voters that may still announce their copy: not the ones whose member record
        shows them past this round (they took another group's average: a borrower announces nothing), and
        after one chunk timeout, not the ones that failed in this round (suspects), left, or no longer train
        (a member restarted since, joining or taking the swarm's state, never announces this round's copy:
        waiting for it held the round's average back for allreduce_timeout, and its own state download
        with it, 60 s of a restart). One found gone while this worker collected (nothing listens at its
        addresses: it died in the round) is not waited for at all: a member killed in a pair's all-reduce
        held the survivor's round back a chunk timeout more. Nor is one whose record says it began training
        after this round (its first_round): a new life of a member killed in the round, restarted at once and
        training again from the swarm's state, held the survivor's round back allreduce_timeout (30 s, CI)."""
        members = {m.peer_id: m for m in self.membership.members(others_only=False)}
        return {
            p for p in silent
            if p not in self._gone
            and not (p in members and self.membership.finished(members[p], self.round))
            and not (p in members and members[p].record.first_round > self.round)
            and (waited < self.stage.deadlines.chunk or (p in members and members[p].record.training))
        }  # fmt: skip

    def _restricted(self, average: Average, record: swarm_pb2.AverageRecord, winner: str) -> Average | None:
        """This worker's copy with the majority's missing spans left out, if that gives the majority's bits."""
        target = tuple((s.start, s.end) for s in record.missing)
        if intersect_spans(average.missing, target) != average.missing or not average.tensors:
            return None  # the majority covers coordinates this copy lacks
        tensors = [t.clone() for t in average.tensors]
        for index, a, b in spans_by_tensor(target, [t.numel() for t in tensors]):
            tensors[index].view(-1)[a:b] = 0.0
        if average_hash(tensors, target) != winner:
            return None
        kind = AverageKind(record.kind)
        self._hold(tensors, kind, average.group, average.group_id, target, average.counted_by)
        return dataclasses.replace(average, kind=kind, tensors=tensors, missing=target)

    def _downloaded(self, average: Average, holders: list[str], winner: str) -> Average | None:
        """The majority's copy from one of its `holders`, checked against its hash (None: counted)."""
        got = self.averager.adopt(self.round, holders, winner, wait_s=self.stage.deadlines.chunk,
                                  deadline_s=self.stage.deadlines.state)  # fmt: skip
        for failure in got.failures:
            self.stage.faults.count("downloads_failed", "round %d: no majority average from %s", self.round, failure)
        if got.average is None:
            return None
        return got.average.to_average(
            bytes_sent=average.bytes_sent, bytes_received=average.bytes_received + got.bytes_received,
            window=(average.window[0] if average.window else self._window_start, time.time()),
            note=average.note, mended_from=tuple(got.mended_from),
        )  # fmt: skip


def _newest(into: dict[str, Any], records: dict[str, Any]) -> None:
    """Keep in `into` each sender's latest opened record of `into` and `records` (by the time its envelope was
    signed: a member that adopted the majority's copy announces again)."""
    for sender, opened in records.items():
        if sender not in into or opened.envelope.sent_at >= into[sender].envelope.sent_at:
            into[sender] = opened

