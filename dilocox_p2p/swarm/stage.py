"""A stage worker's place in the swarm: its DHT node, averager, and the parts built on them.

    SwarmStage
      dht, records        the worker's DHT node and typed access to the run's records (dht.py)
      averager            hivemind averager process: exact all-reduce or message gather, average and state serving
      codecs              with compression: this worker's encoder/decoder and error feedback (compression/),
                          one per streaming fragment
      heartbeat           this worker's member record, refreshed every few seconds and pushed to the
                          others when it changes (member_push.py)
      membership          who else trains this stage; admission (membership.py)
      exchanges           one background exchange per round (exchange.py): the Averager protocol
      agreement           round records, hash checks, verified state downloads (agreement.py)
      routes              routes back into the DHT after this worker lost them (reconnect.py)
      faults              counted faults, handed to metrics.jsonl every round (faults.py)
      deadlines           the all-reduce, chunk and state deadlines, learned from what exchanges took (deadlines.py)
      wire                bytes the worker's p2p daemon moved, every kind of traffic (wire_meter.py)
      sources             those bytes' messages by what they are for: exchange, matchmaking, DHT... (protocol_bytes.py)
      signer, gate        this worker's signature on what it sends, and the checks on what it takes
                          (envelope.py); strikes and bans of misbehaving peers (`strike`)
"""

from __future__ import annotations

import collections
import json
import logging
import os
import time
from collections.abc import Sequence
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import torch
from hivemind.utils import get_dht_time

from .. import injection
from ..average import Average, AverageKind, all_finite
from ..compression.codec import StageCodec
from ..fragments import as_fragments, fragment_of, of_round
from ..config import Config, config_hash, shared_fields
from ..endpoints import loopback_only
from ..identity import peer_id_of, worker_identity
from ..wire import swarm_pb2
from .agreement import Agreement
from .averager import DilocoxAverager
from .credentials import Credentials
from .dht import EnvelopeValidator, RunRecords, reachable_maddrs, run_keys, start_dht
from .deadlines import Deadlines
from .dht_process import shutdown_whole
from .dial_back import report_reachability
from .exchange_queue import ExchangeQueue
from .faults import FaultCounter
from .group_reuse import RoundTicket, WholeGroup, reuse_group_id
from .heartbeat import Heartbeat
from .hello import serve_hello
from .hivemind_patches import check_version
from .member_push import PushedAverages
from .membership import Membership
from .protocol_bytes import SourceBytes, count_by_source
from .reconnect import RouteKeeper, join_lead
from .wire_meter import WireMeter, daemons_below, relay_endpoints, relayed_connections, relayed_endpoints

__all__ = ["SwarmStage"]

logger = logging.getLogger(__name__)

TICKETS_KEPT = 4  # rounds whose tickets a worker keeps for their exchanges (group_reuse.py)

RELAYS_READ_S = 5.0  # the daemon's connections are listed this often at most (relayed ones: wire_meter.py)


