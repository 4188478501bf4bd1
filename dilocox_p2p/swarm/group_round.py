"""What a worker does in its group once matchmaking formed it (the averager process's side).

fp32: the exact butterfly (allreduce.py), whose average this worker then holds and serves to
members that mend or borrow it (held.py). Quantized (fp16, int8, fp4) and top-k: the first step of the
compressed butterfly, each member's message cut into parts for the group's reducers
(compression/butterfly.py, gather.py's scatter); the stage worker reduces its span and the
reduced parts are all-gathered. Low-rank: only the group, and the ranks most members' tickets
name; the worker then encodes and sends both phases through the butterfly (`scatter_phase`).
Top-k with compression.topk_transport = "gather": the all-gather of the round's messages (gather.py),
decoded by the stage worker. Either
way the round's `RoundResult` goes back to the worker. The averager (averager.py) mixes this in
before hivemind's DecentralizedAverager, whose `_run_allreduce_inplace_` it replaces
(hivemind_patches.py).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
from hivemind.averaging.allreduce import AveragingMode
from hivemind.averaging.control import AveragingStage
from hivemind.averaging.group_info import GroupInfo
from hivemind.utils import MPFuture

from .. import injection
from ..average import AverageKind, Spans
from ..compression.butterfly import cut_all, rides_butterfly
from .allreduce import ExactAllReduceRunner
from .client_member import reach_members, reducers_of
from .held import HeldAverage

__all__ = ["GATHER_SHARE", "GroupRound", "RoundResult"]

GATHER_SHARE = 0.7  # share of allreduce_timeout the first gather of a compressed round may take


@dataclass
class RoundResult:
    """What one all-reduce did, reported back to the stage worker (the tensors are in the averager's buffers)."""

    round: int
    group: list[str]
    group_id: bytes
    missing: Spans
    bytes_sent: int = 0
    bytes_received: int = 0
    failed_reducers: list[str] = field(default_factory=list)
    banned_senders: list[str] = field(default_factory=list)
    outsiders: list[str] = field(default_factory=list)
    """Members the leader counted in that never learnt of the group (they hold no copy of its average)."""
    offenders: dict[str, str] = field(default_factory=dict)
    """Members whose contribution (as sender) or average (as reducer) was refused here, and why."""
    messages: list[bytes | None] | None = None
    """With compression: the group's phase-1 messages, in group order (None: never received); for the
    compressed butterfly (compression/butterfly.py) the parts of this worker's span of them."""
    failures: list[str] = field(default_factory=list)
    grouped_at: float | None = None
    """Unix time the group formed (matchmaking ended, the all-reduce or gather began)."""
    deferred: bool = False
    """Low-rank: the step only formed the group; the worker sends its messages at `ranks` (scatter_phase)."""
    ranks: list[int] = field(default_factory=list)
    """Low-rank: the group's rank of each factored matrix, the one most members' tickets named."""
    clients: list[str] = field(default_factory=list)
    """The group's client members (their signed tickets say so): they reduce no span, the others reduce it all."""
    digests: list[bytes] = field(default_factory=list)
    """The fp32 butterfly: the reducers' signed digests of the averaged spans this worker received (phase 5)."""

    @property
    def reducers(self) -> list[str]:
        """The members that reduce a span, in group order: all but the client members."""
        return reducers_of(self.group, self.clients)

    def alone_with_outsiders(self, me: str, elsewhere: Iterable[str] = ()) -> bool:
        """Whether every other member of `me`'s group was counted in after it had given up on the leader, or, asked
        for the spans `me`'s all-reduce missed, answered with the round's average of another group (`elsewhere`):
        those joined other groups of the round, and this "average" is `me`'s own. `me` borrows theirs instead (kept,
        it would be a minority state: repaired a round later), and never serves it as the group's. `elsewhere`: a
        pair that formed its last group again without matchmaking (group_reuse.py) while one of them, which had read
        a joiner's record, followed the joiner; the reused group's part streams waited in hivemind for a group that
        never began at that member, past the reuser's timeouts, which took it for a failed reducer and held a partial
        average of its own pseudo-gradient; applied, it split the swarm (CI, test_elastic, a late joiner's rounds)."""
        outside = {*self.outsiders, *elsewhere}
        return bool(outside) and set(self.group) - outside <= {me}


class GroupRound:
    """Mixin for DilocoxAverager: run the round's exchange in the group matchmaking formed."""

    _current_round: int
    _payload: bytes | None
    _running_groups: dict[bytes, Any]
    _grouped_at: float | None
    _last_result: RoundResult | None
    _group_ranks: list[int]
    _group_clients: frozenset[str]
    _allreduce_timeout: float
    chunk_timeouts: Any
    max_norm_ratio: float
    clip_ratio: float
    direction_screen: bool
    stage: int
    prefix: str
    peer_id: Any
    _p2p: Any
    signer: Any
    gate: Any

    async def _step(self, *, step: Any, future_for_init: MPFuture) -> None:
        """hivemind's step of a round. Fault injection `lose_step`: its end never reaches the stage worker."""
        if injection.armed("lose_step", round=self._current_round, stage=self.stage):
            await _lost_step(step, future_for_init)
            return
        await super()._step(step=step, future_for_init=future_for_init)  # type: ignore[misc]

    async def _run_allreduce_inplace_(
        self, tensors: Sequence[torch.Tensor], group_info: GroupInfo, group_id: bytes | None = None, **kwargs: Any
    ) -> None:
        group_id = group_info.group_id if group_id is None else group_id
        round = self._current_round
        tensors = self._of_round(round, tensors)
        clients = self._group_clients
        if clients:  # the reducers split the vector evenly; a client member (fraction 0) only sends and receives
            reducers = len(group_info.peer_ids) - len(clients)
            kwargs["peer_fractions"] = tuple(0.0 if p.to_base58() in clients else 1.0 / reducers
                                             for p in group_info.peer_ids)  # fmt: skip
            if self.peer_id.to_base58() in clients:
                reach_members(self._p2p, [p for p in group_info.peer_ids if p.to_base58() not in clients])
        if self._payload is not None:  # compressed: the messages' own exchange instead of the fp32 butterfly
            self._running_groups[group_id].set_result(None)  # no butterfly parts will arrive for this group
            if not self._payload:  # low-rank: the worker encodes at the group's ranks, then scatters (scatter_phase)
                peers = [p.to_base58() for p in group_info.peer_ids]
                self._last_result = RoundResult(round=round, group=peers, group_id=group_id, missing=(), deferred=True,
                                                ranks=list(self._group_ranks), grouped_at=self._grouped_at,
                                                clients=sorted(clients))  # fmt: skip
                return
            await self._gather_first_phase(round, group_info, group_id)
            return
        kwargs.update(self.chunk_timeouts())  # the stage's deadline now (deadlines.py), not hivemind's from its start
        runner = ExactAllReduceRunner(
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            kill_on_first_part=injection.armed("kill_peer_in_allreduce", round=round, stage=self.stage),
            withhold=injection.armed("withhold_average", round=round, stage=self.stage),
            hoard=injection.armed("hoard_average", round=round, stage=self.stage),
            read_late=injection.armed("read_averages_late", round=round, stage=self.stage),
            nan_average=injection.armed("send_nan_average", round=round, stage=self.stage),
            malformed_parts=next((shape for shape in ("scalar", "wide") if injection.armed(
                "send_malformed_parts", round=round, stage=self.stage, shape=shape)), ""),  # fmt: skip
            max_norm_ratio=self.max_norm_ratio,
            clip_ratio=self.clip_ratio,
            direction_screen=self.direction_screen,
            signer=self.signer,
            gate=self.gate,
            equivocate=injection.armed("equivocate_reduced", stage=self.stage),
            flip=injection.armed("flip_served_bit", stage=self.stage),
            **kwargs,
        )
        assert group_id in self._running_groups, f"Group id {group_id} was not registered in _register_allreduce_group"
        self._running_groups[group_id].set_result(runner)
        if runner.modes[group_info.peer_ids.index(self.peer_id)] == AveragingMode.AUX:
            async for _ in runner:
                raise ValueError("aux peers should not receive averaged tensors")
            return
        outputs = [averaged async for averaged in runner]  # local tensors stay untouched until the end
        missing = runner.failed_spans()
        for tensor, averaged in zip(tensors, outputs):
            tensor.copy_(averaged)
        peers = tuple(p.to_base58() for p in group_info.peer_ids)
        kind = AverageKind.PARTIAL if missing else AverageKind.AVERAGED
        self._last_result = RoundResult(
            round=round,
            group=list(peers),
            group_id=group_id,
            missing=missing,
            bytes_sent=runner.bytes_sent,
            bytes_received=runner.bytes_received,
            failed_reducers=[peers[i] for i in sorted(runner.failed_from)],
            banned_senders=[p.to_base58() for p in runner.banned_senders],
            outsiders=sorted(p.to_base58() for p in runner.outsiders),
            offenders=runner.offenders(),
            grouped_at=self._grouped_at,
            clients=sorted(clients),
            digests=[runner.reducer_digests[i] for i in sorted(runner.reducer_digests)],
        )
        # a member whose every other member was an outsider holds no average of the group: served, a member that
        # had given up on this group borrowed this worker's own half-reduced parts and split from the rest (busy run)
        if not self._last_result.alone_with_outsiders(self.peer_id.to_base58()):
            self._hold(HeldAverage(round, kind, outputs, missing, peers, group_id))

    async def _gather_first_phase(self, round: int, group_info: GroupInfo, group_id: bytes) -> None:
        peers = [p.to_base58() for p in group_info.peer_ids]
        # well inside hivemind's own timeout of the step, so that a member that never shows (its
        # matchmaking failed after the group formed) costs its message, not the whole round
        deadline = time.monotonic() + GATHER_SHARE * self._allreduce_timeout
        payload, me, clients = self._payload, self.peer_id.to_base58(), self._group_clients
        assert payload is not None
        reducers = reducers_of(peers, clients)
        if rides_butterfly(payload, len(peers)):  # each reducer reduces its span of the group's messages (butterfly.py)
            gathered = await self._scatter(group_id, 1, peers, me, cut_all(payload, len(reducers)), deadline,
                                           reducers=reducers)  # fmt: skip
        else:
            gathered = await self._all_gather(group_id, 1, peers, me, payload, deadline, clients=clients)
        self._last_result = RoundResult(
            round=round,
            group=peers,
            group_id=group_id,
            missing=(),
            bytes_sent=gathered.bytes_sent,
            bytes_received=gathered.bytes_received,
            messages=gathered.messages,
            failures=gathered.failures,
            offenders=gathered.offenders,
            outsiders=gathered.outsiders,
            grouped_at=self._grouped_at,
            clients=sorted(clients),
        )

    async def _gather_phase(
        self, phase: int, payload_size: int, group: list[str], group_id: bytes, timeout: float, future: MPFuture,
        scatter: bool = False, clients: Sequence[str] = (), authors: Sequence[str] | None = None,
        takers: Sequence[str] = (),
    ) -> None:  # fmt: skip
        """`authors`: the members whose messages are gathered (default: the whole group; the reduced parts: the
        reducers); `clients`: the group's client members; `takers`: gather._all_gather's."""
        try:
            payload, me = self._unstage(payload_size), self.peer_id.to_base58()
            deadline = time.monotonic() + timeout
            reducers = reducers_of(group, clients)
            if scatter:
                gathered = await self._scatter(group_id, phase, group, me, cut_all(payload, len(reducers)), deadline,
                                               reducers=reducers)  # fmt: skip
            else:
                gathered = await self._all_gather(group_id, phase, group if authors is None else authors, me, payload,
                                                  deadline, clients=clients, takers=takers)  # fmt: skip
            future.set_result(gathered)
        except Exception as e:  # pragma: no cover - reported to the caller
            future.set_exception(e)


async def _lost_step(step: Any, future_for_init: MPFuture) -> None:
    """Fault injection `lose_step`: a step that says it runs its all-reduce and never ends, as one whose result
    hivemind's MPFuture failed to deliver (the stage worker's own deadline ends it: exchange._step_overdue)."""
    trigger, cancel = MPFuture(), MPFuture()
    step.attach(trigger, cancel)
    future_for_init.set_result((trigger, cancel))
    step.stage = AveragingStage.RUNNING_ALLREDUCE
    await step.wait_for_cancel()  # then left pending, as lost
