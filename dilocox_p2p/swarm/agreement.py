"""Agreement of a stage group: round records, hash checks, and state downloads verified against the majority.

At every boundary a worker publishes a `RoundRecord` with the hash of its shared state
(theta_g and momentum) and, once known, of the average it will apply next (delayed mode).
It then compares its hash with the others' as soon as the comparison is settled: a hash
held by a strict majority of the workers expected at that boundary (the training members at
it or one round behind), or every expected worker's record in. Until then it looks again
every CHECK_POLL_S seconds, at most EARLY_POLLS times. A check still open when the worker
reaches its next boundary is settled there first (`settle_check`, waiting at most round_wait
for the group's records), and one still open then is checked with the records there are when
the next one is published. A worker in the minority is repaired at its next boundary (state
download), so it trains at most one round on a diverged state. A check whose lookup fails is
counted (`hash_checks_skipped`) and retried at later rounds.

A downloaded state is accepted only if its state hash AND the hash of its pending average
equal what most of the stage group announced for that boundary, not only what the donor
says of itself. Round records are signed (dht.py) and only members vote: a third party can
neither write under a member's name nor add votes of its own.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ..average import Average, AverageKind, applies_nothing
from ..config import SwarmConfig
from ..state import StageState
from ..wire import swarm_pb2
from .averager import DilocoxAverager
from .deadlines import Deadlines
from .state_service import StateDownload
from .dht import RunRecords
from .faults import FaultCounter
from .membership import Membership

__all__ = ["Agreement", "Repair", "held_by_most", "majority_hash", "split_evenly", "tied_with"]

logger = logging.getLogger(__name__)

RECORDS_KEPT = 2  # a donor may serve the state of the boundary before its current one (worker.py)
CHECK_ATTEMPTS = 3  # a boundary whose records cannot be read is checked again at this many later rounds
CHECK_POLL_S = 0.5  # while the latest boundary's check is not settled, its records are read again this often
EARLY_POLLS = 40  # ... at most this many times; then it waits for the next boundary (the records there are then)
# a pending average served before its hash shows in the records this worker reads (a DHT node that missed the
# donor's store): they are read again, every CHECK_POLL_S, this long
ANNOUNCED_WAIT_S = 5.0


def majority_hash(hashes: dict[str, str], rank: Callable[[str], Any] = str) -> str | None:
    """The hash most workers hold. Empty ones don't vote. A tie goes to the hash held by the worker of
    smallest `rank` (RunRecords.rank: its peer's key first, then its worker id): every peer picks the same.
    Only a worker that must pick a side uses a tie's winner (a joiner choosing a donor and checking the state
    it took); a member holding one of the tied copies or states keeps its own (`split_evenly`)."""
    holders: dict[str, list[str]] = {}
    for peer, h in hashes.items():
        if h:
            holders.setdefault(h, []).append(peer)
    if not holders:
        return None
    return min(holders, key=lambda h: (-len(holders[h]), min(rank(p) for p in holders[h])))


def split_evenly(hashes: dict[str, str]) -> bool:
    """Whether no hash is held by more workers than every other (empty ones don't vote). A member never gives up
    its own copy or state for a tie: whoever holds the smallest rank would win it, and a key can be chosen (generated
    until it ranks first) to win every tie its own lie forces. A tie is kept until a third vote settles it."""
    top = collections.Counter(h for h in hashes.values() if h).most_common(2)
    return len(top) == 2 and top[0][1] == top[1][1]


def held_by_most(hashes: Iterable[str]) -> int:
    """How many of `hashes` equal the one held most often (0 for none): a strict majority of n is 2 x this > n."""
    return max(collections.Counter(hashes).values(), default=0)


def tied_with(hashes: dict[str, str], state_hash: str) -> bool:
    """Whether `state_hash` is held by as many of `hashes` as the hash held most. Records that do not settle
    the check (some expected worker's missing) must not repair on a tie: the smallest rank would break it,
    and the missing worker may hold this worker's hash (two healthy workers of three, one's record late)."""
    counts = collections.Counter(h for h in hashes.values() if h)
    return counts[state_hash] == max(counts.values(), default=0)


@dataclass(frozen=True)
class Repair:
    """A hash check found this worker in the minority at `boundary`."""

    boundary: int
    majority: str
    holders: list[str]


@dataclass
class _Check:
    boundary: int
    state_hash: str
    epoch: int
    attempts: int = 0  # lookups that failed, or checks run with the records there were
    polls: int = 0  # early looks at the latest boundary's records that did not settle it


class Agreement:
    """Publishes this worker's round records and checks them against the stage group's."""

    def __init__(
        self,
        records: RunRecords,
        averager: DilocoxAverager,
        membership: Membership,
        sw: SwarmConfig,
        faults: FaultCounter,
        deadlines: Deadlines,
    ):
        self.records, self.averager, self.membership, self.sw, self.faults = records, averager, membership, sw, faults
        self.deadlines = deadlines
        self.peer_id = records.peer_id
        self._lock = threading.Lock()
        self._epoch = 0  # bumped when the state is replaced; checks of older states are void
        self._checks: list[_Check] = []
        self._repair: Repair | None = None
        self._records: dict[int, swarm_pb2.RoundRecord] = {}  # the last RECORDS_KEPT published, by boundary
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._run_checks, name="hash-checks", daemon=True)
        self.donors_at = -1  # the newest boundary a donor said it was at when it no longer held the one asked for
        self._left_for_newer = False  # a download in pieces was given up for the donors' newer boundary (once per take)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._closed.set()
        self._wake.set()
        self._thread.join(timeout=10)

    # ----- publishing ---------------------------------------------------------------------------
    def publish(self, boundary: int, state_hash: str, *, check: bool = True, **facts: object) -> None:
        """Publish the state held at `boundary`; check it against the stage group's in the background
        (module docstring: as soon as the comparison is settled, at the latest when the next boundary
        is published)."""
        record = swarm_pb2.RoundRecord(boundary=boundary, state_hash=state_hash, **facts)
        with self._lock:
            self._records[boundary] = record
            for old in sorted(self._records)[:-RECORDS_KEPT]:
                del self._records[old]
        self.records.publish_round(record)
        self._wake.set()
        if check:
            with self._lock:
                self._checks = [c for c in self._checks if c.boundary != boundary]
                self._checks.append(_Check(boundary, state_hash, self._epoch))

    def publish_pending(self, boundary: int, pending_hash: str) -> None:
        """The average applied at the end of round `boundary` is now known: add its hash to the record
        (also after this worker moved on: a joiner may still be served the state of `boundary`)."""
        with self._lock:
            if boundary not in self._records:
                return
            self._records[boundary].pending_hash = pending_hash
            record = swarm_pb2.RoundRecord()
            record.CopyFrom(self._records[boundary])
        self.records.publish_round(record)

    def forget(self) -> None:
        """The state was replaced: earlier hashes say nothing about it any more."""
        with self._lock:
            self._epoch += 1
            self._checks, self._repair = [], None
        self._left_for_newer = False

    def take_repair(self) -> Repair | None:
        with self._lock:
            repair, self._repair = self._repair, None
        return repair

    # ----- checking -----------------------------------------------------------------------------
    def _run_checks(self) -> None:
        while not self._closed.is_set():
            with self._lock:
                early = any(c.polls < EARLY_POLLS for c in self._checks)
            self._wake.wait(CHECK_POLL_S if early else None)
            self._wake.clear()
            with self._lock:
                latest = max(self._records, default=-1)
                due = list(self._checks)
            for check in due:
                if self._closed.is_set():
                    return
                settle_only = check.boundary >= latest  # the next boundary is not out yet: decide only if settled
                if settle_only and check.polls >= EARLY_POLLS:
                    continue
                outcome = self._check(check, settle_only=settle_only)
                with self._lock:
                    if outcome == "open":
                        check.polls += 1
                        continue
                    check.attempts += 1
                    if outcome == "done" or check.attempts >= CHECK_ATTEMPTS or check.epoch != self._epoch:
                        self._checks = [c for c in self._checks if c is not check]

    def settle_check(self, boundary: int, *, deadline: float) -> None:
        """Settle the background check of `boundary` now if it is still open (the records of the group came
        later than this worker's next boundary), waiting for them until `deadline` (a time.monotonic()); a
        repair it finds is then taken at once (`take_repair`). Past the deadline the check goes on in the
        background, as before."""
        with self._lock:
            check = next((c for c in self._checks if c.boundary == boundary and c.epoch == self._epoch), None)
        while check is not None:
            outcome = self._check(check, settle_only=True)
            if outcome == "done":
                with self._lock:
                    self._checks = [c for c in self._checks if c is not check]
            with self._lock:
                if outcome != "open" or check not in self._checks:  # decided here, by the background, or to retry
                    return
            if time.monotonic() >= deadline:
                logger.info("the hash check of round %d is not settled by the next boundary; it goes on", boundary)
                return
            time.sleep(CHECK_POLL_S)
            self.membership.refresh()

    def _check(self, check: _Check, *, settle_only: bool = False) -> str:
        """Compare `check` with the others' records: "done", "retry" (the lookup failed, or no other
        record was there: tried again later) or, with `settle_only`, "open" (not settled yet)."""
        try:
            hashes = self._voted_hashes(check.boundary, check.state_hash)
        except Exception as e:
            if settle_only:
                return "open"
            self.faults.count("hash_checks_skipped", "hash check of round %d skipped: lookup failed (%r)", check.boundary, e)
            return "retry"
        settled = self._settled(check.boundary, hashes)
        if settle_only and not settled:
            return "open"
        if len(hashes) == 1 and self._others_held(check.boundary):
            self.faults.count(
                "hash_checks_skipped", "hash check of round %d skipped: no other worker's record was found",
                check.boundary,
            )
            return "retry"
        if not settled and len(hashes) > 1 and tied_with(hashes, check.state_hash):
            self.faults.count(
                "hash_checks_skipped", "hash check of round %d skipped: %d workers' records in, split evenly",
                check.boundary, len(hashes),
            )  # fmt: skip
            return "retry"
        repair = self._decide(check.boundary, check.state_hash, hashes, when="at the next round")
        with self._lock:
            if repair is not None and check.epoch == self._epoch:
                self._repair = repair
        return "done"

    def settle(self, boundary: int, state_hash: str, *, deadline: float) -> Repair | None:
        """Wait until the comparison at `boundary` is settled (or `deadline`, a time.monotonic(), then
        decide with the records there are); the repair to make now if this worker is in the minority.
        For the run's last boundary, which no later boundary checks."""
        hashes = {self.peer_id: state_hash}
        self.membership.refresh()  # who is expected here: a view from before the last round may miss a member
        while True:
            try:
                hashes = self._voted_hashes(boundary, state_hash)
            except Exception as e:
                self.faults.count("lookups_failed", "round records of %d could not be read: %r", boundary, e)
            else:
                if self._settled(boundary, hashes, resyncing_too=True):
                    break
            if time.monotonic() >= deadline:
                if len(hashes) > 1 and tied_with(hashes, state_hash):
                    logger.warning("round %d: %d workers' records in by the deadline, split evenly: keeping this "
                                   "worker's state", boundary, len(hashes))
                    return None
                logger.info("round %d: %d workers' records in by the deadline; deciding with them", boundary, len(hashes))
                break
            time.sleep(CHECK_POLL_S)
            self.membership.refresh()
        return self._decide(boundary, state_hash, hashes, when="now")

    def _voted_hashes(self, boundary: int, state_hash: str) -> dict[str, str]:
        """The state hashes the members announced for `boundary`, this worker's (`state_hash`) included."""
        records = self.records.round_records(boundary)
        voters = self.membership.voters()
        hashes = {peer: r.state_hash for peer, r in records.items() if peer in voters}
        hashes[self.peer_id] = state_hash
        return hashes

    def _decide(self, boundary: int, state_hash: str, hashes: dict[str, str], *, when: str) -> Repair | None:
        if split_evenly(hashes):
            self.faults.count(
                "ties_kept", "the state at round %d is split evenly among %d workers (this one %s): no side is repaired "
                "for a tie, which a hostile key could force and win; a third member's vote settles it", boundary,
                len(hashes), state_hash[:12],
            )  # fmt: skip
            return None
        winner = majority_hash(hashes, self.records.rank)
        if winner is None or winner == state_hash:
            return None
        holders = sorted(p for p, h in hashes.items() if h == winner)
        logger.warning(
            "the state at round %d differed from the majority (%d of %d workers hold %s, this one %s): repairing %s",
            boundary, len(holders), len(hashes), winner[:12], state_hash[:12], when,
        )  # fmt: skip
        return Repair(boundary, winner, holders)

    def _settled(self, boundary: int, hashes: dict[str, str], *, resyncing_too: bool = False) -> bool:
        """Whether the records in `hashes` (this worker's included) decide the majority at `boundary` already:
        a hash held by a strict majority of the workers expected there, or every expected worker's record in
        without a tie. Expected: the training members at most two boundaries behind (a member record lags its
        worker by up to a heartbeat; one one boundary behind counted as absent let two of three workers, one of
        them corrupted, tie and settle on the smallest rank), and `resyncing_too`, at the last boundary, the
        members taking a state as well (two members repairing the round before while a third trained the last
        one alone left that third deciding alone). A tie settles only once every such member's record is in:
        the smallest rank (peer key) decides a split pair, never a split that a third worker would break."""
        # suspects too: one that failed in a round's all-reduce (a message that missed its pair under load) trains
        # apart meanwhile, and its record is the one that shows the split; left out, a pair settled on itself
        live = self.membership.members(training_only=not resyncing_too, suspects_too=True)
        training = {m.peer_id for m in live} | {self.peer_id}
        expected = {m.peer_id for m in live if m.record.boundary >= boundary - 2}
        expected.add(self.peer_id)
        most = held_by_most(hashes.values())
        if 2 * most > len(expected | set(hashes)):
            return True
        tie = list(collections.Counter(hashes.values()).values()).count(most) > 1
        return expected <= set(hashes) and (not tie or training <= set(hashes))

    def _others_held(self, boundary: int) -> bool:
        """Other training members are at or past `boundary` (so they published a record of it)."""
        return any(m.record.boundary >= boundary for m in self.membership.members(training_only=True, suspects_too=True))

    # ----- verified state downloads ---------------------------------------------------------------
    def fetch_state(self, boundary: int, donors: Sequence[str]) -> StateDownload | None:
        """Download the state at `boundary` from the donors whose state matches the stage group's majority
        hashes; None if none did (each failure counted). Where two or more donors announced the majority's hash
        of `boundary`, it comes in pieces from all of them at once (`_fetch_pieces`); else, or if that failed,
        whole from the first donor that serves it. A donor whose pending average is still in flight serves
        theta_g and momentum at once and names that average (`state.follows`): the taker gets it with
        `fetch_pending` while it trains. A donor that moved past `boundary` says where it is (`donors_at`); the
        others, which train in step with it, are not asked for `boundary` then: the caller asks for the boundary
        told (beside 5 busy peers, asking 4 more donors each for a round they had all left took a restart 1-2 s)."""
        pieces = self._fetch_pieces(boundary, donors)
        if pieces is not None:
            return pieces
        if self.donors_at > boundary and self._left_for_newer:  # the donors left it while it came in pieces
            return None
        for donor in donors:
            got = self.averager.download_round(donor, boundary, wait_s=self.deadlines.allreduce,
                                               timeout=self.deadlines.state, part=swarm_pb2.STATE_NOW)  # fmt: skip
            if got.status == swarm_pb2.STATE_GONE:  # its signed answer says where it is: ask for that next
                self.donors_at = max(self.donors_at, got.boundary)
            if got.status != swarm_pb2.STATE_OK or got.state is None:
                status = swarm_pb2.StateStatus.Name(got.status) if got.status >= 0 else "error"
                self.faults.count("downloads_failed", "state of round %d not taken from %s: %s (donor at %d) %s",
                                  boundary, donor, status, got.boundary, got.reason)
                if got.status == swarm_pb2.STATE_GONE and got.boundary > boundary:
                    return None
                continue
            problem = self.verify(got.state)
            if problem:
                self.faults.count("downloads_failed", "state of round %d from %s refused: %s", got.boundary, donor, problem)
                continue
            return got
        return None

    def _fetch_pieces(self, boundary: int, donors: Sequence[str]) -> StateDownload | None:
        """The state at `boundary` in pieces from the donors whose round record of it holds the majority's hash, or
        whose record is not in yet (records lag behind their workers; each piece is checked against that hash on
        arrival: swarm/state_pieces.py), if two or more are; None if fewer are, or if it could not be had so
        (counted)."""
        try:
            records = self._voters_records(boundary)
        except Exception:  # the whole-state path says why, and tries anyway
            return None
        winner = majority_hash({p: r.state_hash for p, r in records.items()}, self.records.rank)
        holders = [d for d in donors if d not in records or records[d].state_hash == winner][: self.sw.state_donors]
        if winner is None or len(holders) < 2:
            return None
        leave = not self._left_for_newer  # once per state taken (state_pieces.py)
        try:
            got = self.averager.download_pieces(holders, boundary, want_hash=winner, wait_s=self.deadlines.allreduce,
                                                timeout=self.deadlines.state, leave_for_newer=leave)  # fmt: skip
        except TimeoutError as e:  # the averager process did not answer in time: whole from one donor, as before
            self.faults.count("downloads_failed", "state of round %d not taken in pieces: %r", boundary, e)
            return None
        if leave and got.status == swarm_pb2.STATE_GONE and got.boundary > boundary:
            self._left_for_newer = True
            self.donors_at = max(self.donors_at, got.boundary)
        for donor, why in got.dropped.items():  # a donor gone past `boundary` is asked again whole: it says where it is
            self.faults.count("downloads_failed", "state of round %d: donor %s asked for no more pieces: %s",
                              boundary, donor, why)  # fmt: skip
        problem = got.reason if got.status != swarm_pb2.STATE_OK or got.state is None else self.verify(got.state)
        if problem:
            self.faults.count("downloads_failed", "state of round %d not taken in pieces from %d donors: %s",
                              boundary, len(holders), problem)  # fmt: skip
            return None
        return got

    def fetch_pending(self, taken: StateDownload, donors: Sequence[str], give_up: Callable[[], bool]) -> Average:
        """The average of round `taken.state.follows` that the state taken left out (it was in flight): from
        the donor of that state first, then the other `donors`, each serving it once it is in, checked
        against the hash most of the stage group announced for it. STRANDED (counted) if none could serve
        it in time: this worker then applies nothing where its group applies that average, and the hash
        check of its next boundary repairs it."""
        state = taken.state
        assert state is not None and state.follows >= 0
        deadline = time.monotonic() + self.deadlines.allreduce + self.sw.round_wait
        for donor in [taken.donor, *(d for d in donors if d != taken.donor)]:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or give_up():
                break
            got = self.averager.download_round(donor, state.boundary, wait_s=remaining, timeout=self.deadlines.state,
                                               part=swarm_pb2.STATE_PENDING)  # fmt: skip
            problem = self._pending_problem(got, state)
            if not problem:
                assert got.state is not None
                pending = got.state.pending
                if pending is not None:
                    return pending.average
                # the donor's exchange of that round found no average (the stage group applies none): nobody is
                # ahead, so this worker, applying none alike, must not resync for it (it would abandon its own
                # exchange of the next round, and the donor, waiting for it there, would strand that one too)
                nothing = applies_nothing(AverageKind.STRANDED, f"the stage group applies no average of round "
                                          f"{state.follows}", 0.0)  # fmt: skip
                return dataclasses.replace(nothing, stranded_alike=True)
            self.faults.count("downloads_failed", "the average of round %d not taken from %s: %s",
                              state.follows, donor, problem)  # fmt: skip
        note = f"the average of round {state.follows}, left out of the state of round {state.boundary}, could not be had"
        if not give_up():
            self.faults.count("pending_dropped", "%s; the next hash check repairs this worker", note)
        return applies_nothing(AverageKind.STRANDED, note, 0.0)

    def _pending_problem(self, got: StateDownload, state: StageState) -> str:
        """Why `got` (a STATE_PENDING reply) is not the average the stage group applies after `state` ("" if it is)."""
        if got.status != swarm_pb2.STATE_OK or got.state is None:
            status = swarm_pb2.StateStatus.Name(got.status) if got.status >= 0 else "error"
            return f"{status} (donor at {got.boundary}) {got.reason}".strip()
        if got.state_hash != state.hash() or got.boundary != state.boundary:
            return f"the donor's state of round {got.boundary} is not the one taken ({got.state_hash[:12]})"
        pending = got.state.pending
        if pending is not None and pending.round != state.follows:
            return f"it served the average of round {pending.round}, not of round {state.follows}"
        until = time.monotonic() + (ANNOUNCED_WAIT_S if pending is not None else 0.0)
        while True:
            try:
                records = self._voters_records(state.boundary)
            except Exception as e:
                return f"the stage group's round records of {state.boundary} could not be read: {e!r}"
            announced = self._majority_pending(records)
            if announced is not None or time.monotonic() >= until:
                break
            time.sleep(CHECK_POLL_S)  # the donor announced it before serving it: the record is on its way
        if pending is None:
            return "" if announced is None else f"it served no average where the stage group announced {announced[:12]}"
        problem = self._pending_mismatch(records, got.state)
        if announced is None:  # name the records read, so the next one explains itself
            read = ", ".join(f"{p[-8:]} {r.state_hash[:8]}/{r.pending_hash[:8] or '-'}" for p, r in sorted(records.items()))
            problem += f" in {ANNOUNCED_WAIT_S:.0f} s (round records of {state.boundary}, state/pending hash: {read or 'none'})"
        return problem

    def verify(self, state: StageState) -> str:
        """Why `state` is not what most of the stage group announced for its boundary ("" if it is)."""
        try:
            records = self._voters_records(state.boundary)
        except Exception as e:
            self.faults.count("lookups_failed", "round records of %d could not be read: %r", state.boundary, e)
            return "the stage group's round records could not be read"
        ours = state.hash()
        winner = majority_hash({p: r.state_hash for p, r in records.items()}, self.records.rank)
        if winner is None:
            return f"no worker announced a state for round {state.boundary}"
        if ours != winner:
            return f"its state hash {ours[:12]} is not the majority's {winner[:12]}"
        return self._pending_mismatch(records, state) if state.pending is not None else ""

    def _voters_records(self, boundary: int) -> dict[str, swarm_pb2.RoundRecord]:
        """The round records of `boundary` by the members that vote (raises if the lookup fails)."""
        voters = self.membership.voters()
        return {p: r for p, r in self.records.round_records(boundary).items() if p in voters}

    def _majority_pending(self, records: dict[str, swarm_pb2.RoundRecord]) -> str | None:
        return majority_hash({p: r.pending_hash for p, r in records.items()}, self.records.rank)

    def _pending_mismatch(self, records: dict[str, swarm_pb2.RoundRecord], state: StageState) -> str:
        """Why `state`'s pending average is not the one most of `records` announced ("" if it is)."""
        assert state.pending is not None
        pending = self._majority_pending(records)
        if pending is None:
            return f"no worker announced the average of round {state.pending.round}"
        if state.pending_hash() != pending:
            return f"its pending average {state.pending_hash()[:12]} is not the majority's {pending[:12]}"
        return ""
