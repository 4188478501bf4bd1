"""Fault injection for tests: break a peer at a precise point of the protocol.

Armed through the environment of the peer's processes, several separated by `;`:

    DILOCOX_FAULTS="kill_peer_in_allreduce:round=2:stage=0"

- `kill_peer_in_allreduce:round=R:stage=S` kills every process of the peer (its whole
  process group, as a power cut would) when stage S's averager receives the first tensor
  part of round R's all-reduce, or, where none reaches it (its group went on without it, or
  formed after it had given up), when its step of that round ends, before any average is taken.
- `kill_peer_mid_round:round=R:step=K:stage=S` kills every process of the peer the same way right after stage S's
  inner step K of round R (R counts records: syncs, in streaming), at a point of the round no timing decides.
- `withhold_average:round=R:stage=S` makes stage S's reducer keep the averaged parts of round
  R from the member after it in the group's order (it still counts that member's data):
  that member sees this reducer fail, the others do not, an asymmetric failure.
- `hoard_average:round=R:stage=S` makes stage S's reducer keep the averaged parts of round R
  from every other member and lend its copy of that round to nobody (a reducer whose uplink
  collapses once it has everyone's data): it holds the whole average, the others miss its span.
- `withhold_reduced:round=R:stage=S` makes stage S's reducer keep its reduced parts of round R's compressed
  butterfly from every other member (it answers that it does not hold them) and lend its copy of the average:
  the others miss its span, relay it from nobody, and fill it from its copy.
- `skip_mending:round=R:stage=S` makes stage S keep round R's average with the spans that
  missed it, without asking the other members for them (its requests would all time out).
- `abandon_accepted:round=R:stage=S` makes stage S drop every group its leader began with it in
  round R (BEGIN_ALLREDUCE), as a follower whose request_timeout ran out just before does: the
  leader counted it in, the group runs with a member that never learnt of it, and it goes on looking.
  Armed, it declares a later start than the others, so that it follows rather than leads.
- `lose_begin:round=R:stage=S` makes stage S drop its leader's BEGIN_ALLREDUCE of round R after that
  leader's ACCEPTED, as a follower whose answer stream closes there does: it knows it was accepted,
  and joins the group late when a part of it arrives. Armed, it declares a later start too.
- `skip_group_reuse:round=R:stage=S` makes stage S look for round R's group through matchmaking where it would
  form it again without (swarm/group_reuse.py), as a member that had not read another's record in time does: the
  others of its last round's group form it without it, and it joins their group late when their first part reaches it.
- `overlook_joiner:round=R:stage=S` makes stage S form its last round's group again without matchmaking in round R
  (without `round`: in every round) where it would look through matchmaking because a member outside that group
  started the round, as one that had not read that member's record in time does.
- `skip_regroup:round=R:stage=S` makes stage S, where it formed its last round's group again in round R because
  `overlook_joiner` left a member out (without `round`: in any such round) and that group held only outsiders, not
  look for a group once more, as one that learnt it after its round's wait was up does: it borrows the others'
  average. Elsewhere (a pair whose views of each other's tickets differed) it looks again as usual.
- `slow_first_beat:stage=S` makes stage S's heartbeat thread wait 30 s (or until the worker stops) before its first
  store, as one whose stores crawl on a loaded box does: a peer refused at admission leaves before any heartbeat of
  its was stored.
- `lose_step:round=R:stage=S` makes stage S's averaging step of round R say it runs its all-reduce and never end,
  as one whose result hivemind's MPFuture failed to deliver: the stage worker gives up on it past its deadlines.
- `read_averages_late:round=R:stage=S` makes stage S wait READ_LATE_S before it reads the averaged parts that
  reach it in round R's fp32 butterfly, as a member on a loaded machine does: they pile up in its p2p daemon.
- `drop_average:round=R:stage=S` makes stage S end round R's exchange stranded (nothing applied, not alike),
  after it took part in it, as a member whose leader's last answer was lost while the group went on with it.
- `hold_exchange_end:round=R:stage=S` makes stage S end round R's exchange HOLD_END_S late, its average in
  hand, as a member still waiting out a dead member's parts does: it reaches the next boundary that much later.
- `corrupt_state:round=R:stage=S` flips the lowest bit of theta_g's first value on stage S
  right after round R's outer step, as a memory error or a buggy peer would.
- `nan_pseudo_gradient:round=R:stage=S` puts a NaN into stage S's pseudo-gradient of round R,
  as a diverged or broken peer would produce.

Hostile peers (docs/security.md), which skip this peer's own checks:
- `send_nan_pseudo_gradient:round=R:stage=S` sends a pseudo-gradient full of NaN in round R.
- `send_huge_pseudo_gradient:round=R:stage=S` sends 1000x its pseudo-gradient in round R.
- `send_flipped_pseudo_gradient:round=R:stage=S` sends -4x its pseudo-gradient (without `round`: every round): far
  enough under the norm screen's bar (10x) that no part of it is struck, while the clip (1.5x) still weighs it as
  much as any larger flip.
- `send_nan_average:round=R:stage=S` makes stage S's reducer hand NaN averages to the others.
- `send_malformed_parts:round=R:stage=S:shape=scalar|wide` makes stage S send each reducer of round R's fp32
  butterfly parts of another shape: a scalar (the part's norm: the norm screen passes it) or the part stacked
  twice, (2, n).
- `lie_to_borrowers:round=R:stage=S` makes stage S serve a worker outside its group of round R (a borrower)
  the negated average, signed, with a group list naming only itself (so that the borrower would skip the vote),
  and announce its own copy of round R 2 s late (so that a borrower that votes early finds no other voter).
- `flip_served_bit:stage=S` flips one bit of every compressed message and average stage S
  serves to another member, and of every part and averaged part it sends in the fp32 butterfly
  (after signing it, as a faulty relay or link would).
- `equivocate_reduced:stage=S` makes stage S's reducer serve each member that asks for one of its
  reduced parts of the compressed butterfly, or that it sends its averaged span in the fp32 butterfly,
  other bytes (a bit flipped, another one for each) behind a digest it signs for them, and keep the
  true part itself (a reducer lying to its group).
- `corrupt_served_piece:stage=S` makes stage S serve every piece of its state (STATE_PIECE) with the lowest bit of
  its first value flipped, signed as it serves it (a donor that lies about the state it holds).
- `stall_served_piece:stage=S` makes stage S hold every request for a piece of its state (STATE_PIECE) 60 s
  before it answers (a donor on a link that has all but stopped).
- `cut_served_message:stage=S:serve=K` ends the K-th compressed message stage S serves halfway
  through (as a connection reset mid-reply reads in hivemind: a clean end of the stream); without
  `serve`, every one.
- `speak_other_protocol` signs with the next protocol version (a peer running other code).
- `ignore_admission` joins a closed run without the key or certificate it asks for.

Unset in normal runs; nothing here runs unless a fault is armed.
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

__all__ = ["FOLLOWER_FAULTS", "KNOWN", "armed", "first_armed", "flip_last_bit", "flip_lowest_bit", "kill_peer"]

logger = logging.getLogger(__name__)
ENV = "DILOCOX_FAULTS"
KNOWN = (
    "kill_peer_in_allreduce", "kill_peer_mid_round", "withhold_average", "withhold_reduced", "hoard_average", "read_averages_late", "skip_mending",
    "abandon_accepted", "lose_begin", "skip_group_reuse", "overlook_joiner", "skip_regroup", "slow_first_beat", "lose_step", "corrupt_state", "nan_pseudo_gradient",
    "drop_average", "hold_exchange_end",
    "send_nan_pseudo_gradient", "send_huge_pseudo_gradient", "send_flipped_pseudo_gradient", "send_nan_average", "send_malformed_parts",
    "lie_to_borrowers", "flip_served_bit", "cut_served_message", "corrupt_served_piece",
    "stall_served_piece",
    "equivocate_reduced",
    "speak_other_protocol", "ignore_admission",
)  # fmt: skip


def _parse(text: str) -> list[tuple[str, dict[str, str]]]:
    plans = []
    for item in filter(None, (s.strip() for s in text.split(";"))):
        name, *pairs = item.split(":")
        if name not in KNOWN:
            raise ValueError(f"{ENV}: unknown fault {name!r}; known: {', '.join(KNOWN)}")
        plans.append((name, dict(pair.split("=", 1) for pair in pairs)))
    return plans


def armed(name: str, *, quiet: bool = False, **context: object) -> bool:
    """True if a fault `name` is armed whose conditions all match `context` (logged unless `quiet`)."""
    text = os.environ.get(ENV, "")
    if not text:
        return False
    hit = any(n == name and all(str(context.get(k)) == v for k, v in cond.items()) for n, cond in _parse(text))
    if hit and not quiet:
        logger.warning("fault injection: %s (%s)", name, ", ".join(f"{k}={v}" for k, v in context.items()))
    return hit


FOLLOWER_FAULTS = ("abandon_accepted", "lose_begin")  # a follower's: armed, it declares later so that it follows


def first_armed(names: tuple[str, ...], **context: object) -> str:
    """The first of `names` armed for `context` ("" if none), unlogged (`armed` with quiet)."""
    return next((name for name in names if armed(name, quiet=True, **context)), "")


def flip_last_bit(blob: bytes) -> bytes:
    """`flip_served_bit`: the bytes with the lowest bit of the last one flipped."""
    return blob[:-1] + bytes([blob[-1] ^ 1])


def flip_lowest_bit(tensor: Any) -> Any:
    """`corrupt_served_piece`: a copy of the torch tensor with the lowest bit of its first value flipped."""
    import torch  # only where this fault is armed

    flipped = tensor.detach().clone().contiguous()
    raw = flipped.view(-1).view(torch.uint8)
    raw[0] ^= 1
    return flipped


def flip_middle_bit(blob: bytes, offset: int = 0) -> bytes:
    """`equivocate_reduced`: the bytes with the lowest bit of the one `offset` past the middle flipped (a value,
    not the framing)."""
    i = min(len(blob) // 2 + offset, len(blob) - 1)
    return blob[:i] + bytes([blob[i] ^ 1]) + blob[i + 1 :]


def kill_peer(reason: str) -> None:
    """SIGKILL the whole process group of this peer."""
    logger.error("fault injection: killing the peer (%s)", reason)
    os.killpg(os.getpgid(0), signal.SIGKILL)
