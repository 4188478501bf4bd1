"""The record of one round that the lead stage writes to metrics.jsonl (metrics.py), from every stage's facts.

Each field is documented in the README ("Metrics"); the per-stage lists are in stage order.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .round_outcome import RoundOutcome
    from .worker import StageWorker

__all__ = ["round_record"]


def round_record(peer: StageWorker, t: int, stages: list[dict[str, Any]]) -> dict[str, Any]:
    """Round `t`'s record: `stages` holds each stage's facts (StageWorker.run_round), `peer` is the lead stage."""
    outcomes: list[RoundOutcome] = [s["outcome"] for s in stages]
    seconds_round = max(s["seconds_round"] for s in stages)
    faults: dict[str, int] = {}
    for s in stages:
        for name, count in s["faults"].items():
            faults[name] = faults.get(name, 0) + count
    return {
        "round": t,
        "train_loss": next((s["train_loss"] for s in stages if s["train_loss"] is not None), None),
        "val_loss": next(s["val_loss"] for s in stages if s["val_loss"] is not None),
        "tokens": peer.tokens,
        "tokens_per_s": peer.round_tokens / seconds_round,
        "seconds_compute": max(s["seconds_compute"] for s in stages),
        # the inner loop alone, as a plain training loop would count it (benchmarks/inner_reference.py)
        "inner_tokens_per_s": peer.round_tokens / max(s["seconds_compute"] for s in stages),
        "peak_gpu_bytes": [s["peak_gpu_bytes"] for s in stages],  # per stage, since its start; None on CPU
        "seconds_comm_wait": max(o.seconds_wait for o in outcomes),
        "seconds_round": seconds_round,
        "bytes_sent": sum(o.bytes_sent for o in outcomes),
        "bytes_received": sum(o.bytes_received for o in outcomes),
        # the stages' exchanges run side by side on the peer's link: their rates add up
        "bytes_per_s": sum(o.bytes_per_s for o in outcomes),
        # per stage, [sent, received]: every byte its p2p daemon's sockets moved since the last record (DHT,
        # matchmaking, requests, phase 5, state downloads: swarm/wire_meter.py); null where unknown
        "wire_bytes": [list(s["wire"]) if s["wire"] is not None else None for s in stages],
        # per stage, {source: [sent, received]}: the messages among those bytes by what they are for (exchange,
        # matchmaking, dht, pushes, held, state, hello, other; own_stages, not on the wire): the wire's bytes less
        # the others' sum are libp2p's own (encryption, multiplexing, negotiation, pings): swarm/protocol_bytes.py
        "wire_by_source": [s["sources"] for s in stages],
        # per stage, [sent, received] of those bytes on connections to nodes that relay a connection of this stage
        # (circuit relay, behind NAT): what was relayed, and those nodes' own traffic with it (swarm/wire_meter.py)
        "wire_via_relays": [list(s["relayed"]) if s["relayed"] is not None else None for s in stages],
        "fp32_bytes": [s["fp32_bytes"] for s in stages],  # each stage's pseudo-gradient averaged this round
        "params": peer.n_params_peer,
        "stage_hashes": [s["hash"] for s in stages],
        "fragment": peer.outer.fragment_number(t),
        "fragment_hashes": [s["fragment_hashes"] for s in stages] if peer.syncs > 1 else None,
        "group_size": min((o.group_size for o in outcomes if o.group_size is not None), default=None),
        "group_sizes": [o.group_size for o in outcomes],
        # per stage, the id of the group whose average was applied: members of one group hold one state after it
        "groups": [o.last.group_id.hex()[:16] if o.last is not None and o.last.group_id else None for o in outcomes],
        # per stage, whether that group formed without matchmaking: the last round's whole group (swarm/group_reuse.py)
        "groups_reused": [o.last is not None and o.last.group_reused for o in outcomes],
        "kinds": [o.kind.value if o.kind is not None else None for o in outcomes],
        "clients": [s["client"] for s in stages],  # per stage, why it averaged as a client member ("": it did not)
        "applied_round": outcomes[0].applied_round,
        "compute_windows": [s["compute_window"] for s in stages],
        "allreduce_windows": [o.window for o in outcomes],
        # per stage, seconds of each phase of the exchange applied (swarm/phase_clock.py)
        "exchange_phases": [dict(o.last.phases) if o.last is not None and o.last.phases else None for o in outcomes],
        # per stage, the unix time each of those phases last ended: members' side by side show who waited for whom
        "exchange_phase_ends": [dict(o.last.phase_ends) if o.last is not None and o.last.phase_ends else None
                                for o in outcomes],
        "coverage": min(o.coverage for o in outcomes),
        # per stage, compressed: the share of its message the applied average counted, which left its error-feedback
        # buffer (the rest is sent again); null without compression or an average (swarm/compressed_round.py)
        "counted_shares": [o.last.counted_share if o.last is not None else None for o in outcomes],
        "replaced_stages": [i for i, s in enumerate(stages) if s["replaced"]],
        # per stage, {donor peer id: bytes} of the states it took from the swarm since the last record (a joiner's,
        # a repair's, a catch-up's; in pieces from several donors at once: swarm/state_pieces.py)
        "state_donors": [s["state_donors"] for s in stages],
        # per stage, the all-reduce, chunk and state deadlines in force after this round (learned: swarm/deadlines.py)
        "deadlines": [s["deadlines"] for s in stages],
        "faults": faults,
        "compression": [s["compression"] for s in stages] if any(s["compression"] for s in stages) else None,
        "mode": peer.cfg.outer.mode,
        "time": time.time(),
    }
