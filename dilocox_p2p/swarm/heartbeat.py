"""A stage worker's member record, re-published every few seconds (a heartbeat) and pushed when it changes.

The record (swarm.proto MemberRecord) says whether the worker trains, which round's all-reduce it has
started and where its state is; it lives in the DHT for MEMBER_TTL_S (dht.py), so a worker that stops
beating drops out of the others' view (membership.py). A record that changed is also handed to
`on_change` at once, which pushes it straight to the stage's other members (member_push.py), however
long the store takes, and so is every beat's record: the others' views of the stage stay fresh from the pushes
alone, and they read the DHT rarely (membership.py).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Any

from hivemind.utils import get_dht_time

from .. import injection
from ..wire import swarm_pb2
from .dht import HEARTBEAT_S, MEMBER_TTL_S, RunRecords

__all__ = ["Heartbeat"]

logger = logging.getLogger(__name__)
LEAVE_TTL_S = 1.0  # a leaving worker's last record, where none was stored before it, expires this soon (stop)
SLOW_FIRST_BEAT_S = 30.0  # fault injection (slow_first_beat): how long the first store waits, unless the worker stops


class Heartbeat:
    """Re-publishes this worker's MemberRecord every HEARTBEAT_S seconds in a thread; a record that changed is also
    handed at once to `on_change` (sealed, with its expiration), which pushes it to the stage's other members.

    The push never waits for a store: a store that meets an unresponsive DHT node (a frozen peer's) takes 6 s
    (hivemind's wait_timeout, twice), again whenever its blacklist lapses (5 s, then 10, ...). Pushed after the
    store, the record of the round a worker had started reached the others seconds late all the while a third
    peer was frozen: they never counted it in, and it borrowed their average round after round instead of
    averaging with them (busy-core run of 29ae5fa, test_elastic)."""

    def __init__(self, records: RunRecords, record: swarm_pb2.MemberRecord):
        self.records = records
        self._record = record
        self.on_change: Callable[[bytes, float], None] | None = None
        self._told = b""  # the record last handed to on_change
        self._lock = threading.Lock()
        self._beating = threading.Lock()  # one beat at a time: an older beat never lands after a newer one
        self._telling = threading.Lock()  # one push at a time, the newest record last
        self._stop = threading.Event()
        self._now = threading.Event()  # publish at once
        self._changed = threading.Event()  # push at once
        self._renew = threading.Event()  # push at once even if unchanged: a quiet beat renews the record's expiration
        self._first: Callable[[], None] | None = None
        self._threads = [
            threading.Thread(target=self._loop, name="heartbeat", daemon=True),
            threading.Thread(target=self._tell_loop, name="member-push", daemon=True),
        ]

    def start(self, *, first: Callable[[], None] | None = None) -> None:
        """Start beating, the first beat at once, in the thread: a stage's start does not wait for the stores (a few
        round trips each on the internet). `first` runs there before the first beat: a store others must find
        once they see this worker (the run's config record, read by a peer that this one refuses)."""
        self._first = first
        self._now.set()
        self._changed.set()
        for thread in self._threads:
            thread.start()

    def update(self, *, wait: bool = True, **fields: Any) -> None:
        """Change fields of the record, push it to the others and publish it (both in the threads unless `wait`)."""
        with self._lock:
            for name, value in fields.items():
                setattr(self._record, name, value)
        if wait:
            self._tell()
            self.beat()
        else:
            self._changed.set()
            self._now.set()

    def push_now(self) -> None:
        """Push the record again at once (in the thread), changed or not: to members just found, or to renew its
        expiration in the others' views."""
        self._renew.set()
        self._changed.set()

    def beat(self) -> None:
        with self._beating:
            self.records.publish_member(self._copy())  # a failure is counted there

    def _copy(self) -> swarm_pb2.MemberRecord:
        with self._lock:
            record = swarm_pb2.MemberRecord()
            record.CopyFrom(self._record)
        return record

    def _tell(self, *, renew: bool = False) -> None:
        """Hand the record to `on_change` if it changed since the last time, or with `renew` (a beat) anyway,
        sealed as the DHT stores it."""
        with self._telling:
            record = self._copy()
            body = record.SerializeToString(deterministic=True)
            if self.on_change is None or (body == self._told and not renew):
                return
            self._told = body
            try:
                self.on_change(self.records.seal_member(record), get_dht_time() + MEMBER_TTL_S)
            except Exception as e:  # the DHT holds the record: the others read it there
                logger.debug("could not push the member record: %r", e)

    def _tell_loop(self) -> None:
        while not self._stop.is_set():
            self._changed.wait()
            self._changed.clear()
            renew = self._renew.is_set()
            self._renew.clear()
            if not self._stop.is_set():
                self._tell(renew=renew)

    def _loop(self) -> None:
        if injection.armed("slow_first_beat", stage=self.records.stage):
            self._stop.wait(SLOW_FIRST_BEAT_S)
        if self._first is not None and not self._stop.is_set():
            try:
                self._first()
            except Exception as e:  # the beats matter more: they go on
                logger.warning("a store before the first heartbeat failed: %r", e)
        while not self._stop.is_set():
            stored_now = self._now.wait(HEARTBEAT_S)
            self._now.clear()
            if not self._stop.is_set():
                self.beat()
            if not stored_now:  # a change was pushed as it came; a quiet beat renews the pushed record
                self.push_now()

    def stop(self, *, leave: bool = True, linger: bool = False) -> None:
        """Stop beating; with `leave`, tell the others this worker no longer trains, in a record that expires just
        after the last one stored, or LEAVE_TTL_S from now if none was. With `linger`, the leaving record lives
        MEMBER_TTL_S from now: a worker refused at admission leaves it for the run's members to read and log the
        refusal (its first heartbeat may not have been stored when its refusal came: on a loaded box its lookup of
        the run can beat the heartbeat thread's two stores; then a record of LEAVE_TTL_S was gone before the others
        read the stage's records, and nobody in the run learnt that a peer with another config had tried)."""
        self._stop.set()
        self._now.set()
        self._changed.set()
        for thread in self._threads:
            if thread.is_alive():
                thread.join(timeout=5)
        if leave:
            with self._lock:
                self._record.training = False
                self._record.state_ready = False
            self._tell()
            self.records.publish_member(self._copy(), ttl=MEMBER_TTL_S if linger else LEAVE_TTL_S, leaving=True)
