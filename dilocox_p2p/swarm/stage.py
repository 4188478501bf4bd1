"""A stage worker's membership in the swarm: its DHT node, averager and round bookkeeping.

`SwarmStage` is the `Averager` the outer loop talks to (one background all-reduce per
round, run one at a time in a worker thread) and the stage's view of the run:

- admission: the oldest live member's config hash defines the run; a peer with another
  hash is refused, and told which fields differ;
- membership: a heartbeat record per worker; the round's target group size is the number
  of live training workers of the stage, so a group forms as soon as all are in and a
  fast peer waits at most `round_wait` for a slow one;
- state: the worker's state at its current round boundary is served to joiners;
- repair: after each boundary the worker compares its theta_g hash with the others'
  records; one in the minority downloads the majority's state at its next boundary.
"""

from __future__ import annotations

import json
import logging
import queue
import threading
import time
from collections import Counter
from collections.abc import Sequence
from concurrent.futures import Future, TimeoutError
from pathlib import Path
from typing import Any

import torch
from hivemind.averaging.control import AveragingStage
from hivemind.utils import get_dht_time

from ..config import Config, config_hash, shared_fields
from ..errors import AdmissionError
from ..outer import AveragingResult, state_hash
from ..wire import swarm_pb2
from .averager import DilocoxAverager, StateDownload
from .dht import HEARTBEAT_S, MEMBER_TTL_S, Heartbeat, Member, RunRecords, reachable_maddrs, start_dht

__all__ = ["SwarmStage"]

logger = logging.getLogger(__name__)


def config_diff(ours: str, theirs: str) -> list[str]:
    a, b = json.loads(ours), json.loads(theirs)
    diffs = []
    for section in sorted(set(a) | set(b)):
        for key in sorted(set(a.get(section, {})) | set(b.get(section, {}))):
            mine, other = a.get(section, {}).get(key), b.get(section, {}).get(key)
            if mine != other:
                diffs.append(f"{section}.{key}: {mine!r} here, {other!r} in the run")
    return diffs


def majority_hash(hashes: dict[str, str]) -> str | None:
    """The hash most workers hold; ties go to the smallest hash, so every peer picks the same."""
    if not hashes:
        return None
    counts = Counter(hashes.values())
    return min(counts, key=lambda h: (-counts[h], h))


