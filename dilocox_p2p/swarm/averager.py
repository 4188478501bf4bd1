"""hivemind's DecentralizedAverager, extended for DiLoCoX stage groups.

What changes against hivemind 1.1 (and why):
1. Exact averages. hivemind's butterfly returns *differences* (average - local) and each
   member adds them to its own tensors, so a + (avg - a) differs in the last bit from peer
   to peer. Here every member receives the reducer's averaged parts themselves, so the
   whole group holds bit-identical averages and hence bit-identical theta_g.
2. A failed reducer costs the same on every member. hivemind fills a dead reducer's parts
   with each member's *local* values (notes/hivemind-facts.md, trap 3), which leaves the
   peers different. Here the dead reducer's whole span is zero (no update for those
   coordinates this round) on every member, and the uncovered share is reported.
3. Groups are keyed by round (the group bits spell the round number) and the target
   group size is set per round from the stage's live members, so a round's group forms
   as soon as every live member is in, and never mixes two rounds.
4. Bytes sent and received are counted per all-reduce.
5. `rpc_download_round`: a joining or repairing worker downloads the state of a given
   round boundary (theta_g, momentum, pending average) from a live worker of its stage.
6. `rpc_download_average`: a worker whose own all-reduce failed (it was too slow, its
   leader vanished...) takes the average its group computed, instead of diverging.

Everything runs in hivemind's averager process; the stage worker talks to it through
`run_round`, `download_round` and the state it publishes with `set_state_boundary`.
"""

from __future__ import annotations

import asyncio
import ctypes
import logging
import multiprocessing as mp
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, AsyncIterator

import torch
from hivemind.averaging import DecentralizedAverager
from hivemind.averaging.allreduce import AllReduceRunner, AveragingMode
from hivemind.averaging.group_info import GroupInfo
from hivemind.averaging.partition import AllreduceException, BannedException, TensorPartReducer
from hivemind.compression import deserialize_torch_tensor, serialize_torch_tensor
from hivemind.p2p import P2PContext, PeerID
from hivemind.proto import averaging_pb2, runtime_pb2
from hivemind.utils import MPFuture
from hivemind.utils.asyncio import amap_in_executor
from hivemind.utils.streaming import combine_from_streaming, split_for_streaming

from .. import faults
from ..wire import swarm_pb2
from .priority import lower_priority

__all__ = ["DilocoxAverager", "RoundStats", "StateDownload"]

logger = logging.getLogger(__name__)

ROUND_BITS = 24
KEEP_AVERAGES = 2  # recent round averages kept to hand to a group member whose own all-reduce failed


def round_group_bits(round: int) -> str:
    """Group-key bits that spell the round number (groups never mix rounds)."""
    return format(round % (1 << ROUND_BITS), f"0{ROUND_BITS}b")


@dataclass
class RoundStats:
    """What one all-reduce did, reported back to the stage worker."""

    group: list[str] = field(default_factory=list)
    coverage: float = 1.0
    bytes_sent: int = 0
    bytes_received: int = 0
    failed_reducers: list[str] = field(default_factory=list)
    banned_senders: list[str] = field(default_factory=list)


@dataclass
class StateDownload:
    """A state received from a donor (status OK), or why not."""

    status: int
    boundary: int
    theta_hash: str = ""
    tensors: list[torch.Tensor] = field(default_factory=list)
    has_pending: bool = False
    pending_group_size: int = 0
    donor: str = ""
    reason: str = ""
    coverage: float = 1.0


class _CountingStub:
    """Wraps a peer stub so that averaged parts received from that reducer are counted."""

    def __init__(self, stub: Any, runner: ExactAllReduceRunner):
        self._stub, self._runner = stub, runner

    async def rpc_aggregate_part(self, inputs: AsyncIterator[Any]) -> AsyncIterator[Any]:
        stream = await self._stub.rpc_aggregate_part(inputs)
        return self._runner._count_received(stream)


