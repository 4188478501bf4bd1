"""A stage worker that trains as part of a swarm (the round loop is the one in worker.py).

Start: join the DHT, publish multiaddrs (lead), check admission, wait for `min_peers` at
the start barrier (until that many workers are there, then until each of them trains, so
that peers started together start their first round together), then, if the run has moved
on (or this worker's checkpoint differs from the swarm or lacks the average that was in
flight), download the state of the swarm's current boundary from a live worker of the same
stage (all local stages agree on the boundary).
Each boundary: repair from the majority if a hash check said so, catch up if this worker
fell two rounds behind or was stranded, then publish the new hashes and offer the state
to joiners once it is complete. The last boundary, which no later check looks at, is compared
at once (settle_final) and repaired before the final record and checkpoint.
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from concurrent.futures import Future
from typing import Any

import torch
import torch.distributed as dist

from .. import injection, startup
from ..average import Average, Averager, AverageKind, average_hash
from ..round_outcome import RoundOutcome
from ..logs import route_hivemind_logs, set_log_context
from ..state import StageState
from ..worker import StageWorker
from .agreement import split_evenly
from .priority import lower_priority, settle
from .stage import SwarmStage
from .state_taking import StateTaking

__all__ = ["SwarmStageWorker"]

logger = logging.getLogger(__name__)



class SwarmStageWorker(StateTaking, StageWorker):
    swarm: SwarmStage

    def make_averager(self) -> Averager:
        """Start this stage's DHT node, in one DHT with stage 0's (no islands): where stage 0 will listen is
        known (launch._known_lead), every stage starts at once and the others join stage 0's node as it listens
        (through the initial peers too, if any; SwarmStage); otherwise stage 0 starts first and tells them."""
        route_hivemind_logs()  # before the DHT's and the averager's processes fork from this one
        peer_name = f"{socket.gethostname()}:{self.run_dir.resolve().name}"

        def start(extra_peers: list[str]) -> SwarmStage:
            return SwarmStage(
                self.cfg,
                stage=self.stage,
                tensors=self.trainer.params,
                names=[name for name, _ in self.trainer.module.named_parameters()],
                fragments=self.fragments,
                run_dir=self.run_dir,
                peer_name=peer_name,
                extra_peers=extra_peers,
            )

        known = list(self.spec.lead_maddrs)  # every stage starts its node at once, joining stage 0's as it listens
        if self.lead or known:
            self.swarm = start([] if self.lead else known)
        if not known:  # stage 0 tells the others where it listens once it does
            lead_maddrs = [self.swarm.maddrs() if self.lead else None]
            if self._size() > 1:
                dist.broadcast_object_list(lead_maddrs, src=0, group=self.control_group)
            if not self.lead:
                self.swarm = start(lead_maddrs[0])
        set_log_context(peer=self.swarm.peer_id)
        startup.mark("dht")
        self._offered = -1  # the boundary whose complete state joiners may download (its round record is out)
        self._announced = -1  # the boundary whose round record is out (STATE_NOW: its state, pending average apart)
        self._leave_by: float | None = None  # time.monotonic() by which it leaves after the last round
        self._final_probed = False  # whether the members silent at the final round were probed (_all_hold)
        self._last_boundary = time.monotonic()  # when this worker last reached a boundary (or started)
        self._stop = threading.Event()  # set by the stop signal; a watcher then abandons the exchanges
        threading.Thread(target=self._abandon_on_stop, name="stop-watch", daemon=True).start()
        self._kept: StageState | None = None  # the offered state, kept past its boundary for a waiting joiner
        self._state_donors: dict[str, int] = {}  # bytes each donor served of the states taken (take_state_donors)
        self._settled = False  # whether it lowered its priority (swarm.settled_nice), once it trains
        self.swarm.averager.set_state_provider(self.offered_state)
        lower_priority(-self.cfg.swarm.helper_nice)  # helper_nice < 0: training below the helpers started above
        return self.swarm

    def offered_state(self, boundary: int, now: bool = False) -> StageState | None:
        """The complete state of `boundary` a joiner may download, if this worker holds one: the one kept
        past its boundary for a waiting joiner, or the current one once offered (announced, so that a
        joiner always finds the round record to check it against). `now`: the current one once announced,
        its pending average left out while in flight (StageState.follows)."""
        kept = self._kept
        if kept is not None and kept.boundary == boundary:
            return kept
        if boundary != (self._announced if now else self._offered):
            return None
        state = self.outer.state(now=now)
        return state if state is not None and state.boundary == boundary else None

    def _keep_for_joiner(self) -> None:
        """Runs under the outer lock just before the state moves on. Where the all-reduce is slower
        than training (delayed mode on a slow link), the state of a boundary is complete only for
        the moment between its average's arrival and this step, too short for a joiner to take it:
        while one is waiting, or one that took it without its pending average will ask for that, keep
        that complete state until the next step; and one still owed to a taker (a piece of it served: the taker may
        come back for more) past that step too, for as long as it is owed."""
        kept, self._kept = self._kept, None
        if kept is not None and self.swarm.averager.state_wanted(kept.boundary, owed_only=True):
            self._kept = kept
        elif self.swarm.averager.state_wanted(self.outer.boundary):
            state = self.outer.state()
            if state is not None and state.boundary == self.outer.boundary:
                self._kept = state
        self.swarm.averager.set_kept_boundary(self._kept.boundary if self._kept is not None else -1)

    def on_stop_signal(self) -> None:
        self._stop.set()

    def _abandon_on_stop(self) -> None:
        """A stop abandons the exchanges at once: the round waiting for one gives up instead of waiting out the
        swarm's timeouts (round_wait, allreduce_timeout) for a peer that is leaving anyway."""
        self._stop.wait()
        self.swarm.exchanges.abandon_before(2**62)

    def take_fault_counts(self) -> dict[str, int]:
        return self.swarm.take_faults()

    def deadlines(self) -> dict[str, float] | None:
        return self.swarm.deadlines.snapshot()

    def take_wire_bytes(self) -> tuple[tuple[int, int], tuple[int, int]] | None:
        return self.swarm.wire.take()

    def take_source_bytes(self) -> dict[str, list[int]] | None:
        return self.swarm.sources.take()

    def peer_facts(self) -> dict[str, Any]:
        return {"peer_id": self.swarm.peer_id, "peer_key": self.swarm.peer_key_hex, "multiaddrs": self.swarm.maddrs()}

    def group_members(self) -> list[str]:
        members = self.swarm.membership.members(others_only=False)
        return sorted(m.record.peer_name or m.peer_id for m in members)

    def client_member(self) -> str:
        return self.swarm.client

    def compression_facts(self) -> dict[str, Any]:
        facts: dict[str, Any] = {}
        for codec in self.swarm.codecs:
            for key, values in codec.metrics().items():
                facts.setdefault(key, {}).update(values)
        return facts

    def extra_state(self) -> dict[str, Any]:
        """Error feedback and low-rank Qs: this peer's own, kept in its checkpoints, never shared."""
        return {"codecs": [c.state_dict() for c in self.swarm.codecs]} if self.swarm.codecs else {}

    def load_extra_state(self, state: dict[str, Any]) -> None:
        saved = state.get("codecs") or []
        if len(saved) == len(self.swarm.codecs):
            for codec, codec_state in zip(self.swarm.codecs, saved):
                codec.load_state_dict(codec_state)

    # ----- start ----------------------------------------------------------------------------------
    def _earlier_exchange(self, start: int) -> int:
        """The last exchange this worker's earlier life began, from that life's member record (still in the DHT
        when the worker restarts soon after, before this life's first heartbeat replaces it); -1 if none."""
        if start <= 0:
            return -1
        try:
            me = self.swarm.peer_id
            began = max((m.record.averaging_round for m in self.swarm.records.members() if m.peer_id == me), default=-1)
        except Exception as e:  # a failed lookup: requests of those rounds wait, as for any member
            logger.info("could not read this worker's earlier member record: %r", e)
            return -1
        if began >= start:
            logger.info("the earlier life of this worker had begun round %d's exchange: members of that group that ask "
                        "for its average are told at once that it has none", began)
        return began

    def on_start(self, start: int) -> int:
        swarm = self.swarm
        # a member that asks for an average of before `start`, or of a round the earlier life began, is told at once
        swarm.averager.set_life_start(start, self._earlier_exchange(start))
        swarm.start()
        self.outer.before_step = self._keep_for_joiner
        self._announce(swarm.maddrs())
        failures = self._all_gather(self._try(lambda: swarm.membership.check_admission(self.cfg.run.run_id, swarm.shared_json)))
        if any(failures):
            raise next(f for f in failures if f)
        quorum: list[str] = []
        if self.cfg.swarm.min_peers > 1:  # the start barrier: first every peer of the quorum is here ...
            swarm.heartbeat.update(boundary=start)  # at the barrier, with the state of `start`
            quorum = swarm.membership.wait_for_peers(
                self.cfg.swarm.min_peers, timeout=self.cfg.swarm.peer_wait, give_up=self._stop.is_set
            )
            self._check_stop()
            counts = self._all_gather(len(quorum))
            if self.lead:
                logger.info("%d peers in the run (waited for %d)", min(counts), self.cfg.swarm.min_peers)
        joined = self._join(start)
        self.swarm.set_state(joined, ready=False, training=True, taken=True)  # members wait for it from now on
        self._publish(joined)
        if quorum and joined == start:  # ... then every one of them trains, and they start round `start` together
            swarm.membership.wait_until_training(quorum, timeout=self.cfg.swarm.round_wait, give_up=self._stop.is_set)
        self._last_boundary = time.monotonic()
        return joined

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
        """At start: take the swarm's state if the run has moved on, or our checkpoint differs from it
        or lacks the average that was in flight."""
        behind = any(m.record.boundary > start for m in self.swarm.membership.donors())
        incomplete = self.outer.pending_lost is not None
        differs = start > 0 and not self._holds_majority(start)
        if not any(self._all_gather(behind or incomplete or differs)):
            return start
        boundary = self._resync(start, reason="catch_ups")
        if boundary is None:
            lost, alone = self.outer.forget_lost_pending()
            if lost is not None and alone:
                logger.warning("no live worker had the average of round %d that was in flight at the checkpoint; "
                               "this worker's own pseudo-gradient of it is applied, as if it averaged alone", lost)
            elif lost is not None:
                self.swarm.faults.count(
                    "pending_dropped", "no live worker had the average of round %d that was in flight at the "
                    "checkpoint; it is skipped (a later hash check repairs this worker if it differs)", lost,
                )
        return start if boundary is None else boundary

    # ----- boundaries ---------------------------------------------------------------------------------
    def on_boundary(self, boundary: int, outcome: RoundOutcome) -> tuple[int, bool]:
        """Resync with the swarm before theta_g is used if it is known (or likely) to be off.

        Triggers, decided together by all stages of this peer: the background hash check of an
        earlier boundary found a stage in the minority, or a stage applied an average that it knows
        differs from its group's majority (it could not take theirs); a stage was stranded (others train, but
        no average could be had) while some member may have had one (not when every member that
        answered lacked it too: then nobody is ahead); or the peer fell two rounds behind.
        """
        if injection.armed("corrupt_state", round=boundary - 1, stage=self.stage):
            self._corrupt_theta_g()
        # the check of the boundary before is normally settled by now (the others' records came in during the
        # round); if not, settle it first: a worker in the minority trains one round on a diverged state, never
        # two. It waits at most as long again as the round took (others on a loaded machine publish a round
        # late), and at most round_wait (a member that died holds no record to wait for)
        now = time.monotonic()
        patience = min(self.cfg.swarm.round_wait, now - self._last_boundary)
        self._last_boundary = now
        self.swarm.agreement.settle_check(boundary - 1, deadline=now + patience)
        repair = self.swarm.agreement.take_repair() is not None
        repair = any(a.average.off_majority for a in outcome.applied) or repair
        last = outcome.last
        stranded = (
            last is not None and last.kind is AverageKind.STRANDED and not last.stranded_alike
            and bool(self.swarm.membership.members(training_only=True))
        )  # fmt: skip
        behind = any(m.record.boundary >= boundary + 2 for m in self.swarm.membership.donors())
        reasons = self._all_gather((repair, stranded, behind))
        if not any(any(r) for r in reasons):
            return boundary, False
        if self.lead:
            why = [name for i, name in enumerate(("hash mismatch", "stranded", "behind")) if any(r[i] for r in reasons)]
            logger.warning("round %d: resyncing with the swarm (%s)", boundary - 1, ", ".join(why))
        # the exchange it just launched would only pull one member away from the others' group
        self.swarm.exchanges.abandon_before(boundary)
        new = self._resync_aside(boundary, reason="repairs" if any(r[0] for r in reasons) else "catch_ups")
        return (boundary, False) if new is None else (new, True)  # failed: after_boundary offers the state

    @torch.no_grad()
    def _corrupt_theta_g(self) -> None:
        with self.outer.lock:
            self.outer.theta_g[0].view(-1)[:1].view(torch.int32).bitwise_xor_(1)

    def settle_final(self, boundary: int, state_hash: str) -> bool:
        """Compare the last boundary's state with the stage group's as soon as that is settled, and take
        the majority's if this worker (or another stage of this peer) is in the minority: the last
        exchanges (a copy that failed to adopt the group's average, a member stranded) have no later
        hash check to repair them. Bounded by the same deadline as `on_finish`."""
        self._leave_by = time.monotonic() + self.cfg.swarm.round_wait + self.swarm.deadlines.state
        repair = self.swarm.agreement.settle(boundary, state_hash, deadline=self._leave_by)
        if not any(self._all_gather(repair is not None)):
            return False
        if self.lead:
            logger.warning("round %d: the final state differs from the swarm's majority; taking theirs", boundary - 1)
        if self._resync_aside(boundary, reason="repairs") is None:
            self._publish(boundary)  # it keeps its own state, offered again
            return False
        return True

    def on_finish(self, boundary: int) -> None:
        """Keep serving the final state until the stage's other workers hold it too (or left), those still
        resyncing included: they need a donor most. The stages of this peer leave together: a peer in the
        minority takes the state of all its stages at once (`_resync`), also of a stage that agreed, so a stage
        of this peer whose group agreed keeps serving while another's does not (a corrupted last round on one
        stage could not be repaired once the other stage's donors had left)."""
        ours = self.outer.hash()
        deadline = self._leave_by or time.monotonic() + self.cfg.swarm.round_wait + self.swarm.deadlines.state
        while True:
            held = not self._stop.is_set() and self._all_hold(boundary, ours)
            done = held or self._stop.is_set() or time.monotonic() >= deadline
            if all(self._all_gather(done)):  # a collective: every stage takes the same number of turns
                break
            time.sleep(0.5)
            self.swarm.membership.refresh()
        if not self._stop.is_set() and not held:
            logger.info("left with workers of stage %d still on another state at the final round", self.stage)

    def _all_hold(self, boundary: int, ours: str) -> bool:
        """Every other live worker of this stage announced `ours` for `boundary`, suspects too (one that failed the
        last exchange borrows the group's average from those still here, then announces the final state), or the
        announced states are split evenly: a tie is kept (agreement.split_evenly), and nobody comes for this one."""
        others = {m.peer_id for m in self.swarm.membership.members(suspects_too=True)}
        try:
            hashes = {p: r.state_hash for p, r in self.swarm.records.round_records(boundary).items()}
        except Exception as e:
            self.swarm.faults.count("lookups_failed", "round records of %d could not be read: %r", boundary, e)
            return False
        if split_evenly({p: hashes[p] for p in others if p in hashes} | {self.swarm.peer_id: ours}):
            return True
        silent = sorted(p for p in others if hashes.get(p) != ours)
        if silent and not self._final_probed:  # a member killed in the last rounds never announces one
            self._final_probed = True
            silent = sorted(set(silent) - set(self.swarm.membership.drop_gone(silent, boundary)))
        return not silent

    def after_boundary(self, boundary: int, state_hash: str, outcome: RoundOutcome) -> None:
        self._publish(boundary, state_hash=state_hash, outcome=outcome)
        if not self._settled and outcome.applied:  # started: trained a round and took its average (priority.py)
            self._settled = True
            settle(self.cfg.swarm.settled_nice, own_session=self.spec.own_session)

    def _publish(self, boundary: int, *, state_hash: str = "", outcome: RoundOutcome | None = None) -> None:
        """Announce the state held at `boundary` (its round record), and offer it to joiners once it is
        complete (delayed: once the pending average is in and its hash announced, so that a joiner can
        check it against the stage group's). The last boundary is checked by settle_final, not in the
        background."""
        average = outcome.last if outcome is not None else None
        self.swarm.agreement.publish(
            boundary,
            state_hash or self.outer.hash(),
            check=boundary < self.rounds,
            group_size=(outcome.group_size if outcome is not None else None) or 0,
            coverage=outcome.coverage if outcome is not None else 1.0,
            kind=average.kind.value if average is not None else "",
        )
        self._announced = boundary
        future = self.outer.pending_future()
        if future is not None and not future.done():
            self.swarm.set_state(boundary, ready=False)
        if future is not None:
            future.add_done_callback(lambda done: self._offer(boundary, done))  # at once if done
        else:
            self._offer(boundary)

    def _offer(self, boundary: int, future: Future[Average] | None = None) -> None:
        """The state of `boundary` is complete (`future`, its pending average, is done): announce the
        average's hash and let joiners download the state, unless the worker already moved on (a state
        kept for a waiting joiner is checked against this hash too)."""
        if future is not None:
            average = future.result()
            if average.kind.applies:
                self.swarm.agreement.publish_pending(boundary, average_hash(average.tensors, average.missing))
        if self.outer.boundary != boundary:
            return  # the worker moved on; its next boundary is offered instead
        known, _ = self.outer.known_pending()
        self._offered = boundary
        self.swarm.set_state(boundary, ready=known)