class SwarmStage:
    """One stage worker's DHT node + averager, and the Averager the outer loop uses."""

    def __init__(
        self,
        cfg: Config,
        *,
        stage: int,
        tensors: Sequence[torch.Tensor],
        names: Sequence[str],
        fragments: Sequence[Sequence[int]] | None = None,
        run_dir: Path,
        peer_name: str,
        extra_peers: Sequence[str] = (),
    ):
        check_version()
        self.cfg, self.stage, self.sw = cfg, stage, cfg.swarm
        self.config_hash = config_hash(cfg)
        self.shared_json = json.dumps(shared_fields(cfg), sort_keys=True)
        self.faults = FaultCounter()
        credentials = Credentials.load(cfg)
        key_path = run_dir / "identity" / f"stage{stage}.ed25519"
        worker_key = worker_identity(key_path)
        self.signer = credentials.signer(worker_key, peer_id_of(worker_key), stage=stage, peer_name=peer_name)
        self.peer_key_hex = credentials.public_hex
        self.gate = credentials.gate()
        self.strikes: collections.Counter[str] = collections.Counter()
        self._refused_seen = 0
        validator = EnvelopeValidator(credentials.gate(), run_keys(cfg.run.run_id, self.config_hash))
        # with initial peers, every stage bootstraps from them (and from stage 0); without, the other stages start
        # their nodes beside stage 0's and join it once it listens (reconnect.join_lead)
        lead = [] if self.sw.initial_peers else list(extra_peers)
        self.sources = SourceBytes(own_keys=key_path.parent)
        count_by_source(self.sources)  # before the DHT and the averager fork: they count into it too
        self.dht = start_dht(cfg.swarm, stage=stage, identity_path=key_path, validator=validator,
                             extra_peers=[] if lead else extra_peers)  # fmt: skip
        if lead:
            try:
                join_lead(self.dht, lead)
            except BaseException:
                shutdown_whole(self.dht)
                raise
        serve_hello(self.dht, role="peer", run_id=cfg.run.run_id)  # `dilocox-peer doctor` tells a dilocox node by it
        self.peer_id = self.dht.peer_id.to_base58()
        self.records = RunRecords(self.dht, cfg.run.run_id, stage, self.faults, signer=self.signer, gate=self.gate)
        # streaming: the tensors each sync round averages (fragments.py); one codec per fragment, each with
        # its own error feedback and low-rank state
        self.fragments = as_fragments(fragments, len(tensors))
        self.codecs: list[StageCodec] = []
        if cfg.compression.kind != "none":
            self.codecs = [
                StageCodec(
                    cfg.compression, [names[i] for i in f], [tensors[i].shape for i in f], run_id=cfg.run.run_id,
                    max_norm_ratio=self.sw.max_norm_ratio, clip_ratio=self.sw.clip_ratio,
                    direction_screen=self.sw.direction_screen,
                )  # fmt: skip
                for f in self.fragments
            ]
        self.deadlines = Deadlines(self.sw)
        self.averager = DilocoxAverager(
            [t.detach().to("cpu", torch.float32, copy=True) for t in tensors],
            self.dht,
            run_id=cfg.run.run_id,
            config_hash=self.config_hash,
            stage=stage,
            nice=max(self.sw.helper_nice, 0),
            max_message_bytes=max((c.max_message_bytes for c in self.codecs), default=0),
            fragments=self.fragments,
            signer=self.signer,
            gate=self.gate,
            max_norm_ratio=self.sw.max_norm_ratio,
            clip_ratio=self.sw.clip_ratio,
            direction_screen=self.sw.direction_screen,
            prefix=f"{cfg.run.run_id}_{self.config_hash[:16]}_s{stage}",
            start=True,
            min_group_size=self.sw.min_group_size,
            min_matchmaking_time=self.sw.round_wait,
            request_timeout=min(5.0, self.sw.round_wait / 2),
            allreduce_timeout=self.sw.allreduce_timeout,
            next_chunk_timeout=self.sw.chunk_timeout,
            allow_state_sharing=False,  # hivemind's own state sharing; ours is rpc_download_round
        )
        self.client = "swarm.reachability = client" if self.sw.reachability == "client" else ""
        """Why this worker averages as a client member ("": a full member): it reduces no span and leads no group."""
        self.said_no_reducer = False  # logged once: every member of the stage is a client member (exchange._leader)
        self.whole_group: WholeGroup | None = None  # the last round that averaged whole here (group_reuse.py)
        self.tickets: dict[int, RoundTicket] = {}  # round -> the ticket this worker made when it started it (same)
        self.heartbeat = Heartbeat(
            self.records,
            swarm_pb2.MemberRecord(
                run_id=cfg.run.run_id,
                config_hash=self.config_hash,
                stage=stage,
                boundary=-1,
                joined_at=get_dht_time(),
                peer_name=peer_name,
                client=bool(self.client),
            ),
        )
        self.membership = Membership(self.records, config_hash=self.config_hash, faults=self.faults)
        # a changed record goes straight to the others too, and theirs come here (member_push.py)
        self.membership.pushed = self.averager.pushed_records
        self.pushed_averages = PushedAverages(self.averager.pushed_averages, self.records)  # phase 5's (vote.py)
        self.heartbeat.on_change = self._push_member
        self.exchanges = ExchangeQueue(self)
        self.agreement = Agreement(self.records, self.averager, self.membership, self.sw, self.faults, self.deadlines)
        self.routes = RouteKeeper(
            self.dht, initial_peers=[*self.sw.initial_peers, *extra_peers], faults=self.faults,
            members=lambda: {m.peer_id: m.record.training for m in self.membership.members()},
        )  # fmt: skip
        self.membership.prober = self.routes.gone
        self._daemon: int | None = None
        # every byte the stage moves through the swarm, for the metrics; the peer's stages fork from one process
        self._relays_seen: set[str] = relay_endpoints(self.sw.initial_peers) if self.sw.auto_relay else set()
        self._relays_pending: Any = None
        self._relays_next = 0.0
        self.wire = WireMeter(self._daemon_pid, own=lambda: daemons_below(os.getppid()), relays=self._relays)
        self._closed = False
        if self.sw.reachability == "auto" and self.sw.initial_peers and not loopback_only(self.sw.host_maddrs):
            # behind NAT? asked in the background (each stage listens on a port of its own), said once
            report_reachability(self.dht, self.sw.initial_peers, on_verdict=self._reached)

    def _reached(self, reachable: bool, found: str) -> None:
        """The dial-back's verdict: a worker the swarm cannot dial averages as a client member from its next round."""
        if reachable or self.client:
            return
        self.client = "the swarm cannot dial it" + (" (behind a NAT)" if "behind a NAT" in found else "")
        logger.warning("stage %d averages as a client member from its next round: it sends its parts to the others and "
                       "takes the average over connections it opens, reduces nothing and leads no group", self.stage)
        self.heartbeat.update(client=True, wait=False)

    def fragment_indices(self, round: int) -> list[int]:
        """The tensors (stage parameter indices) that round `round` averages."""
        return of_round(self.fragments, round)

    def learn_deadlines(self, round: int, average: Average) -> None:
        """What the exchange of `round` took teaches the stage's deadlines (deadlines.py), and the averager process
        gets the new ones: an all-reduce that averaged, its seconds from the group's start; one that its deadline
        ended while it still moved (fp32: the averager saw hivemind's deadline fire with parts still coming), a
        longer deadline. A compressed round that missed parts is not counted either way: a member that died leaves
        the same trace as a slow one there, and must not stretch everyone's deadlines. Never raises: a failure costs
        the lesson, never the round."""
        try:
            self._learn_deadlines(round, average)
        except Exception as e:  # noqa: BLE001
            logger.warning("round %d: the deadlines could not learn from the exchange: %r", round, e)

    def _learn_deadlines(self, round: int, average: Average) -> None:
        phases = dict(average.phases)
        moving = sum(phases.get(k, 0.0) for k in ("transfer", "phase2", "mend"))
        if average.kind is AverageKind.AVERAGED and len(average.group) >= 2:
            self.deadlines.exchanged(moving)
        elif self.codec_for(round) is None and self.averager.ran_out(round):
            was = self.deadlines.allreduce
            self.deadlines.exchange_ran_out()
            logger.info("round %d: the all-reduce was still moving when its deadline (%.1f s) ended it: the next may "
                        "take %.1f s", round, was, self.deadlines.allreduce)  # fmt: skip
        self.averager.set_deadlines(self.deadlines.allreduce, self.deadlines.chunk)

    def _round_ticket(self, round: int) -> RoundTicket | None:
        """This worker's ticket for round `round`, for its record: the others of a whole group form the round's group
        from their records without matchmaking (group_reuse.py; None where groups are not reused). Low-rank's ranks
        in it are those this worker holds now: where an earlier exchange still runs, it may change them, and a reused
        group then agrees on ranks a round older than matchmaking's would (the same at every member)."""
        if not self.sw.reuse_groups:
            return None
        codec = self.codec_for(round)
        ranks = tuple(codec.ranks[i] for i in codec.factored) if codec is not None else ()
        ticket = self.averager.seal_ticket(round, ranks, client=bool(self.client))
        return RoundTicket(round, ticket, self.averager.gathered_for(ticket), ranks)

    def codec_for(self, round: int) -> StageCodec | None:
        """The codec of the fragment round `round` averages (None without compression)."""
        return self.codecs[fragment_of(round, len(self.fragments))] if self.codecs else None

    # ----- lifecycle -------------------------------------------------------------------------
    def start(self) -> None:
        self.heartbeat.start(first=lambda: self.records.publish_config(self.config_hash, self.shared_json))
        self.membership.start()
        self.heartbeat.push_now()  # the first push went to nobody: the members were not read yet
        self.exchanges.start()
        self.agreement.start()
        self.routes.start()

    def _daemon_pid(self) -> int | None:
        if self._daemon is None and self.dht.pid is not None:
            self._daemon = min(daemons_below(self.dht.pid), default=None)
        return self._daemon

    def _relays(self) -> set[str]:
        """The relay nodes this worker reserved its slots on (--auto-relay: its initial peers) and those any of its
        relayed connections went through (wire_meter.relayed_endpoints), as the daemon listed them; asked again in
        the background every RELAYS_READ_S (the meter is read as an exchange ends, which must not wait for the DHT
        process)."""
        pending = self._relays_pending
        if pending is not None and pending.done():
            self._relays_pending = None
            try:
                self._relays_seen |= relayed_endpoints(pending.result())
            except Exception as e:  # noqa: BLE001 - the DHT process stopping: no new list, the old one holds
                logger.debug("could not list this worker's connections: %r", e)
        if self._relays_pending is None and time.monotonic() >= self._relays_next and self.dht.is_alive():
            self._relays_pending = self.dht.run_coroutine(relayed_connections, return_future=True)
            self._relays_next = time.monotonic() + RELAYS_READ_S
        return self._relays_seen

    def _push_member(self, value: bytes, expiration: float) -> None:
        """Send this worker's changed member record (sealed, as stored) to the stage's other members."""
        peers = [m.peer_id for m in self.membership.members(suspects_too=True)]
        if peers and self.averager.is_alive():
            self.averager.push_member(value, expiration, peers)

    def maddrs(self) -> list[str]:
        return reachable_maddrs(self.dht)

    def close(self) -> None:
        if self._closed:
            return
        self._closed = True
        steps: list[tuple[str, float]] = []
        started = time.monotonic()

        def done(name: str) -> None:
            steps.append((name, time.monotonic() - started - sum(s for _, s in steps)))

        self.exchanges.abandon_before(2**62)  # an exchange still running is of no use any more
        self.exchanges.close(timeout=self.deadlines.allreduce)
        done("exchanges")
        try:
            self.heartbeat.stop(leave=True, linger=self.membership.refused_here)  # a refused worker's, for the run
        except Exception as e:  # pragma: no cover - best effort on the way out
            logger.info("could not publish the leave record: %s", e)
        done("heartbeat")
        self.routes.close()
        done("routes")
        self.membership.close()
        done("membership")
        self.agreement.close()
        done("agreement")
        for name, process in (("averager", self.averager), ("dht", self.dht)):
            if process.is_alive():  # killed with the process group already: hivemind would log an error
                process.shutdown()
            done(name)
        total = sum(s for _, s in steps)
        logger.log(logging.INFO if total > 2 else logging.DEBUG, "left the swarm in %.1f s: %s", total,
                   ", ".join(f"{name} {s:.1f}" for name, s in steps))

    def set_state(self, boundary: int, *, ready: bool, training: bool | None = None, taken: bool = False) -> None:
        """Tell joiners (averager) and members (heartbeat) where this worker's state is, and (if given)
        whether it trains: members wait for workers that train, not for one that resyncs. `taken`: this worker
        starts training at `boundary` (it started there or took the swarm's state of it), so no member waits
        for it in the all-reduce of an earlier round (MemberRecord.first_round)."""
        self.averager.set_state_boundary(boundary, ready)
        fields: dict[str, Any] = {} if training is None else {"training": training}
        if taken:
            fields["first_round"] = boundary
        self.heartbeat.update(boundary=boundary, state_ready=ready, wait=False, **fields)

    def take_faults(self) -> dict[str, int]:
        """This worker's fault counts since the last call, the averager process's refusals included."""
        counts = self.faults.take()
        total = self.averager.refused_total()
        counts["requests_refused"] += total - self._refused_seen
        self._refused_seen = total
        return counts

    def strike(self, peer_id: str, reason: str) -> None:
        """`peer_id` sent something refused (a non-finite or outsized contribution, a bad message): logged
        with the reason; after swarm.ban_after strikes it is banned for the rest of the run."""
        if peer_id == self.peer_id:
            return
        self.strikes[peer_id] += 1
        n = self.strikes[peer_id]
        self.faults.count("contributions_refused", "%s's contribution refused (strike %d of %d): %s",
                          peer_id, n, self.sw.ban_after, reason)  # fmt: skip
        if n == self.sw.ban_after:
            self._ban(peer_id, f"after {n} strikes (last: {reason})")

    def convict(self, peer_id: str, reason: str) -> None:
        """`peer_id` is proven to have lied (two different messages it signed for one purpose): struck and banned
        for the rest of the run at once, logged with the proof."""
        if peer_id == self.peer_id or peer_id in self.membership.banned():
            return
        self.strikes[peer_id] += 1
        self.faults.count("contributions_refused", "%s proven to lie (strike %d, banned at once): %s",
                          peer_id, self.strikes[peer_id], reason)  # fmt: skip
        self._ban(peer_id, f"at once: {reason}")

    def _ban(self, peer_id: str, why: str) -> None:
        self.faults.count("peers_banned", "banned %s for the rest of the run %s", peer_id, why, level=logging.ERROR)
        keys = [key] if (key := self.records.key_of(peer_id)) else []  # every worker its peer key certifies, too
        self.gate.ban([peer_id], keys)
        self.membership.ban([peer_id], keys)

    # ----- the Averager protocol ---------------------------------------------------------------------
    def all_reduce(self, tensors: Sequence[torch.Tensor], *, round: int) -> Future[Average]:
        if injection.armed("nan_pseudo_gradient", round=round, stage=self.stage):
            tensors[0].view(-1)[0] = float("nan")
        finite = all_finite(tensors)
        # tells the others this round is ready to average, or that this worker sits it out (nothing to send). The
        # record keeps the latest round sat out (swarm.proto): reset at the next round, it was gone before a slower
        # member read it, which then counted this worker into that round's group and waited round_wait for it (CI)
        sitting = {} if finite else {"sitting_out": round + 1}
        ticket = self._round_ticket(round) if finite else None
        if ticket is not None:  # kept until its exchange runs: in delayed mode a later round may start before
            self.tickets = {r: t for r, t in self.tickets.items() if r > round - TICKETS_KEPT} | {round: ticket}
            members = [self.peer_id, *(m.peer_id for m in self.membership.members(training_only=True))]
            self.averager.expect_group(round, reuse_group_id(self.cfg.run.run_id, self.stage, round, members))
        gathered = ticket.gathered if ticket is not None else b""
        self.heartbeat.update(averaging_round=round, gathered=gathered, wait=False, **sitting)
        # a worker alone in the run goes through the exchange too: it holds its average of one, which a
        # member that shows up during the round (a restarted peer) borrows to stay in agreement
        return self.exchanges.submit(round, list(tensors), finite=finite)