class _TensorPartReducer(TensorPartReducer):
    """hivemind's reducer with two races fixed (seen here under CPU load when a peer dies):

    - a sender banned while its part k was already received but waiting for earlier parts
      is counted for part k (the ban covers its parts < num_parts_received), yet hivemind
      then rejects that part, so part k waits forever (until the all-reduce timeout);
      here a part the ban counts is accumulated;
    - a part finished twice raised InvalidStateError and broke the reducer's streams.
    """

    async def accumulate_part(
        self, sender_index: int, part_index: int, tensor_part: torch.Tensor, weight: float = 1.0
    ) -> torch.Tensor:
        assert 0 <= sender_index < self.num_senders, "invalid sender index"
        assert 0 <= part_index < self.num_parts, "invalid part index"
        self.num_parts_received[sender_index] += 1
        while part_index > self.current_part_index:
            await asyncio.wait(
                {self.current_part_future, asyncio.create_task(self.finished.wait())},
                return_when=asyncio.FIRST_COMPLETED,
            )
            if self.finished.is_set():
                raise AllreduceException(f"attempted to aggregate part in a finalized {self.__class__.__name__}")
        if part_index >= self.sender_failed_after[sender_index]:
            raise BannedException(f"sender {sender_index} was banned in background")
        assert part_index == self.current_part_index
        current_part_future = self.current_part_future
        self.accumulator.add_(tensor_part, alpha=weight)
        self.current_part_accumulated_from += 1
        self.denominator += weight
        self.check_current_part_finished()
        return await current_part_future

    def check_current_part_finished(self) -> None:
        assert self.current_part_accumulated_from <= self.num_current_senders
        if self.current_part_accumulated_from == self.num_current_senders and not self.current_part_future.done():
            self.current_part_future.set_result(self.accumulator.div_(self.denominator))
            self.reset_accumulators()


