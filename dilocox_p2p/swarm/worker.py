"""A stage worker that trains as part of a swarm (the round loop is the one in worker.py).

Start: join the DHT, publish multiaddrs (lead), check admission, wait for `min_peers`,
then, if the run has moved on, download the state of the swarm's current boundary from
a live worker of the same stage (all local stages agree on the boundary first).
Each boundary: repair from the majority if the last hash check said so, then publish the
new hash and offer the state to joiners once it is complete.
"""

from __future__ import annotations

import logging
import socket
import time
from typing import Any

import torch
import torch.distributed as dist

from ..outer import Averager, RoundOutcome, state_hash
from ..worker import StageWorker
from .averager import StateDownload
from .priority import lower_priority
from .stage import SwarmStage, majority_hash

__all__ = ["SwarmStageWorker"]

logger = logging.getLogger(__name__)

RESYNC_ATTEMPTS = 6


class SwarmStageWorker(StageWorker):
    swarm: SwarmStage

    def make_averager(self) -> Averager:
        """Start this stage's DHT node: stage 0 first, the others bootstrap from it (one DHT, no islands)."""
        peer_name = f"{socket.gethostname()}:{self.run_dir.resolve().name}"

        def start(extra_peers: list[str]) -> SwarmStage:
            return SwarmStage(
                self.cfg,
                stage=self.stage,
                tensors=self.trainer.params,
                run_dir=self.run_dir,
                peer_name=peer_name,
                extra_peers=extra_peers,
            )

        if self.lead:
            self.swarm = start([])
        lead_maddrs = [self.swarm.maddrs() if self.lead else None]
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.broadcast_object_list(lead_maddrs, src=0, group=self.control_group)
        if not self.lead:
            self.swarm = start(lead_maddrs[0])
        self.swarm.averager.set_state_provider(self._state_for_peers)
        lower_priority(-self.cfg.swarm.helper_nice)  # helper_nice < 0: training below the helpers started above
        return self.swarm

    # ----- start ----------------------------------------------------------------------------------
    def on_start(self, start: int) -> int:
        swarm = self.swarm
        swarm.start()
        self._announce(swarm.maddrs())
        failures = self._all_gather(self._try(swarm.check_admission))
        if any(failures):
            raise next(f for f in failures if f)
        if self.cfg.swarm.min_peers > 1:
            n = swarm.wait_for_peers(self.cfg.swarm.min_peers, timeout=self.cfg.swarm.peer_wait)
            counts = self._all_gather(n)
            if self.lead:
                logger.info("%d peers in the run (waited for %d)", min(counts), self.cfg.swarm.min_peers)
        start = self._join(start)
        self._publish(start)
        return start

    @staticmethod
    def _try(fn: Any) -> Exception | None:
        try:
            fn()
        except Exception as e:
            return e
        return None

    def _announce(self, maddrs: list[str]) -> None:
        everyone = self._all_gather(maddrs)
        if not self.lead:
            return
        lines = [m for stage_maddrs in everyone for m in stage_maddrs]
        (self.run_dir / "multiaddrs.txt").write_text("\n".join(lines) + "\n")
        print(f"peer multiaddrs (also in {self.run_dir / 'multiaddrs.txt'}); others join with --initial-peers:", flush=True)
        for m in everyone[0]:
            print(f"  {m}", flush=True)

    def _join(self, start: int) -> int:
        """At start: take the swarm's state if the run has moved on (or our checkpoint is incomplete)."""
        behind = any(m.record.boundary > start for m in self.swarm.donors())
        incomplete = self.outer.missing_pending is not None
        differs = start > 0 and not self._holds_majority(start)
        if not any(self._all_gather(behind or incomplete or differs)):
            return start
        boundary = self._resync(start)
        if boundary is None and incomplete and self.lead:
            logger.warning("no live peer had the average in flight at the checkpoint; it is skipped")
        return start if boundary is None else boundary

    def _holds_majority(self, boundary: int) -> bool:
        hashes = self.swarm.records.round_hashes(boundary)
        return majority_hash(hashes) in (None, self.outer.hash())

    def _resync(self, boundary: int) -> int | None:
        """All stages of this peer take the swarm's state at one common boundary >= `boundary`.

        Each stage asks its donors (holders of the majority hash first) for their current
        complete state at or after the boundary the stages agreed on; if the stages got
        different boundaries, those behind ask again for the newest one. Returns the boundary
        the peer continues from, or None if nobody could serve a state.
        """
        result: StateDownload | None = None
        for attempt in range(RESYNC_ATTEMPTS):
            if attempt:
                time.sleep(0.5 * attempt)
            self.swarm.refresh_members()
            donors = [m for m in self.swarm.donors() if m.record.boundary >= boundary]
            local = max([m.record.boundary for m in donors] or [-1])
            target = max(self._all_gather(max(local, result.boundary if result else -1)))
            if target < 0:
                continue  # the others' records may not show this boundary yet
            if result is None or result.boundary < target:
                result = self.swarm.fetch_state(target, self._donor_order(donors, target), at_least=True)
            got = self._all_gather(result.boundary if result is not None else -1)
            if min(got) >= 0 and len(set(got)) == 1:
                self.swarm.abandon_before(result.boundary)
                self.swarm.forget_checks()
                self._install(result)
                self._publish(result.boundary)
                if self.lead:
                    logger.info("took the swarm's state of round %d (was at %d)", result.boundary, boundary)
                return result.boundary
        if self.lead:
            logger.warning("could not take the swarm's state after %d attempts; training on from round %d",
                           RESYNC_ATTEMPTS, boundary)
        return None

    def _donor_order(self, donors: list[Any], target: int) -> list[str]:
        """Donors holding the majority hash of their boundary first, the most advanced first."""
        hashes = self.swarm.records.round_hashes(target)
        winner = majority_hash({p: h for p, h in hashes.items() if p != self.swarm.peer_id})
        ranked = sorted(donors, key=lambda m: (hashes.get(m.peer_id, winner) != winner, -m.record.boundary))
        return [m.peer_id for m in ranked]

    def _install(self, download: StateDownload) -> None:
        n = len(self.outer.theta_g)
        tensors = download.tensors
        pending = None
        if download.has_pending:
            pending = {"round": download.boundary - 1, "tensors": tensors[2 * n :], "group_size": download.pending_group_size}
        self.outer.load_state_dict(
            {"boundary": download.boundary, "theta_g": tensors[:n], "momentum": tensors[n : 2 * n], "pending": pending}
        )
        logger.info("installed the state of round %d from %s (hash %s)", download.boundary, download.donor, download.theta_hash[:12])

    # ----- boundaries ---------------------------------------------------------------------------------
    def on_boundary(self, boundary: int, outcome: RoundOutcome) -> tuple[int, bool]:
        """Resync with the swarm before theta_g is used if it is known (or likely) to be off.

        Triggers, decided together by all stages of this peer: the background hash check of an
        earlier boundary found a stage in the minority; a stage's "average" is its own delta
        because no group formed while others trained; or the peer fell two rounds behind.
        """
        repair = self.swarm.take_repair() is not None
        alone = outcome.fallback and bool(self.swarm.members(training_only=True))
        behind = any(m.record.boundary >= boundary + 2 for m in self.swarm.donors())
        reasons = self._all_gather((repair, alone, behind))
        if not any(any(r) for r in reasons):
            return boundary, False
        if self.lead:
            why = [name for i, name in enumerate(("hash mismatch", "no group formed", "behind")) if any(r[i] for r in reasons)]
            logger.warning("round %d: resyncing with the swarm (%s)", boundary - 1, ", ".join(why))
        # while resyncing this worker is not in the stage's groups: nobody should wait for it
        self.swarm.set_state(boundary, ready=False, training=False)
        new = self._resync(boundary)
        if new is None:
            self._publish(boundary)
        return (boundary, False) if new is None else (new, True)

    def on_finish(self, boundary: int) -> None:
        """Keep serving the final state until the stage's other workers hold it too (or left)."""
        ours = self.outer.hash()
        deadline = time.monotonic() + self.cfg.swarm.round_wait + self.cfg.swarm.state_timeout
        while time.monotonic() < deadline:
            others = {m.peer_id for m in self.swarm.members(training_only=True)}
            hashes = self.swarm.records.round_hashes(boundary)
            if all(hashes.get(p) == ours for p in others):
                return
            time.sleep(0.5)
            self.swarm.refresh_members()
        logger.info("left with workers of stage %d still on another state at the final round", self.stage)

    def after_boundary(self, boundary: int, theta_hash: str, outcome: RoundOutcome) -> None:
        self.swarm.publish_boundary(boundary, theta_hash, group_size=outcome.group_size or 0, coverage=outcome.coverage)
        self._publish(boundary)

    def _publish(self, boundary: int) -> None:
        """Offer the state of `boundary` to joiners once it is complete (delayed: once the pending average is in)."""
        future = self.outer.pending_future()
        if future is None or future.done():
            self.swarm.set_state(boundary, ready=True)
            return
        self.swarm.set_state(boundary, ready=False)

        def ready(_: Any) -> None:
            if self.outer.boundary == boundary:
                self.swarm.set_state(boundary, ready=True)

        future.add_done_callback(ready)

    def _state_for_peers(self) -> tuple[dict[str, Any], list[torch.Tensor]]:
        snapshot = self.outer.snapshot()
        if snapshot is None:  # the pending average is still in flight: not complete yet
            return {"boundary": -1}, []
        boundary, tensors, pending_round, group_size = snapshot
        n = len(self.outer.theta_g)
        metadata = {
            "boundary": boundary,
            "theta_hash": state_hash(tensors[:n]),
            "has_pending": pending_round is not None,
            "pending_group_size": group_size,
        }
        return metadata, tensors

    def close(self) -> None:
        self.swarm.close()

