"""How a swarm stage worker takes the swarm's state: a joiner at its start, a worker whose hash check found it in
the minority (a repair), and one that fell behind or was stranded (a catch-up).

All stages of a peer take the state of one common boundary (`_resync`): they agree on the target, each asks its
donors (holders of the majority hash first, `_donor_order`) for that boundary's state (Agreement.fetch_state: in
pieces from several donors at once where two or more hold it), and install it together (`_install`); where the
donor's average of the round before was still in flight, it follows while the worker trains (`_take_pending`).
"""

from __future__ import annotations

import logging
import threading
import time
from concurrent.futures import Future
from typing import Any

from ..average import Average, AverageKind, applies_nothing
from ..memory_estimate import gib
from .agreement import majority_hash
from .dht import Member
from .state_service import StateDownload

__all__ = ["RESYNC_ATTEMPTS", "StateTaking"]

logger = logging.getLogger(__name__)

RESYNC_ATTEMPTS = 6
DONOR_POLL_S = 0.5  # while no donor has reached the boundary yet, their records are read again this often


class StateTaking:
    """Mixin for SwarmStageWorker: the state taken from the swarm."""

    swarm: Any
    outer: Any
    lead: bool
    rounds: int
    _stop: threading.Event
    _state_donors: dict[str, int]

    def take_state_donors(self) -> dict[str, int]:
        """The bytes each donor served this stage of the states it took since the last call (metrics)."""
        taken, self._state_donors = self._state_donors, {}
        return taken

    def _holds_majority(self, boundary: int) -> bool:
        try:
            records = self.swarm.records.round_records(boundary)
        except Exception as e:
            self.swarm.faults.count("lookups_failed", "round records of %d could not be read: %r", boundary, e)
            return True  # nothing says otherwise; the first hash check will tell
        return majority_hash({p: r.state_hash for p, r in records.items()}, self.swarm.records.rank) in (
            None, self.outer.hash()
        )

    def _resync(self, boundary: int, *, reason: str, patience_s: float = 0.0) -> int | None:
        """All stages of this peer take the swarm's state at one common boundary >= `boundary`.

        The stages first agree on the target: the newest boundary any of their donors announced. Each
        then asks its donors (holders of the majority hash first) for the state of exactly that
        boundary: a donor at it serves theta_g and momentum at once (the pending average follows,
        `_install`), or, if it moved on meanwhile, the copy it kept because a request was waiting.
        After a stage missed the target (its donors had moved past it), the stages aim at the newest
        boundary a donor said it had reached (its signed STATE_GONE), or one beyond the newest
        announced, which donors serve on reaching it. Asking each for "a state no older than" let the
        stages chase donors that moved on while they downloaded (one stage took a newer state than the
        other, round after round, until the run ended). If a stage could not get the target, all ask again. Returns the boundary the peer
        continues from, or None if nobody could serve a state. `reason` is the fault counter it counts
        as: "repairs" or "catch_ups".

        While no donor has reached `boundary` yet, the stages wait for one up to `patience_s` before they count
        attempts (`_resync_aside`: as long as a member still in the round's exchange may take). A member stranded
        when its leader died resynced at once, gave up after its attempts a second before its partner ended that
        exchange, and the two trained on split for good (a tie: CI run 229, test_elastic).
        """
        result: StateDownload | None = None
        rechecked = newer = chased = False
        ahead, target, attempt = 0, -1, 0
        patience = time.monotonic() + patience_s
        while attempt < RESYNC_ATTEMPTS:
            if attempt and not newer and not ahead:
                time.sleep(0.5 * attempt)
            self.swarm.membership.refresh()
            donors = [m for m in self.swarm.membership.donors() if m.record.boundary >= boundary]
            # the newest boundary the donors' records announce, or one a donor said it had reached (records lag
            # behind on a loaded DHT): a donor serves its current state at once, so that one is asked for as is
            told = max(self._all_gather(self.swarm.agreement.donors_at))
            newest = max(self._all_gather(max([m.record.boundary for m in donors] or [-1])))
            if told > target and not chased and target >= 0:
                # a donor said where it is (its signed STATE_GONE): it serves that boundary (or the records' newer
                # one) at once; one more (`ahead`) waited out a whole round of the donors' for nothing (5 s of a
                # restart beside 5 busy peers). Once only: donors faster than downloads are asked ahead after.
                newest, ahead, chased = max(told, newest), 0, True
            elif told > newest:
                newest, ahead = told, 0
            if newest < boundary:  # no donor there yet, or the others' records do not show it yet
                if any(self._all_gather(time.monotonic() < patience)):  # alike on every stage of this peer
                    time.sleep(DONOR_POLL_S)
                else:
                    attempt += 1
                continue
            attempt += 1
            target = min(newest + ahead, self.rounds)
            if result is None or result.boundary != target:
                result = self.swarm.agreement.fetch_state(target, self._donor_order(donors, newest))
            got = self._all_gather(result.boundary if result is not None else -1)
            # donors that train faster than this peer asks (rounds of a second without it) moved past the
            # newest boundary they announced before a stage's request reached them: ask for the next one,
            # which a donor serves when it gets there, instead of chasing them to the end of the run
            ahead = 0 if all(g == target for g in got) else 1
            if not ahead:
                assert result is not None
                # a state the donors left behind while it downloaded puts this peer a round behind them, where
                # its exchanges find nobody: take the newer one, once (downloads slower than rounds never catch up)
                moved_on = not rechecked and self.swarm.membership.refresh() and any(
                    m.record.boundary > target for m in self.swarm.membership.donors()
                )
                rechecked, newer = True, any(self._all_gather(moved_on))
                if not newer:
                    self._install(result, reason=reason, was=boundary)
                    return target
        if self.lead:
            logger.warning("could not take the swarm's state after %d attempts; training on from round %d",
                           RESYNC_ATTEMPTS, boundary)
        return None

    def _donor_order(self, donors: list[Member], target: int) -> list[str]:
        """Donors holding the majority hash of their boundary first, the most advanced first."""
        try:
            records = self.swarm.records.round_records(target)
        except Exception as e:
            self.swarm.faults.count("lookups_failed", "round records of %d could not be read: %r", target, e)
            records = {}
        hashes = {p: r.state_hash for p, r in records.items() if p != self.swarm.peer_id}
        winner = majority_hash(hashes, self.swarm.records.rank)
        ranked = sorted(donors, key=lambda m: (hashes.get(m.peer_id, winner) != winner, -m.record.boundary))
        return [m.peer_id for m in ranked]

    def _install(self, download: StateDownload, *, reason: str, was: int) -> None:
        assert download.state is not None
        self.swarm.exchanges.abandon_before(download.boundary)
        self.swarm.agreement.forget()
        self.swarm.membership.forgive()  # its own failures, not the others' (a frozen peer suspects everyone)
        follows: Future[Average] | None = None
        if download.state.follows >= 0:  # it trains while the average in flight at the donor arrives
            follows = Future()
            donors = [m.peer_id for m in self.swarm.membership.donors()]
            threading.Thread(target=self._take_pending, args=(download, donors, follows), name="pending",
                             daemon=True).start()  # fmt: skip
        self.outer.load_state(download.state, follows)
        for codec in self.swarm.codecs:
            codec.reset()  # its error feedback was measured against a state it left
        self.swarm.set_state(download.boundary, ready=False, training=True, taken=True)
        apart = f"; the average of round {download.state.follows} follows" if follows is not None else ""
        for donor, size in download.bytes_by_donor.items():
            self._state_donors[donor] = self._state_donors.get(donor, 0) + size
        self.swarm.deadlines.downloaded(download.seconds)  # the next downloads' deadline learns from it (deadlines.py)
        served = ", ".join(f"{d[-6:]} {gib(n)}" for d, n in sorted(download.bytes_by_donor.items()))
        self.swarm.faults.count(reason, "took the state of round %d from %d donor(s) in %.2f s (%s; hash %s; this worker "
                                "was at round %d%s)", download.boundary, len(download.bytes_by_donor), download.seconds,
                                served, download.state_hash[:12], was, apart)  # fmt: skip
        self._publish(download.boundary)

    def _take_pending(self, taken: StateDownload, donors: list[str], follows: Future[Average]) -> None:
        """Resolve `follows` with the average the state taken left out (Agreement.fetch_pending), whatever happens."""
        try:
            average = self.swarm.agreement.fetch_pending(taken, donors, self._stop.is_set)
        except Exception as e:  # the averager stopped with the worker, or a bug: never leave the boundary waiting
            note = f"the average of round {taken.state.follows if taken.state else -1} could not be taken: {e!r}"
            logger.warning("%s", note)
            average = applies_nothing(AverageKind.STRANDED, note, 0.0)
        follows.set_result(average)

    def _resync_aside(self, boundary: int, *, reason: str) -> int | None:
        """`_resync`, out of the stage's groups meanwhile (nobody should wait for a worker that resyncs);
        back in them if it failed."""
        self.swarm.set_state(boundary, ready=False, training=False)
        # the others may still be in the round's exchange (a stranded worker's partners): they reach the boundary
        # within its deadlines
        deadlines = self.swarm.deadlines
        new = self._resync(boundary, reason=reason, patience_s=deadlines.allreduce + deadlines.chunk)
        if new is None:
            self.swarm.set_state(boundary, ready=False, training=True)
        return new