class ExactAllReduceRunner(AllReduceRunner):
    """Butterfly all-reduce that hands members the averaged parts, not differences."""

    def __init__(self, *, kill_on_first_part: bool = False, **kwargs: Any):
        super().__init__(**kwargs)
        self.tensor_part_reducer = _TensorPartReducer(
            tuple(part.shape for part in self.parts_for_local_averaging), len(self.sender_peer_ids)
        )
        container = self.tensor_part_container
        # reducer i owns a contiguous block of the flattened tensors: remember its part sizes
        self.part_sizes_by_peer = [[part.numel() for part, _ in parts] for parts in container._input_parts_by_peer]
        self.failed_reducers: set[int] = set()
        self.bytes_sent = self.bytes_received = 0
        self.kill_on_first_part = kill_on_first_part
        # return_deltas=True makes hivemind register zeros for a failed reducer's parts: here zeros mean
        # "no update", the same on every member; remember which reducers failed to zero their whole span.
        register_failed = container.register_failed_reducer

        def on_failed_reducer(peer_index: int) -> None:
            self.failed_reducers.add(peer_index)
            register_failed(peer_index)

        container.register_failed_reducer = on_failed_reducer

    async def _count_received(self, stream: AsyncIterator[Any]) -> AsyncIterator[Any]:
        async for message in stream:
            self.bytes_received += message.ByteSize()
            yield message

    def _get_peer_stub(self, peer: PeerID) -> Any:
        return _CountingStub(super()._get_peer_stub(peer), self)

    async def _communicate_with_peer(self, peer_id: PeerID) -> None:
        if peer_id != self.peer_id:
            return await super()._communicate_with_peer(peer_id)
        peer_index = self.ordered_peer_ids.index(peer_id)
        sender_index = self.sender_peer_ids.index(peer_id)
        try:
            for part_index, tensor_part in enumerate(self.parts_for_local_averaging):
                averaged_part = await self.tensor_part_reducer.accumulate_part(
                    sender_index, part_index, tensor_part, weight=self.weight
                )
                self.tensor_part_container.register_processed_part(peer_index, part_index, averaged_part)
        except BaseException as e:
            # hivemind lets this task die silently, and the outputs then wait forever for our own parts
            logger.warning("local reduction failed: %r", e)
            self.tensor_part_container.register_failed_reducer(peer_index)
            raise

    async def _generate_input_for_peer(self, peer_index: int) -> AsyncIterator[averaging_pb2.AveragingData]:
        async for message in super()._generate_input_for_peer(peer_index):
            self.bytes_sent += message.ByteSize()
            yield message

    async def rpc_aggregate_part(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], context: P2PContext
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        async for message in super().rpc_aggregate_part(self._count_received(stream), context):
            yield message

    async def _accumulate_parts_streaming(
        self, stream: AsyncIterator[averaging_pb2.AveragingData], sender_index: int
    ) -> AsyncIterator[averaging_pb2.AveragingData]:
        """As hivemind's, but replies with the averaged part itself."""
        part_index = 0
        try:
            loop = asyncio.get_event_loop()
            async for tensor_part, weight, part_compression in amap_in_executor(
                lambda msg: (deserialize_torch_tensor(msg.tensor_part), msg.weight, msg.tensor_part.compression),
                stream,
                max_prefetch=self.tensor_part_container.prefetch,
            ):
                if self.kill_on_first_part:
                    faults.kill_peer("kill_peer_in_allreduce")
                try:
                    averaged_part = await self.tensor_part_reducer.accumulate_part(
                        sender_index, part_index, tensor_part, weight=weight
                    )
                    part_index += 1
                except BannedException:
                    logger.debug(f"Sender {sender_index} is already banned")
                    break
                serialized = await loop.run_in_executor(
                    None, lambda: serialize_torch_tensor(averaged_part, part_compression)
                )
                message = averaging_pb2.AveragingData(code=averaging_pb2.AVERAGED_PART, tensor_part=serialized)
                self.bytes_sent += message.ByteSize()
                yield message
        finally:
            if part_index != self.tensor_part_reducer.num_parts:
                await self._ban_sender(self.sender_peer_ids[sender_index])

    def zero_failed_spans(self, outputs: list[torch.Tensor]) -> float:
        """Zero the coordinates owned by failed reducers; return the share still averaged."""
        total = sum(t.numel() for t in outputs)
        if not self.failed_reducers or total == 0:
            return 1.0
        spans, start = [], 0
        for index, sizes in enumerate(self.part_sizes_by_peer):
            end = start + sum(sizes)
            if index in self.failed_reducers:
                spans.append((start, end))
            start = end
        offset = 0
        for tensor in outputs:
            flat = tensor.view(-1)
            for lo, hi in spans:
                a, b = max(lo - offset, 0), min(hi - offset, flat.numel())
                if a < b:
                    flat[a:b] = 0
            offset += flat.numel()
        return 1.0 - sum(hi - lo for lo, hi in spans) / total


async def _keep_group_key(group_info: GroupInfo) -> None:
    return None


StateProvider = Callable[[], tuple[dict[str, Any], list[torch.Tensor]]]


