"""Who trains a stage: the member records of its workers, refreshed in the background.

Each worker heartbeats a `MemberRecord` (dht.py). A round's target group size is the
number of live training members, so a group forms as soon as all of them are in, and a
fast peer waits at most `round_wait` for a slow one. A member that failed in an
all-reduce is *suspected*: not expected in the next groups until it heartbeats again, or until a
new life of it (restarted: a later `joined_at`) publishes a record.
Admission: the oldest live member's config hash defines the run; member records are signed
(dht.py), so only admitted keys are members at all, and only members vote on hashes.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from typing import Any

from hivemind.utils import get_dht_time

from ..errors import AdmissionError
from ..wire import protocol_version
from .dht import HEARTBEAT_S, MEMBER_TTL_S, Member, RunRecords
from .faults import FaultCounter
from .member_push import take_pushed
from .stall import StallWatch

__all__ = ["STALL_GRACE_S", "Membership", "Suspicion", "config_diff", "suspected"]

logger = logging.getLogger(__name__)

POLL_S = 0.5  # without pushes (member_push.py), a wait looks the records up again this often
# With pushes, every member's record comes here whenever it changes and at every heartbeat, and the DHT is read
# for what a lost push or an unknown worker leaves out: every REFRESH_S in the background, and by a wait for the
# others to start a round once it lasted LOOK_S. Each read asks every DHT node for every member's record (N
# records from each of up to N nodes): 8 `tiny` peers read them 5 times a member and round at 0.5 s polls and
# 5 s refreshes, 219 of the 342 kB each member's DHT node answered per round.
LOOK_S = 2.0
REFRESH_S = 3 * HEARTBEAT_S
PROBE_AFTER_S = 1.0  # members still not at a round after this long are probed once: gone ones are not waited for
STALL_GRACE_S = MEMBER_TTL_S  # after a stall (stall.py): a live member re-published and pushed its record by then
BARRIER_POLL_S = 0.25  # the start barrier is looked at more often: every peer of the quorum waits on it


def config_diff(ours: str, theirs: str) -> list[str]:
    """`section.key: A here, B in the run` for every shared field that differs."""
    a, b = json.loads(ours), json.loads(theirs)
    diffs = []
    for section in sorted(set(a) | set(b)):
        for key in sorted(set(a.get(section, {})) | set(b.get(section, {}))):
            mine, other = a.get(section, {}).get(key), b.get(section, {}).get(key)
            if mine != other:
                diffs.append(f"{section}.{key}: {mine!r} here, {other!r} in the run")
    return diffs


@dataclass(frozen=True)
class Suspicion:
    """A member failed in the all-reduce of `round` (-1: unknown) at DHT time `at`, in the life that joined at
    `joined_at` (None: unknown)."""

    at: float
    joined_at: float | None
    round: int = -1


def suspected(member: Member, suspicion: Suspicion | None) -> bool:
    """Whether `member` is still left out of groups for a failure: until it heartbeats again after it (a record
    that expires a heartbeat later than one published at the failure), until it began a later round's exchange
    (its record says so: it is alive, and past the round it failed in), or until a new life of it publishes a
    record. A peer restarted at once (a supervisor, --resume) kept the same key and would otherwise have been
    left out for up to a heartbeat: several rounds of `tiny`, in which it only borrowed the others' average. So
    was a member that lost one group by a fault of the network (a leader's answer lost: matchmaking.py): left
    out, it came late to each next group and borrowed again, 3 rounds running (CI run 177)."""
    if suspicion is None:
        return False
    if suspicion.joined_at is not None and member.record.joined_at != suspicion.joined_at:
        return False  # another life: the failure was its predecessor's
    if 0 <= suspicion.round < member.record.averaging_round:
        return False
    return member.expiration < suspicion.at + MEMBER_TTL_S + HEARTBEAT_S


class Membership:
    """This stage's live members, as of the last refresh (every HEARTBEAT_S seconds, or on demand)."""

    def __init__(self, records: RunRecords, *, config_hash: str, faults: FaultCounter):
        self.records, self.config_hash, self.faults = records, config_hash, faults
        self.peer_id = records.peer_id
        self._lock = threading.Lock()
        self._members: list[Member] = []
        self._suspects: dict[str, Suspicion] = {}  # peer id -> when it failed in an all-reduce, in which life
        self._gone: dict[str, float] = {}  # peer id -> joined_at of the life found gone (drop_gone); a restart is a new one
        self._refused: set[str] = set()
        self.refused_here = False  # this worker was refused at admission (check_admission): its leave record lingers
        self._banned: set[str] = set()
        self._banned_keys: set[bytes] = set()  # peer keys banned with a worker of theirs: all their workers are
        self._pushed: dict[str, Member] = {}  # the latest record each member pushed (member_push.py)
        self.pushed: Any = None  # the queue of pushed records (DilocoxAverager.pushed_records); None: polls only
        self._looked = self._tried = float("-inf")  # time.monotonic() of the last lookup that succeeded, and tried
        self._looked_dht = float("-inf")  # DHT time at which the last lookup that succeeded began (`_live`)
        self._news = threading.Condition(self._lock)  # notified when a push or a lookup changed the view
        self._generation = 0  # how many times a push or a lookup changed the view
        self._closed = threading.Event()
        self.stalls = StallWatch()  # a lookup right after this process was stopped is not taken at its word (refresh)
        self.stalls.on_stall = lambda _seconds: self.forgive()  # nor the failures its own stop caused (suspect)
        self._threads = [threading.Thread(target=self._watch, name="members", daemon=True),
                         threading.Thread(target=self._take_pushes_loop, name="member-pushes", daemon=True)]
        # which of some peers are gone (their p2p daemon refuses connections): reconnect.RouteKeeper.gone
        self.prober: Callable[[list[str]], list[str]] | None = None

    def start(self) -> None:
        self.refresh()
        self.stalls.start()
        for thread in self._threads:
            thread.start()

    def close(self) -> None:
        self._closed.set()
        self.stalls.close()
        for thread in self._threads:
            if thread.is_alive():
                thread.join(timeout=HEARTBEAT_S + 5)

    def _watch(self) -> None:
        """Look the records up now and then (`_until_look`, asked again at least every 0.5 s: pushes move it)."""
        while not self._closed.is_set():
            wait = self._until_look()
            if wait <= 0:
                self.refresh()
            else:
                self._closed.wait(min(wait, 0.5))

    def _take_pushes_loop(self) -> None:
        """Take each pushed record as it comes, in a thread of its own: a lookup that meets a frozen DHT node
        takes seconds, and pushes taken behind it would reach the waits that late."""
        while not self._closed.is_set() and self.pushed is not None:
            try:
                self._take_pushes(0.5)
            except Exception as e:  # the view must go on: a broken push queue leaves the DHT reads
                logger.warning("the member view's push thread: %r", e)
                self.pushed = None

    def _until_look(self) -> float:
        """Seconds until the background looks the records up again: a heartbeat after the last lookup, or with
        pushes and other members REFRESH_S after it, and a second before a member's record expires (its pushes may
        be lost while the DHT holds a newer one), but never within a second of the last try."""
        now = time.monotonic()
        if self.pushed is None:
            return max(self._looked + HEARTBEAT_S - now, self._tried + 1.0 - now, 0.0)
        with self._lock:
            expiring = [m.expiration for m in self._members if m.peer_id != self.peer_id]
        due = self._looked + HEARTBEAT_S  # alone: nobody pushes here yet (a joiner, a refused stranger are read)
        if expiring:
            due = min(self._looked + REFRESH_S, now + min(expiring) - get_dht_time() - 1.0)
        return max(due - now, self._tried + 1.0 - now, 0.0)

    def _take_pushes(self, timeout: float) -> None:
        """Put the records members pushed (waiting up to `timeout` for one) into the view, and wake the waits."""
        opened = [self.records.open_member(*item) for item in take_pushed(self.pushed, timeout)]
        news = [m for m in opened if m is not None and m.peer_id != self.peer_id]
        if not news:
            return
        with self._lock:
            for m in news:
                if m.peer_id not in self._pushed or m.sent_at > self._pushed[m.peer_id].sent_at:
                    self._pushed[m.peer_id] = m
            self._members = self._with_pushed(self._members)
            self._generation += 1
            self._news.notify_all()
        self._refuse_other_configs(news)

    def refresh(self) -> bool:
        """Look the members up again; False (counted) if the lookup failed."""
        self._tried, began = time.monotonic(), get_dht_time()
        try:
            members = self.records.members()
        except Exception as e:
            if not self._closed.is_set():
                self.faults.count("lookups_failed", "member lookup of stage %d failed: %r", self.records.stage, e)
            return False
        if self._lost_everyone_after_stall(members):
            return False
        with self._lock:
            self._members = members = self._with_pushed(members)
            self._looked, self._looked_dht = time.monotonic(), began
            self._generation += 1
            self._news.notify_all()
        self._refuse_other_configs(members)
        return True

    def _lost_everyone_after_stall(self, found: list[Member]) -> bool:
        """Whether a lookup that `found` these records, made soon after this process was stopped (stall.py), lost
        every other member this worker knew to train: not taken as their departure (counted as a failed lookup;
        the view stays) until STALL_GRACE_S after the stall, by when a live member has re-published and pushed
        its record. A worker whose members really left goes on alone that much later."""
        since = self.stalls.since_stall()
        if since >= STALL_GRACE_S or any(m.peer_id != self.peer_id for m in found):
            return False
        with self._lock:
            known = sum(m.peer_id != self.peer_id and m.record.training for m in self._members)
        if known:
            self.faults.count("lookups_failed", "member lookup of stage %d found none of the %d other members this "
                              "worker knew, %.1f s after this process was stopped: not taken as their departure",
                              self.records.stage, known, since)  # fmt: skip
        return bool(known)

    def _refuse_other_configs(self, members: list[Member]) -> None:
        """Say once per worker that one of `members` (read or pushed) has another config hash: it is no member."""
        for m in members:
            if m.record.config_hash != self.config_hash and m.peer_id not in self._refused:
                self._refused.add(m.peer_id)
                logger.warning(
                    "refusing %s (peer %s): its config hash %s differs from this run's %s",
                    m.peer_id, m.record.peer_name, m.record.config_hash[:12], self.config_hash[:12],
                )

    def _with_pushed(self, members: list[Member]) -> list[Member]:
        """`members` as read from the DHT, each replaced by the copy its worker pushed where that one is newer (a
        DHT node may not hold the latest yet); pushed records of workers the DHT did not return are kept until
        they expire (the caller holds the lock)."""
        now = get_dht_time()
        self._pushed = {p: m for p, m in self._pushed.items() if m.expiration > now}
        merged = {m.peer_id: m for m in members}
        for peer_id, m in self._pushed.items():
            if peer_id not in merged or m.sent_at > merged[peer_id].sent_at:
                merged[peer_id] = m
        return list(merged.values())

    def _wait_for_news(self, timeout: float, seen: int) -> None:
        """Wait up to `timeout` for a member's pushed record to change the view (member_push.py) since it was
        `seen` (the `_generation` read before the view); without pushes, sleep."""
        if self.pushed is None:
            time.sleep(timeout)
            return
        with self._news:
            self._news.wait_for(lambda: self._generation != seen, timeout)

    def _look_if_older(self, poll: float) -> None:
        """Read the stage's records from the DHT if the last read is `poll` old. The start barrier reads them every
        BARRIER_POLL_S with pushes too: a worker pushes to the members it knows, and those that came to the
        barrier after it do not push to it until their record changes again (1 s between reads made every
        3-peer test 2 s longer)."""
        if time.monotonic() - self._looked >= poll:
            self.refresh()

    def members(self, *, training_only: bool = False, others_only: bool = True, suspects_too: bool = False) -> list[Member]:
        """Live members of this stage with this run's config (from the last refresh and the pushes since; a record
        that expired before the last lookup is left out: `_live`), suspects left out unless `suspects_too` (a
        suspect is not grouped with, but its state still counts: agreement.py)."""
        with self._lock:
            members = list(self._members)
            suspects, banned, gone = dict(self._suspects), set(self._banned), dict(self._gone)
        now = get_dht_time()
        return [
            m
            for m in self._one_per_key(members, now)
            if gone.get(m.peer_id) != m.record.joined_at  # not the record of a life found gone
            and (m.record.training or not training_only)
            and (m.peer_id != self.peer_id or not others_only)
            and m.peer_id not in banned
            and (suspects_too or not suspected(m, suspects.get(m.peer_id)))
        ]

    def _one_per_key(self, members: list[Member], now: float) -> list[Member]:
        """The live members with this run's config and no banned key, one per peer key (one key, one group slot and
        one vote, however many workers it certifies for this stage): this worker itself, else the newest life
        (latest joined_at, then the smallest worker id: a peer restarted with a new worker key replaces its old one)."""
        with self._lock:
            banned_keys = set(self._banned_keys)

        def key(m: Member) -> bytes:
            return m.peer_key or m.peer_id.encode()  # a record read before its key was known stands for itself

        def rank(m: Member) -> tuple[bool, float, str]:
            return m.peer_id != self.peer_id, -m.record.joined_at, m.peer_id

        chosen: dict[bytes, Member] = {}
        for m in members:
            if m.record.config_hash == self.config_hash and self._live(m, now) and m.peer_key not in banned_keys:
                if key(m) not in chosen or rank(m) < rank(chosen[key(m)]):
                    chosen[key(m)] = m
        return [m for m in members if chosen.get(key(m)) is m]

    def _live(self, member: Member, now: float) -> bool:
        """Whether `member`'s record still counts at DHT time `now`: unexpired, this worker's own, or expired since
        the last lookup (only a lookup after its expiration says the member is gone: a worker frozen past every
        record's expiration found itself alone on waking, before its view was read again, and trained two rounds
        alone: churn soak, CI)."""
        return member.expiration > now or member.peer_id == self.peer_id or member.expiration > self._looked_dht

    def ban(self, peer_ids: list[str], keys: list[bytes] = ()) -> None:
        """Peers banned for the run (stage.strike): never members again, nor any worker their peer `keys` certify."""
        with self._lock:
            self._banned.update(peer_ids)
            self._banned_keys.update(keys)

    def banned(self) -> set[str]:
        with self._lock:
            return set(self._banned)

    def banned_keys(self) -> set[bytes]:
        with self._lock:
            return set(self._banned_keys)

    def voters(self) -> set[str]:
        """Workers whose round records count (agreement.py): live members with this run's config, this one
        included. A validly signed record of a key that is no member (a third party) has no vote."""
        now = get_dht_time()
        with self._lock:
            members = list(self._members)
        voters = {m.peer_id for m in self._one_per_key(members, now)}
        with self._lock:
            return (voters - self._banned) | {self.peer_id}

    def suspect(self, peer_ids: list[str], round: int = -1) -> None:
        """Peers that failed in the all-reduce of `round`: not expected in the next groups until they heartbeat again
        or begin a later round's (`suspected`). Not within STALL_GRACE_S of this process being stopped (stall.py):
        its own timers ran out, not their parts."""
        if self.stalls.since_stall() < STALL_GRACE_S:
            return
        now = get_dht_time()
        with self._lock:
            lives = self._lives()
            for peer_id in peer_ids:
                self._suspects[peer_id] = Suspicion(now, lives.get(peer_id), round)

    def _lives(self) -> dict[str, float]:
        """Each member's `joined_at` as of the last refresh: which life of it a suspicion or a probe is about
        (the caller holds the lock)."""
        return {m.peer_id: m.record.joined_at for m in self._members}

    def drop_gone(self, peer_ids: list[str], round: int) -> list[str]:
        """Probe `peer_ids` (members this worker waits for); the ones that are gone are no members any more (until
        a new life of theirs publishes a record), and are returned. A peer killed with SIGKILL leaves a live member
        record behind, and the others waited for it: to start a round, in matchmaking, for its final state
        (reconnect.py)."""
        gone = self.prober(peer_ids) if self.prober is not None and peer_ids else []
        if gone:
            logger.info("round %d: %s gone (nothing listens at their addresses): not waited for", round,
                        ", ".join(p[-8:] for p in gone))  # fmt: skip
            with self._lock:
                lives = self._lives()
                self._gone.update((peer_id, lives[peer_id]) for peer_id in gone if peer_id in lives)
        return gone

    def forgive(self) -> None:
        """Drop every suspicion: this worker was the one behind (frozen, or on a stale state), so the
        failures it saw in the rounds it dropped say nothing about the others."""
        with self._lock:
            self._suspects.clear()

    def donors(self, boundary: int | None = None) -> list[Member]:
        """Training members that hold (or will soon hold) `boundary`, most advanced first; of as advanced ones, client
        members last (one answers only where it opened a connection to the asker: swarm/client_member.py)."""
        members = [m for m in self.members(training_only=True) if boundary is None or m.record.boundary <= boundary]
        return sorted(members, key=lambda m: (-m.record.boundary, not m.record.state_ready, m.record.client,
                                              m.record.joined_at))  # fmt: skip

    @staticmethod
    def sits_out(member: Member, round: int) -> bool:
        """The member has nothing to send in round `round` (a non-finite pseudo-gradient): it takes the group's
        average instead, and nobody waits for it (MemberRecord.sitting_out)."""
        return member.record.sitting_out == round + 1

    @classmethod
    def takes_part(cls, member: Member, round: int) -> bool:
        """The member sends its pseudo-gradient in round `round`'s all-reduce: it trained the round (one that took
        a later state, MemberRecord.first_round, trains on while the others exchange it) and does not sit it out."""
        return member.record.first_round <= round and not cls.sits_out(member, round)

    @staticmethod
    def finished(member: Member, round: int) -> bool:
        """The member's record shows it completed round `round`'s all-reduce."""
        b = member.record.boundary
        return b > round + 1 or (b == round + 1 and member.record.state_ready)

    # ----- waiting ---------------------------------------------------------------------------
    def wait_for_round(self, round: int, timeout: float, *, give_up: Callable[[], bool]) -> list[Member]:
        """Wait (at most `timeout`, woken at once by a record a member pushed; a lookup once the wait lasted LOOK_S,
        and every LOOK_S after, or without pushes every POLL_S) until every live training member of the stage
        that takes part in this round's all-reduce has started it; return those members.

        A member takes part if it started the round before (it trains this round or waits for that exchange:
        its record's averaging_round) or holds this round's boundary (it took the swarm's state there), and
        trained the round at all: one that took a later state (its first_round) trains on while the others
        still exchange this round, and never comes (they waited round_wait for it). One
        still training an earlier round (a joiner a round behind, a peer catching up) would come a round late
        or never: waiting for it cost the others round_wait at every round it stayed behind. One that jumped
        past the round (took a later state) never comes.

        Matchmaking then finds everyone at once. Entering hivemind's matchmaking early instead
        makes it poll the DHT in a tight loop for as long as the slowest peer needs (measured:
        most of a CPU core on a 2-core machine while a peer is one round behind).
        """
        started = time.monotonic()
        deadline, probed, said_sitting = started + timeout, False, False
        while True:
            seen = self._generation
            if self._look_due(started):
                self.refresh()
            training = self.members(training_only=True)
            sitting = [m.peer_id for m in training if self.sits_out(m, round)]
            if sitting and not said_sitting:
                said_sitting = True
                logger.info("round %d: %s sit(s) it out (nothing to send): not waited for", round,
                            ", ".join(p[-8:] for p in sitting))  # fmt: skip
            coming = [m for m in training if self.takes_part(m, round)
                      and (m.record.averaging_round >= round - 1 or m.record.boundary == round)]  # fmt: skip
            late = [m.peer_id for m in coming if m.record.averaging_round < round]
            if not late or time.monotonic() >= deadline or give_up():
                return coming
            if not probed and time.monotonic() - started >= PROBE_AFTER_S:
                probed = True
                if self.drop_gone(late, round):
                    continue
            self._wait_for_news(min(POLL_S, max(deadline - time.monotonic(), 0.0)), seen)

    def _look_due(self, waiting_since: float) -> bool:
        """Whether a wait that began at `waiting_since` (time.monotonic()) reads the records from the DHT now."""
        now = time.monotonic()
        if self.pushed is None:
            return now - self._looked >= POLL_S
        return now - waiting_since >= LOOK_S and now - self._looked >= LOOK_S

    def wait_for_peers(self, count: int, timeout: float, *, give_up: Callable[[], bool] = lambda: False) -> list[str]:
        """Wait until `count` workers of this stage (this one included) are at the start barrier (their record
        names the boundary they will start from) or train; return them."""
        deadline = time.monotonic() + timeout
        last_log = 0.0
        while True:
            seen = self._generation
            self._look_if_older(BARRIER_POLL_S)
            self.refuse_another_release()  # the run may start training while this peer waits
            here = [m.peer_id for m in self.members(others_only=False) if m.record.training or m.record.boundary >= 0]
            if len(here) >= count or time.monotonic() >= deadline or give_up():
                return here
            if time.monotonic() - last_log > 10:
                logger.info("waiting for peers: %d of %d workers of stage %d are here", len(here), count, self.records.stage)
                last_log = time.monotonic()
            self._wait_for_news(BARRIER_POLL_S, seen)

    def wait_until_training(
        self, peer_ids: Collection[str], timeout: float, *, give_up: Callable[[], bool] = lambda: False
    ) -> None:
        """Wait until each of `peer_ids` trains or left the run (at most `timeout`): the second half of the start
        barrier. Peers that met at the barrier then start their first round together, instead of the first to
        see the quorum training a round before the last one looks, which then had to take the state of a run
        that had moved on."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and not give_up():
            seen = self._generation
            self._look_if_older(BARRIER_POLL_S)
            live = {m.peer_id: m for m in self.members(others_only=False)}
            if all(p not in live or live[p].record.training for p in peer_ids):
                return
            self._wait_for_news(BARRIER_POLL_S, seen)

    # ----- admission ---------------------------------------------------------------------------
    def refuse_another_release(self) -> None:
        """Raise AdmissionError if the run is another release's: no worker of this protocol is here, and
        workers of another one (by their own, unverified word) joined before this one and train."""
        with self._lock:
            ours = [m for m in self._members if m.peer_id != self.peer_id]
            mine = next((m.record.joined_at for m in self._members if m.peer_id == self.peer_id), get_dht_time())
        foreign = {p: f for p, f in self.records.foreign.items() if f[2] and f[1] < mine}
        if not ours and foreign:
            versions = ", ".join(sorted({str(v) for v, _, _ in foreign.values()}))
            raise AdmissionError(
                f"run {self.records.run_id!r} speaks wire protocol version {versions} ({len(foreign)} workers), this "
                f"peer speaks {protocol_version()}: run the same dilocox-p2p release as the run's other peers"
            )

    def check_admission(self, run_id: str, shared_json: str) -> None:
        """Refuse to join a run whose oldest live member has another config hash."""
        self.refresh()
        self.refuse_another_release()
        with self._lock:
            others = [m for m in self._members if m.peer_id != self.peer_id and m.record.training]
        if not others:
            return
        oldest = min(others, key=lambda m: (m.record.joined_at, m.peer_id))
        if oldest.record.config_hash == self.config_hash:
            return
        try:
            theirs = self.records.config(oldest.record.config_hash)
        except Exception as e:
            self.faults.count("lookups_failed", "the run's config record could not be read: %r", e)
            theirs = None
        diffs = config_diff(shared_json, theirs) if theirs else []
        self.refused_here = True
        detail = "; ".join(diffs) if diffs else "compare `dilocox-peer config show` on both peers"
        raise AdmissionError(
            f"run {run_id!r} trains with config hash {oldest.record.config_hash[:12]} "
            f"(peer {oldest.record.peer_name}), this peer has {self.config_hash[:12]}: {detail}"
        )