class SwarmStage:
    """One stage worker's DHT node + averager, and the Averager the outer loop uses."""

    def __init__(
        self,
        cfg: Config,
        *,
        stage: int,
        tensors: Sequence[torch.Tensor],
        run_dir: Path,
        peer_name: str,
        extra_peers: Sequence[str] = (),
    ):
        self.cfg, self.stage, self.sw = cfg, stage, cfg.swarm
        self.config_hash = config_hash(cfg)
        self.shared_json = json.dumps(shared_fields(cfg), sort_keys=True)
        self.dht = start_dht(
            cfg.swarm, stage=stage, identity_path=run_dir / "identity" / f"stage{stage}.key", extra_peers=extra_peers
        )
        self.peer_id = self.dht.peer_id.to_base58()
        self.records = RunRecords(self.dht, cfg.run.run_id, stage)
        self.averager = DilocoxAverager(
            [t.detach().to("cpu", torch.float32, copy=True) for t in tensors],
            self.dht,
            run_id=cfg.run.run_id,
            config_hash=self.config_hash,
            stage=stage,
            nice=max(self.sw.helper_nice, 0),
            prefix=f"{cfg.run.run_id}_{self.config_hash[:16]}_s{stage}",
            start=True,
            min_group_size=self.sw.min_group_size,
            min_matchmaking_time=self.sw.round_wait,
            request_timeout=min(5.0, self.sw.round_wait / 2),
            allreduce_timeout=self.sw.allreduce_timeout,
            next_chunk_timeout=self.sw.chunk_timeout,
            allow_state_sharing=False,  # hivemind's own state sharing; ours is rpc_download_round
        )
        self.joined_at = get_dht_time()
        self.heartbeat = Heartbeat(
            self.records,
            swarm_pb2.MemberRecord(
                run_id=cfg.run.run_id,
                config_hash=self.config_hash,
                stage=stage,
                boundary=-1,
                joined_at=self.joined_at,
                peer_name=peer_name,
            ),
        )
        self._members: list[Member] = []
        self._warned_about: set[str] = set()
        self._suspects: dict[str, float] = {}  # peer id -> DHT time it failed in an all-reduce
        self._running: tuple[int, Any] | None = None  # (round, hivemind StepControl) of the all-reduce in flight
        self._abandon_below = -1  # all-reduces of earlier rounds are abandoned (this peer caught up)
        self._published: tuple[int, str] | None = None  # the last boundary hash published (checked one round later)
        self._epoch = 0  # bumped when the state is replaced; checks of older states are void
        self._jobs: queue.Queue = queue.Queue()
        self._closed = threading.Event()
        self._repair: tuple[int, str, list[str]] | None = None
        self._lock = threading.Lock()
        self._threads = [
            threading.Thread(target=self._run_jobs, name="allreduce", daemon=True),
            threading.Thread(target=self._watch_members, name="members", daemon=True),
        ]

    # ----- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        self.records.publish_config(self.config_hash, self.shared_json)
        self.heartbeat.start()
        self.refresh_members()
        for thread in self._threads:
            thread.start()

    def maddrs(self) -> list[str]:
        return reachable_maddrs(self.dht)

    def close(self) -> None:
        if self._closed.is_set():
            return
        self._closed.set()
        self._jobs.put(None)
        try:
            self.heartbeat.stop(leave=True)
        except Exception as e:  # pragma: no cover - best effort on the way out
            logger.debug("could not publish leave record: %s", e)
        for thread in self._threads:
            thread.join(timeout=self.sw.allreduce_timeout)
        self.averager.shutdown()
        self.dht.shutdown()

    # ----- membership ------------------------------------------------------------------------
    def refresh_members(self) -> None:
        try:
            members = self.records.members()
        except Exception as e:
            logger.debug("member lookup failed: %s", e)
            return
        with self._lock:
            self._members = members
        for m in members:
            if m.record.config_hash != self.config_hash and m.peer_id not in self._warned_about:
                self._warned_about.add(m.peer_id)
                logger.warning(
                    "refusing %s (peer %s): its config hash %s differs from this run's %s",
                    m.peer_id, m.record.peer_name, m.record.config_hash[:12], self.config_hash[:12],
                )

    def _watch_members(self) -> None:
        while not self._closed.wait(HEARTBEAT_S):
            self.refresh_members()

    def members(self, *, training_only: bool = False, others_only: bool = True) -> list[Member]:
        """Live members of this stage with this run's config (from the last refresh)."""
        with self._lock:
            members = list(self._members)
            suspects = dict(self._suspects)
        return [
            m
            for m in members
            if m.record.config_hash == self.config_hash
            and (m.record.training or not training_only)
            and (m.peer_id != self.peer_id or not others_only)
            # a peer that failed in an all-reduce counts again once it heartbeats after the failure
            and not (m.peer_id in suspects and m.expiration < suspects[m.peer_id] + MEMBER_TTL_S + HEARTBEAT_S)
        ]

    def check_admission(self) -> None:
        """Refuse to join a run whose oldest live member has another config hash."""
        self.refresh_members()
        with self._lock:
            others = [m for m in self._members if m.peer_id != self.peer_id and m.record.training]
        if not others:
            return
        oldest = min(others, key=lambda m: (m.record.joined_at, m.peer_id))
        if oldest.record.config_hash == self.config_hash:
            return
        theirs = self.records.config(oldest.record.config_hash)
        diffs = config_diff(self.shared_json, theirs) if theirs else []
        detail = "; ".join(diffs) if diffs else "compare `dilocox-peer config show` on both peers"
        raise AdmissionError(
            f"run {self.cfg.run.run_id!r} trains with config hash {oldest.record.config_hash[:12]} "
            f"(peer {oldest.record.peer_name}), this peer has {self.config_hash[:12]}: {detail}"
        )

    def wait_for_peers(self, count: int, timeout: float) -> int:
        """Wait until `count` workers of this stage (this one included) are in the run."""
        deadline = time.monotonic() + timeout
        last_log = 0.0
        while True:
            self.refresh_members()
            n = len(self.members(others_only=False))
            if n >= count or time.monotonic() >= deadline:
                return n
            if time.monotonic() - last_log > 10:
                logger.info("waiting for peers: %d of %d workers of stage %d are here", n, count, self.stage)
                last_log = time.monotonic()
            time.sleep(0.5)

    def set_state(self, boundary: int, *, ready: bool, training: bool = True) -> None:
        self.averager.set_state_boundary(boundary, ready)
        self.heartbeat.update(boundary=boundary, state_ready=ready, training=training, wait=False)

    # ----- the Averager protocol ---------------------------------------------------------------------
    def all_reduce(self, tensors: Sequence[torch.Tensor], *, round: int, weight: float) -> Future[AveragingResult]:
        future: Future[AveragingResult] = Future()
        self.heartbeat.update(averaging_round=round, wait=False)  # tells the others this round is ready to average
        if not self.members():  # nobody else in the run: the average of one, at once (and deterministic)
            future.set_result(AveragingResult(tensors=list(tensors), group_size=1))
        else:
            self._jobs.put((future, list(tensors), round, weight))
        return future

    def _run_jobs(self) -> None:
        while True:
            job = self._jobs.get()
            if job is None:
                return
            future, tensors, round, weight = job
            if round < self._abandon_below:
                future.set_result(AveragingResult(tensors=tensors, group_size=1, note="abandoned"))
                continue
            try:
                expected = 1 + self._wait_for_round(round)
                if expected <= 1:
                    result = AveragingResult(tensors=tensors, group_size=1)
                else:
                    result = self._average(tensors, round, weight, expected)
                future.set_result(result)
            except Exception as e:  # never leave the outer loop hanging
                logger.exception("all-reduce of round %d failed unexpectedly", round)
                future.set_result(
                    AveragingResult(tensors=tensors, group_size=1, note=f"internal error: {e!r}", fallback=True)
                )

    def _wait_for_round(self, round: int) -> int:
        """Wait (bounded by round_wait, one DHT lookup per half second) until every live training
        member of the stage has started this round's all-reduce; return how many others train.

        Matchmaking then finds everyone at once. Entering hivemind's matchmaking early instead
        makes it poll the DHT in a tight loop for as long as the slowest peer needs (measured:
        most of a CPU core on a 2-core machine while a peer is one round behind).
        """
        deadline = time.monotonic() + self.sw.round_wait
        while True:
            self.refresh_members()
            others = self.members(training_only=True)
            if all(m.record.averaging_round >= round for m in others) or time.monotonic() >= deadline:
                return len(others)
            if round < self._abandon_below or self._closed.is_set():
                return len(others)
            time.sleep(0.5)

    def _average(self, tensors: list[torch.Tensor], round: int, weight: float, expected: int) -> AveragingResult:
        with self.averager.get_tensors() as buffers:
            for buf, t in zip(buffers, tensors):
                buf.copy_(t)
        self.averager.prepare_round(round, expected)
        started, window_start = time.monotonic(), time.time()
        control = self.averager.step(weight=weight, timeout=self.sw.round_wait + 5.0, allow_retries=True, wait=False)
        with self._lock:
            self._running = (round, control)
        try:
            out = self._wait_for_step(control, round, started)
            failure = "" if out else "no group formed"
        except BaseException as e:  # includes the CancelledError of an abandoned round
            out, failure = None, f"{type(e).__name__}: {str(e)[:200]}"
        finally:
            with self._lock:
                self._running = None
        if not out:
            if round < self._abandon_below:
                return AveragingResult(tensors=tensors, group_size=1, note="abandoned")
            return self._group_average_or_own(tensors, round, failure, window_start)
        with self.averager.get_tensors() as buffers:
            averaged = [b.clone() for b in buffers]
        stats = out["stats"]
        alive: set[str] = set()
        if stats.coverage < 1.0:
            better, alive = self._better_group_average(round, stats)
            if better is not None:
                averaged, stats.coverage = better.tensors, better.coverage
        self._suspect([p for p in stats.failed_reducers + stats.banned_senders if p not in alive])
        if stats.coverage < 1.0:
            logger.warning(
                "round %d: reducers %s failed; %.1f%% of coordinates averaged, the rest not updated on any member",
                round, ", ".join(stats.failed_reducers), 100 * stats.coverage,
            )
        logger.info(
            "round %d averaged in a group of %d (expected %d) in %.2fs",
            round, len(stats.group), expected, time.monotonic() - started,
        )
        return AveragingResult(
            tensors=averaged,
            group_size=len(stats.group),
            bytes_sent=stats.bytes_sent,
            bytes_received=stats.bytes_received,
            coverage=stats.coverage,
            peers=tuple(stats.group),
            window=(window_start, time.time()),
        )

    def _better_group_average(self, round: int, stats: Any) -> tuple[StateDownload | None, set[str]]:
        """Some reducers' parts never reached this worker. If they reached another member, take that
        member's (more complete) average: then the whole group holds the same one. If a reducer really
        died, every member lacks the same parts and keeps its own, identical, average.

        The "failed" reducers are asked last: a failure seen from here only may leave the reducer alive,
        holding the complete average (with two peers, it is the only other member). Returns the better
        average (or None) and the members known alive whatever the stats say: those that answered, and
        every reducer if the average taken is complete (then each reducer delivered its part).
        """
        failed = set(stats.failed_reducers)
        others = [p for p in stats.group if p != self.peer_id]
        alive: set[str] = set()
        for peer in sorted(others, key=lambda p: p in failed):
            timeout = self.sw.chunk_timeout if peer in failed else self.sw.state_timeout
            got = self.averager.download_average(peer, round, wait_s=self.sw.chunk_timeout, timeout=timeout)
            if got.status != swarm_pb2.STATE_OK:
                continue
            alive.add(peer)
            if got.coverage > stats.coverage:
                logger.warning(
                    "round %d: reducers %s did not reach this worker; took the %.1f%%-complete average from %s",
                    round, ", ".join(sorted(failed)), 100 * got.coverage, peer,
                )
                return got, (alive | failed) if got.coverage >= 1.0 else alive
        return None, alive

    def _wait_for_step(self, control: Any, round: int, started: float) -> Any:
        """Wait for hivemind's step; while still matchmaking, give up early once a member of the stage
        has finished this round's all-reduce without us (its group formed and is done)."""
        while True:
            try:
                return control.result(timeout=1.0)
            except TimeoutError:
                pass
            if control.stage != AveragingStage.LOOKING_FOR_GROUP or time.monotonic() - started < self.sw.round_wait / 4:
                continue
            self.refresh_members()
            if any(self._finished(m, round) for m in self.members(training_only=True)):
                logger.info("round %d: the stage group averaged without this worker; taking its result", round)
                control.cancel()
                return None

    @staticmethod
    def _finished(member: Member, round: int) -> bool:
        """The member's record shows it completed round `round`'s all-reduce."""
        b = member.record.boundary
        return b > round + 1 or (b == round + 1 and member.record.state_ready)

    def _group_average_or_own(
        self, tensors: list[torch.Tensor], round: int, failure: str, window_start: float
    ) -> AveragingResult:
        """This worker's all-reduce failed: take its group's average from a member if there is one."""
        self.refresh_members()
        members = sorted(self.members(training_only=True), key=lambda m: not self._finished(m, round))
        for member in members:
            got = self.averager.download_average(
                member.peer_id, round, wait_s=self.sw.chunk_timeout, timeout=self.sw.state_timeout
            )
            if got.status == swarm_pb2.STATE_OK and len(got.tensors) == len(tensors):
                logger.warning(
                    "round %d: this worker's all-reduce failed (%s); took the average of its group of %d from %s",
                    round, failure, got.pending_group_size, member.peer_id,
                )
                return AveragingResult(
                    tensors=got.tensors,
                    group_size=got.pending_group_size,
                    bytes_received=sum(t.numel() * t.element_size() for t in got.tensors),
                    peers=(member.peer_id,),
                    window=(window_start, time.time()),
                )
        note = f"no group formed for round {round} ({failure}) and no member had a group average"
        return AveragingResult(tensors=tensors, group_size=1, note=note, fallback=True)

    def abandon_before(self, round: int) -> None:
        """This peer jumped to round `round`: drop earlier all-reduces, queued or in flight."""
        with self._lock:
            self._abandon_below = max(self._abandon_below, round)
            running = self._running
        if running is not None and running[0] < round:
            running[1].cancel()

    def _suspect(self, peer_ids: Sequence[str]) -> None:
        """Peers that failed in an all-reduce: not expected in the next groups until they heartbeat again."""
        now = get_dht_time()
        with self._lock:
            for peer_id in peer_ids:
                self._suspects[peer_id] = now

    # ----- round records and repair -------------------------------------------------------------------
    def publish_boundary(self, boundary: int, theta_hash: str, *, group_size: int, coverage: float) -> None:
        """Publish the hash held at `boundary`; check the previous boundary's hashes in the background.

        The check runs one boundary late, when every worker has published its own record,
        so it costs one DHT lookup per round instead of polling.
        """
        self.records.publish_round(boundary, theta_hash, group_size=group_size, coverage=coverage)
        previous, self._published = self._published, (boundary, theta_hash)
        if previous is not None:
            args = (*previous, self._epoch)
            threading.Thread(target=self._check_boundary, args=args, name="check", daemon=True).start()

    def forget_checks(self) -> None:
        """The state was replaced: earlier hashes say nothing about it any more."""
        with self._lock:
            self._epoch += 1
            self._published, self._repair = None, None

    def _check_boundary(self, boundary: int, theta_hash: str, epoch: int) -> None:
        try:
            hashes = self.records.round_hashes(boundary)
        except Exception as e:
            logger.debug("round record lookup failed: %s", e)
            return
        hashes[self.peer_id] = theta_hash
        winner = majority_hash(hashes)
        if winner is not None and winner != theta_hash:
            holders = sorted(p for p, h in hashes.items() if h == winner)
            logger.warning(
                "theta_g at round %d differed from the majority (%d of %d workers hold %s, this one %s): "
                "resyncing at the next round",
                boundary, len(holders), len(hashes), winner[:12], theta_hash[:12],
            )
            with self._lock:
                if epoch == self._epoch:
                    self._repair = (boundary, winner, holders)

    def take_repair(self) -> tuple[int, str, list[str]] | None:
        with self._lock:
            repair, self._repair = self._repair, None
        return repair

    def donors(self, boundary: int | None = None) -> list[Member]:
        """Training members that hold (or will soon hold) `boundary`, most advanced first."""
        members = [m for m in self.members(training_only=True) if boundary is None or m.record.boundary <= boundary]
        return sorted(members, key=lambda m: (-m.record.boundary, not m.record.state_ready, m.record.joined_at))

    def fetch_state(self, boundary: int, donors: Sequence[str], *, at_least: bool = False) -> StateDownload | None:
        """Download the state at `boundary` (or later, with `at_least`) from the first donor that
        serves it; None if none did."""
        for donor in donors:
            result = self.averager.download_round(
                donor, boundary, wait_s=self.sw.allreduce_timeout, timeout=self.sw.state_timeout, at_least=at_least
            )
            if result.status != swarm_pb2.STATE_OK:
                status = swarm_pb2.StateStatus.Name(result.status) if result.status >= 0 else "error"
                logger.info("state of round %d not taken from %s: %s (donor at %d) %s",
                            boundary, donor, status, result.boundary, result.reason)
                continue
            n = len(result.tensors)
            received = state_hash(result.tensors[: n // 2 if not result.has_pending else n // 3])
            if received != result.theta_hash:
                logger.warning("state from %s does not match the hash it announced; ignoring it", donor)
                continue
            return result
        return None