class DilocoxAverager(DecentralizedAverager):
    """One stage worker's averager: exact round-keyed all-reduce plus round-state serving."""

    _rpc_handlers = None  # hivemind caches RPC handlers per class: collect this subclass's own
    _stub_type = None

    def __init__(
        self,
        averaged_tensors: Sequence[torch.Tensor],
        dht: Any,
        *,
        run_id: str,
        config_hash: str,
        stage: int,
        nice: int = 0,
        **kwargs: Any,
    ):
        self.run_id, self.config_hash, self.stage, self.nice = run_id, config_hash, stage, nice
        self._boundary = mp.Value(ctypes.c_int64, -1)
        self._state_ready = mp.Value(ctypes.c_bool, False)
        self._state_provider: StateProvider | None = None
        self._current_round = -1
        self._last_stats = RoundStats()
        self._recent: dict[int, tuple[list[torch.Tensor], int, float]] = {}  # round -> (average, group size, coverage)
        super().__init__(averaged_tensors, dht, **kwargs)

    def run(self) -> None:
        lower_priority(self.nice)  # see priority.py: the exchange takes the CPU training leaves idle
        super().run()

    # ----- host side --------------------------------------------------------------------
    def set_state_provider(self, provider: StateProvider) -> None:
        self._state_provider = provider

    def set_state_boundary(self, boundary: int, ready: bool) -> None:
        """Tell the averager process which boundary this worker's state is at (and if complete)."""
        with self._boundary.get_lock():
            self._boundary.value = boundary
            self._state_ready.value = ready

    def get_current_state(self) -> tuple[Any, Sequence[torch.Tensor], None]:
        """Runs in the host process when a peer downloads state: a consistent copy of it."""
        if self._state_provider is None:
            return {"boundary": -1}, [], None
        metadata, tensors = self._state_provider()
        return metadata, tensors, None

    def prepare_round(self, round: int, target_group_size: int) -> None:
        future = MPFuture()
        self._outer_pipe.send(("_prepare_round", [], dict(round=round, target=target_group_size, future=future)))
        future.result()

    def download_round(
        self, peer_id: str, boundary: int, *, wait_s: float, timeout: float, at_least: bool = False
    ) -> StateDownload:
        future = MPFuture()
        kwargs = dict(peer_id=peer_id, boundary=boundary, wait_s=wait_s, timeout=timeout, at_least=at_least, future=future)
        self._outer_pipe.send(("_download_round", [], kwargs))
        return future.result(timeout=timeout + wait_s + 10)

    # ----- averager process -------------------------------------------------------------------
    async def _prepare_round(self, round: int, target: int, future: MPFuture) -> None:
        try:
            mm = self._matchmaking
            mm.group_key_manager.group_bits = round_group_bits(round)
            # hivemind rotates the bits after a group forms (and fails when a group outgrows the target
            # size); the bits here are set per round, so that update is switched off
            mm.group_key_manager.update_key_on_group_assembled = _keep_group_key
            mm.target_group_size = mm.potential_leaders.target_group_size = target
            mm.group_key_manager.target_group_size = target
            self._current_round = round
            future.set_result(None)
        except Exception as e:  # pragma: no cover - reported to the caller
            future.set_exception(e)

    async def _aggregate_with_group(self, group_info: GroupInfo, min_vector_size: int, **kwargs: Any) -> Any:
        gathered = await super()._aggregate_with_group(group_info, min_vector_size, **kwargs)
        return {"gathered": gathered, "stats": self._last_stats}

    async def _run_allreduce_inplace_(
        self, tensors: Sequence[torch.Tensor], group_info: GroupInfo, group_id: bytes | None = None, **kwargs: Any
    ) -> None:
        group_id = group_info.group_id if group_id is None else group_id
        kill = faults.armed("kill_peer_in_allreduce", round=self._current_round, stage=self.stage)
        runner = ExactAllReduceRunner(
            p2p=self._p2p,
            servicer_type=type(self),
            prefix=self.prefix,
            tensors=tensors,
            group_id=group_id,
            ordered_peer_ids=group_info.peer_ids,
            kill_on_first_part=kill,
            **kwargs,
        )
        assert group_id in self._running_groups, f"Group id {group_id} was not registered in _register_allreduce_group"
        self._running_groups[group_id].set_result(runner)
        if runner.modes[group_info.peer_ids.index(self.peer_id)] == AveragingMode.AUX:
            async for _ in runner:
                raise ValueError("aux peers should not receive averaged tensors")
            return
        outputs = [averaged async for averaged in runner]  # local tensors stay untouched until the end
        coverage = runner.zero_failed_spans(outputs)
        for tensor, averaged in zip(tensors, outputs):
            tensor.copy_(averaged)
        peers = list(group_info.peer_ids)
        self._recent[self._current_round] = (outputs, len(peers), coverage)
        for old in sorted(self._recent)[:-KEEP_AVERAGES]:
            del self._recent[old]
        self._last_stats = RoundStats(
            group=[p.to_base58() for p in peers],
            coverage=coverage,
            bytes_sent=runner.bytes_sent,
            bytes_received=runner.bytes_received,
            failed_reducers=[peers[i].to_base58() for i in sorted(runner.failed_reducers)],
            banned_senders=[p.to_base58() for p in runner.banned_senders],
        )

    # ----- state download -----------------------------------------------------------------------
    async def rpc_download_round(
        self, request: swarm_pb2.StateRequest, context: P2PContext
    ) -> AsyncIterator[swarm_pb2.StateChunk]:
        """Stream this worker's state at `request.boundary` (or later, with `at_least`),
        waiting up to `wait_s` for it to be complete."""
        header = swarm_pb2.StateHeader(status=swarm_pb2.STATE_REFUSED)
        if (request.run_id, request.config_hash, request.stage) != (self.run_id, self.config_hash, self.stage):
            header.reason = "another run, config or stage"
            yield swarm_pb2.StateChunk(header=header)
            return
        deadline = time.monotonic() + min(max(request.wait_s, 0.0), 600.0)
        while True:
            boundary, ready = self._boundary.value, self._state_ready.value
            if boundary > request.boundary and not request.at_least:
                header.status, header.boundary = swarm_pb2.STATE_GONE, boundary
                yield swarm_pb2.StateChunk(header=header)
                return
            if boundary >= request.boundary and ready:
                blob, tensors, _ = await self._get_current_state_from_host_process()
                metadata = self.serializer.loads(blob)
                got = metadata.get("boundary", -1)
                if got == request.boundary or (request.at_least and got > request.boundary):
                    break
            if time.monotonic() >= deadline:
                header.status, header.boundary = swarm_pb2.STATE_NOT_READY, boundary
                yield swarm_pb2.StateChunk(header=header)
                return
            await asyncio.sleep(0.2)
        header = swarm_pb2.StateHeader(
            status=swarm_pb2.STATE_OK,
            boundary=metadata["boundary"],
            theta_hash=metadata["theta_hash"],
            n_tensors=len(tensors),
            has_pending=metadata["has_pending"],
            pending_group_size=metadata.get("pending_group_size", 0),
        )
        yield swarm_pb2.StateChunk(header=header)
        for tensor in tensors:
            for part in split_for_streaming(serialize_torch_tensor(tensor)):
                yield swarm_pb2.StateChunk(tensor_part=part.SerializeToString())

    async def _download_round(
        self, peer_id: str, boundary: int, wait_s: float, timeout: float, at_least: bool, future: MPFuture
    ) -> None:
        try:
            fetch = self._fetch_round(peer_id, boundary, wait_s, at_least)
            future.set_result(await asyncio.wait_for(fetch, timeout + wait_s))
        except Exception as e:
            if not future.done():
                future.set_result(StateDownload(status=-1, boundary=-1, donor=peer_id, reason=repr(e)))

    async def _fetch_round(self, peer_id: str, boundary: int, wait_s: float, at_least: bool) -> StateDownload:
        stub = type(self).get_stub(self._p2p, PeerID.from_base58(peer_id), namespace=self.prefix)
        request = swarm_pb2.StateRequest(
            run_id=self.run_id,
            config_hash=self.config_hash,
            stage=self.stage,
            boundary=boundary,
            wait_s=wait_s,
            at_least=at_least,
        )
        return await _read_state_stream(await stub.rpc_download_round(request), peer_id)

    # ----- a group's average, for a member whose own all-reduce failed ------------------------------------
    def download_average(self, peer_id: str, round: int, *, wait_s: float, timeout: float) -> StateDownload:
        future = MPFuture()
        kwargs = dict(peer_id=peer_id, round=round, wait_s=wait_s, timeout=timeout, future=future)
        self._outer_pipe.send(("_download_average", [], kwargs))
        return future.result(timeout=timeout + wait_s + 10)

    async def _download_average(self, peer_id: str, round: int, wait_s: float, timeout: float, future: MPFuture) -> None:
        try:
            stub = type(self).get_stub(self._p2p, PeerID.from_base58(peer_id), namespace=self.prefix)
            request = swarm_pb2.AverageRequest(
                run_id=self.run_id, config_hash=self.config_hash, stage=self.stage, round=round, wait_s=wait_s
            )
            stream = await asyncio.wait_for(stub.rpc_download_average(request), timeout)
            future.set_result(await asyncio.wait_for(_read_state_stream(stream, peer_id), timeout + wait_s))
        except Exception as e:
            if not future.done():
                future.set_result(StateDownload(status=-1, boundary=-1, donor=peer_id, reason=repr(e)))

    async def rpc_download_average(
        self, request: swarm_pb2.AverageRequest, context: P2PContext
    ) -> AsyncIterator[swarm_pb2.StateChunk]:
        """Stream the average this worker's group computed in `request.round` (waiting up to `wait_s`)."""
        header = swarm_pb2.StateHeader(status=swarm_pb2.STATE_REFUSED, boundary=request.round)
        if (request.run_id, request.config_hash, request.stage) != (self.run_id, self.config_hash, self.stage):
            header.reason = "another run, config or stage"
            yield swarm_pb2.StateChunk(header=header)
            return
        deadline = time.monotonic() + min(max(request.wait_s, 0.0), 600.0)
        while request.round not in self._recent and time.monotonic() < deadline and self._current_round <= request.round:
            await asyncio.sleep(0.2)
        if request.round not in self._recent:
            header.status = swarm_pb2.STATE_NOT_READY
            yield swarm_pb2.StateChunk(header=header)
            return
        tensors, group_size, coverage = self._recent[request.round]
        header = swarm_pb2.StateHeader(
            status=swarm_pb2.STATE_OK,
            boundary=request.round,
            n_tensors=len(tensors),
            pending_group_size=group_size,
            coverage=coverage,
        )
        yield swarm_pb2.StateChunk(header=header)
        for tensor in tensors:
            for part in split_for_streaming(serialize_torch_tensor(tensor)):
                yield swarm_pb2.StateChunk(tensor_part=part.SerializeToString())


async def _read_state_stream(stream: AsyncIterator[swarm_pb2.StateChunk], peer_id: str) -> StateDownload:
    """Collect a header and the tensors that follow it (a part with a dtype starts a new tensor)."""
    header, parts, tensors = None, [], []
    async for chunk in stream:
        if header is None:
            header = chunk.header
            if header.status != swarm_pb2.STATE_OK:
                break
            continue
        part = runtime_pb2.Tensor.FromString(chunk.tensor_part)
        if part.dtype and parts:
            tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
            parts = []
        parts.append(part)
    if parts:
        tensors.append(deserialize_torch_tensor(combine_from_streaming(parts)))
    if header is None:
        return StateDownload(status=-1, boundary=-1, donor=peer_id, reason="empty reply")
    if header.status == swarm_pb2.STATE_OK and len(tensors) != header.n_tensors:
        return StateDownload(status=-1, boundary=header.boundary, donor=peer_id, reason="truncated reply")
    return StateDownload(
        status=header.status,
        boundary=header.boundary,
        theta_hash=header.theta_hash,
        tensors=tensors,
        has_pending=header.has_pending,
        pending_group_size=header.pending_group_size,
        donor=peer_id,
        reason=header.reason,
        coverage=header.coverage,
    )
