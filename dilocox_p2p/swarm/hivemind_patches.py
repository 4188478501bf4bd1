"""Every private hivemind method or attribute dilocox-p2p overrides, patches or reads, in one place.

hivemind's public API (DHT, P2P, DecentralizedAverager.step, get_tensors) does not offer
exact averages, per-round groups, missing-span accounting or fixed-order sums, so the
averager extends private methods. Each is listed here with why and where; upgrading
hivemind means re-reading each of these in the new release and running the swarm tier.

Checked versions: `CHECKED_VERSIONS` (pyproject.toml allows exactly these). hivemind
1.1.10 (sdist only, whose build downloads the p2p daemon from GitHub) could not be
installed or run here, so it is outside the range; its matchmaking calls
`update_key_on_group_assembled(group_info, is_leader=True)`, which `_keep_group_key`
accepts anyway.
"""

from __future__ import annotations

import asyncio
import importlib
import importlib.abc
import importlib.machinery
import logging
import multiprocessing as mp
import sys
import types
from typing import Any
from uuid import UUID

__all__ = [
    "CHECKED_VERSIONS", "DHT_REQUESTS_PER_S", "DHT_REQUEST_BURST", "MAX_FRAME_BYTES", "PATCHES", "FrameTooLarge",
    "cap_stream_frames", "check_version", "defer_scipy_optimize", "guard_unary_replies", "limit_dht_requests",
    "own_process_locks", "patch_for_dht_node", "share_tensors_by_descriptor",
]

logger = logging.getLogger(__name__)

OPEN_FILES_WANTED = 65536  # share_tensors_by_descriptor raises the soft limit on open files to this (or the hard one)
CHECKED_VERSIONS = ("1.1.11", "1.1.12")
"""hivemind releases the swarm tier passed with (tests/swarm, 2026-11-23)."""

PATCHES: dict[str, str] = {
    # averaging/averager.py: DecentralizedAverager (our swarm/averager.py: DilocoxAverager)
    "DecentralizedAverager._aggregate_with_group": "returns our RoundResult instead of the gathered data",
    "DecentralizedAverager._run_allreduce_inplace_": "runs ExactAllReduceRunner or the gather; keeps each round's average "
    "(swarm/group_round.py: GroupRound)",
    "DecentralizedAverager._step": "overridden to play fault injection `lose_step` (a step that never ends) in place "
    "of hivemind's; otherwise hivemind's, unchanged (swarm/group_round.py: GroupRound)",
    "StepControl.attach / stage / wait_for_cancel": "used as hivemind's _step uses them, by the `lose_step` fault only",
    "DecentralizedAverager._allreduce_timeout / next_chunk_timeout": "properties over shared memory the host sets each "
    "round (swarm/deadlines.py: SharedDeadlines), read where hivemind reads them (_step's wait_for); the all-reduce's "
    "sender_timeout and reducer_timeout (allreduce_kwargs, fixed at hivemind's start) are replaced from them in "
    "_run_allreduce_inplace_; SharedDeadlines._aggregate_with_group marks a round whose all-reduce that deadline cut",
    "DecentralizedAverager._rpc_handlers / _stub_type": "reset so that the subclass's own rpc_* handlers are served",
    "DecentralizedAverager._matchmaking": "read to set the group bits and target size per round",
    "DecentralizedAverager._running_groups": "read (asserted) as hivemind does when registering a group; read by "
    "group_admission._join_begun: whether a group of that id runs here",
    "DecentralizedAverager.rpc_aggregate_part": "a part of a group this worker is not in, nor joining "
    "(Matchmaking.current_leader / assembled_group read, no join request in flight), is answered BAD_GROUP_ID at once; a request for a "
    "compressed message of such a group is answered at once too (gather.py), and while Matchmaking."
    "is_looking_for_group the round is marked counted out: the stage stops looking and borrows (group_admission.py); "
    "a peer's part streams and join requests beyond its rate or its share of held requests are refused first "
    "(request_limits.py)",
    "DecentralizedAverager._outer_pipe": "calls into the averager process (_prepare_round, _collect, _download_round)",
    "DecentralizedAverager._get_current_state_from_host_process": "fetches the state a joiner downloads",
    "DecentralizedAverager._p2p / serializer": "stubs for our RPCs; msgpack for state metadata",
    "DecentralizedAverager.bandwidth / mode / serializer": "read to make the JoinRequest.gather a step carries "
    "(averager.gathered_for, as hivemind's step does): a member record carries it for a group formed without "
    "matchmaking (group_reuse.py), whose GroupInfo every member builds from the records",
    # averaging/matchmaking.py and key_manager.py
    "Matchmaking.group_key_manager.group_bits": "set per round: the group key spells the round",
    "Matchmaking.target_group_size / potential_leaders.target_group_size": "set per round",
    "Matchmaking.client_mode": "set per round (client_member.py): a client member declares no leadership and its "
    "averager refuses join requests, as hivemind's client mode, while its rpc handlers stay served (the reducers pull "
    "its parts over the connections it opens); its peer_fractions are 0 (_run_allreduce_inplace_ replaces hivemind's "
    "load-balanced ones: every reducer an equal share) and AllReduceRunner takes it for AveragingMode.CLIENT",
    "GroupKeyManager.update_key_on_group_assembled": "replaced by a no-op (no key rotation)",
    "P2P._add_protobuf_stream_handler / _iterate_protobuf_stream_handler": "replaced (stream_close.py): a handler "
    "ends its reply with an END_OF_REPLY frame and leaves the stream's close to its caller, which closes it then (a "
    "handler that closed first had its stream reset now and then, and the caller's daemon dropped the reply's tail)",
    "GroupKeyManager.get_averagers": "wrapped (matchmaking.space_queue_reads): reads of the leaders' declarations begin "
    "QUEUE_READ_S apart (PotentialLeaders re-read an empty queue in a tight loop: over 100 DHT finds a second)",
    "Matchmaking.lock_request_join_group / current_followers / current_leader / assembled_group / "
    "leader_assemble_group": "lower_target (matchmaking.py): a leader holding every member that still trains "
    "starts its group at once instead of waiting out round_wait for one that left the round",
    "Matchmaking.look_for_group": "wrapped (matchmaking.py) to hold its task until it ends: a cancelled step's "
    "search was garbage-collected halfway and left the matchmaking locks held for good; a search whose step is of "
    "an earlier round is cancelled (StepControl.cancel) when a round is prepared; a step whose round's group formed "
    "without matchmaking (group_reuse.py) returns that GroupInfo at once: no search, lock or DHT declaration",
    "Matchmaking._request_join_group": "wrapped (matchmaking.track_join_requests) to count requests in flight: a "
    "part that reaches a follower before its leader's ACCEPTED waits for that answer instead of BAD_GROUP_ID; and to "
    "know whom they ask: a request from one of those is refused at once (a mutual ask, group_admission.py); "
    "Matchmaking.was_accepted_to_group: its set() is wrapped (matchmaking._count_acceptances) to count the leaders' "
    "ACCEPTED answers: a request that found no group after one was accepted (lost_acceptance, group_admission.py)",
    "Matchmaking.request_timeout": "read: how long a part waits for a request in flight to end",
    "logger hivemind.averaging.matchmaking, debug records of _request_join_group": "captured by task, not printed "
    "(join_reasons.py): why a request to a leader ended without a group, in the line that reports it",
    "PotentialLeaders.pop_next_leader": "wrapped (averager._ask_designated_then_admitted): a follower asks the round's "
    "designated leader first, a designated leader asks nobody for a quarter of round_wait (matchmaking.DesignatedLeader); "
    "leaders this round does not admit are skipped",
    "PotentialLeaders.min_matchmaking_time / declared_expiration_time / update_triggered": "read, and update_triggered "
    "set (matchmaking.pop_while_unsure): a search that falls back to hivemind's queue reads it again while a leader "
    "due before this worker could still declare itself (hivemind stopped reading once its top leader was due after "
    "the search's end, and missed a member that declared a moment later)",
    "DecentralizedAverager.rpc_join_group": "overridden: the signed ticket is checked, and a request that comes before "
    "this worker looks for its round's group waits for that (group_admission._wait_to_lead); one from a member this "
    "worker is asking to lead it is refused (NOT_A_LEADER) without waiting for the join lock; after its last answer "
    "the stream stays open until the follower closes it (hivemind's request_join_group does, in its finally; "
    "stream_close.py: a leader that closed first could lose that answer on the way)",
    "Matchmaking.is_looking_for_group / potential_leaders.declared_group_key / group_key_manager.current_key / "
    "min_matchmaking_time": "read: whether the search of the current round runs and has declared (looking_for_group); "
    "how long a designated leader waits alone",
    "Matchmaking.follower_assemble_group": "wrapped (matchmaking.abandon_begun_groups) for fault injection "
    "`abandon_accepted` and `lose_begin` only: a follower drops the group its leader began with it",
    "Matchmaking.assembled_group.set_result / step_control.data_for_gather / lock_request_join_group": "a follower whose leader's "
    "answer stream closed after ACCEPTED joins the group a member names late (group_admission._join_begun): it sets "
    "the search's result as follower_assemble_group would, under the join lock; its ticket is the search's gather; "
    "so does a member that looks through matchmaking while the others of its last group formed the round's group "
    "without (group_reuse.py)",
    "Matchmaking._check_reasons_to_reject": "wrapped (matchmaking.screen_join_requests): a follower accepted that the "
    "round's target did not count (a suspect, alive after all) raises the target by one instead of taking the place "
    "of a member the target was counted for; a refusal is said at info with hivemind's code",
    # averaging/allreduce.py: AllReduceRunner (our swarm/allreduce.py: ExactAllReduceRunner)
    "AllReduceRunner._communicate_with_peer": "own parts: averaged part registered as is; failures reported",
    "AllReduceRunner.finalize / _future": "finalize overridden: a CancelledError (a step its deadline cut) cancels the "
    "runner instead of failing it (hivemind's exception was never retrieved: asyncio logged it at ERROR); _future read: "
    "once it is done, a reducer whose span stops coming is not blamed (finalize emptied the parts still to send)",
    "AllReduceRunner._accumulate_parts_streaming": "replies with the averaged part, not the difference; checks each part against its sender's signed digest before it is reduced, and signs the averaged span with its last part",
    "AllReduceRunner._generate_input_for_peer / rpc_aggregate_part": "count bytes sent and received; each part sent carries its sender's signed digest in AveragingData.peer_id, which hivemind's runner leaves unused (allreduce.py, point 7)",
    "AllReduceRunner._get_peer_stub": "wrapped to count bytes received and check each reducer's signed digest of its span, "
    "and to close the reducer's stream (aclose of the generator hivemind's P2P returns) once the whole span came; "
    "the reducer's rpc_aggregate_part then waits for that close (stream_close.py: the p2p daemon "
    "could reset a stream its handler closed first, and drop the span's tail)",
    "AllReduceRunner._handle_missing_senders": "extended to say at info whom it banned (a sender "
    "banned silently ended a reducer's stream to it short: a member mended a span, test_elastic's late join)",
    "AllReduceRunner._ban_sender": "called as hivemind does when a sender's stream ends early, and for a member "
    "that answers BAD_GROUP_ID (it never joined the group); overridden to end the wait for missing senders "
    "once every sender started or is banned",
    "AllReduceRunner.all_senders_started / active_senders / banned_senders / sender_peer_ids": "read; the event set "
    "once every sender has started or is banned (hivemind's rpc_aggregate_part counts started ones only): a sender "
    "is added to active_senders before hivemind's handler runs, and the event checked",
    # averaging/partition.py
    "TensorPartContainer._input_parts_by_peer": "read for each reducer's part sizes (missing spans) and shapes (an "
    "averaged part of another shape is refused: allreduce._misfit)",
    "TensorPartReducer.part_shapes": "read: a sender's part of another shape is refused before it is accumulated",
    "TensorPartContainer._outputs_registered_by_peer": "read when a reducer fails: its first undelivered part",
    "TensorPartContainer.register_failed_reducer": "wrapped (per instance) to record failed reducers",
    "TensorPartReducer.reset_accumulators / accumulate_part / check_current_part_finished":
        "overridden (swarm/ordered_reducer.py): fixed-order float64 mean; two races fixed (a banned sender's counted "
        "part; a part finished twice)",
    "TensorPartReducer.sender_failed_after / num_parts_received / contributions": "read and kept as hivemind does",
    # p2p/p2p_daemon.py (our doctor.py): P2P has no public call to dial one given address of a peer
    "P2P._client.connect": "doctor dials each initial peer's own multiaddr to tell a dead address from a live node "
    "(and one that answered, to ask it to dial this machine back: dial_back.py); "
    "dht_join.py dials every initial peer at its address (a node starts alone and joins them all at once; "
    "reconnect.py and a bootstrap node's fellows are dialed again while they are missing)",
    # dht/node.py, protocol.py, routing.py (our swarm/dht_join.py, reconnect.py): a node is started without
    # initial_peers (hivemind's p2p daemon dials them one by one and refuses to start when none answers)
    "DHTNode.protocol.routing_table.peer_id_to_uid": "read: which peers the DHT node still has a route to",
    "DHTNode.find_nearest_nodes": "the walk to a joined node's own nearest nodes, which DHTNode.create does after "
    "its pings (dht_join._walk); wrapped (walk_to_nodes_only): every walk asks for the nodes nearest the key's "
    "sibling id, so that the nodes met do not answer with the records they hold under the key",
    "DHT._get / _store / _run_coroutine": "wrapped (dht_process.HelperDHT) to hold each call's task until it ends: the DHT "
    "process keeps no reference to them, and one destroyed by the cycle collector left its caller waiting for good",
    "DHTProtocol.call_ping": "pings an initial or lost peer; its answer puts each in the other's routing table",
    "DHTProtocol.IS_REGULAR_VALUE": "read (record_rules.EnvelopeValidator): the subkey bytes of a plain value, refused "
    "under every key (it would replace every record under its key)",
    "DHTProtocol.rpc_store / rpc_find": "wrapped (limit_dht_requests below): a peer's stores and finds beyond "
    "DHT_REQUESTS_PER_S a second (bursts of DHT_REQUEST_BURST) are answered at once, nothing stored or found, before a "
    "record is validated (request_limits.py)",
    "P2P.receive_raw_data / HEADER_LEN / BYTEORDER": "replaced (cap_stream_frames below): a frame's declared length "
    "above MAX_FRAME_BYTES is refused before its bytes are read (hivemind buffered any length a peer declared)",
    # p2p/p2p_daemon_bindings/control.py: the persistent connection to the p2p daemon (unary calls, both ways)
    "ControlClient._read_from_persistent_conn": "replaced (guard_unary_replies below): a reply to a call cancelled a "
    "moment before no longer ends the reader; _pending_calls / _handler_tasks / _handle_persistent_request used as "
    "hivemind does",
    "ControlClient.call_unary_handler / add_unary_handler / stream_open / stream_handler": "wrapped (protocol_bytes."
    "count_by_source): each message's bytes are counted for its protocol's source (exchange, matchmaking, dht...); "
    "a stream's reader and writer are handed on wrapped (readexactly, read, readline, write counted)",
    # utils/mpfuture.py, utils/asyncio.py: process-wide locks made at import (own_process_locks below)
    "MPFuture.reset_backend": "called in each stage process forked from a process that imported hivemind",
    "_AsyncContextWrapper.EXECUTOR_LOCK": "replaced by a lock of the stage process's own, as reset_backend does its",
    # utils/mpfuture.py sets torch's tensor sharing strategy for the whole process at import
    "torch.multiprocessing sharing strategy (set to file_system by hivemind.utils.mpfuture)": "set back to "
    "file_descriptor where a DHT node is made, before hivemind's first MPFuture shares its state "
    "(share_tensors_by_descriptor below): no torch_shm_manager per stage",
    # averaging/load_balancing.py: `import scipy.optimize` at import, for linprog (defer_scipy_optimize below)
    "scipy.optimize (imported by hivemind.averaging.load_balancing)": "loaded lazily, on its first use",
}


class _DeferredScipyOptimize(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Imports `scipy.optimize` as a placeholder whose first name read imports the real module (defer_scipy_optimize)."""

    NAME = "scipy.optimize"

    def find_spec(self, name: str, path: Any, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        if name != self.NAME:
            return None
        real = importlib.machinery.PathFinder.find_spec(name, path)
        if real is None:
            return None
        spec = importlib.machinery.ModuleSpec(name, self, origin=real.origin, is_package=True)
        spec.submodule_search_locations, spec.has_location = real.submodule_search_locations, real.has_location
        return spec

    def create_module(self, spec: importlib.machinery.ModuleSpec) -> None:
        return None  # a plain module

    def exec_module(self, module: types.ModuleType) -> None:
        def load(name: str) -> Any:
            if self in sys.meta_path:
                sys.meta_path.remove(self)
            if sys.modules.get(self.NAME) is module:
                del sys.modules[self.NAME]
            real = importlib.import_module(self.NAME)  # the import makes it scipy's attribute as well
            return getattr(real, name)

        module.__getattr__ = load  # type: ignore[method-assign]  # PEP 562: only names the module lacks


def defer_scipy_optimize() -> None:
    """Make `scipy.optimize` load on first use instead of at import.

    `import hivemind` imports hivemind.averaging.load_balancing, which imports scipy.optimize for the one
    linprog call of hivemind's own load balancing: about 0.2 s of one core in every peer's start (the fork
    server's imports, `python -X importtime`, 2 cores), before any stage can start. A peer's start never
    calls it (our all-reduce splits the parts itself, swarm/allreduce.py). Until something reads one of its
    names, sys.modules holds a placeholder (its `__file__`, `__path__` and `__spec__` are the real module's:
    torch's import reads every module's `__file__`); the first read imports the real module, which takes the
    placeholder's place. Nothing is imported now (the launcher imports this package and never scipy).
    (importlib.util.LazyLoader does not do: an `import scipy.optimize` of a lazy module reads its `__spec__`,
    which loads it.) Call before hivemind is imported; an imported module stays as it is."""
    if "scipy.optimize" not in sys.modules and not any(isinstance(f, _DeferredScipyOptimize) for f in sys.meta_path):
        sys.meta_path.insert(0, _DeferredScipyOptimize())


def own_process_locks() -> None:
    """Give this process hivemind's process-wide locks of its own, as a fresh interpreter has them.

    hivemind makes them at import: multiprocessing semaphores, shared with every process forked after. A stage
    forked from a process that had imported hivemind (the fork server; the tests' zygote, whose peers all fork
    from one interpreter) shared them with every other process forked from it. One SIGKILLed while it held
    MPFuture._update_lock left it held for good, and in every later process the first MPFuture result a child
    sent blocked for ever (swarm tier of 2026-11-27: a later test's pair hung, each in its DHT's start). A
    process that has not imported hivemind makes fresh locks when it does."""
    mpfuture = sys.modules.get("hivemind.utils.mpfuture")
    if mpfuture is not None:
        mpfuture.MPFuture.reset_backend()
    asyncio_utils = sys.modules.get("hivemind.utils.asyncio")
    if asyncio_utils is not None:
        asyncio_utils._AsyncContextWrapper.EXECUTOR_LOCK = mp.Lock()


def patch_for_dht_node() -> None:
    """What a process patches before it makes a hivemind DHT node (a stage's HelperDHT, a bootstrap node): the DHT
    process, and an averager forked later, run the guarded reply reader, refuse stream frames too large to be ours
    before reading them, hold each peer's stores and finds to its rate, end every stream's reply explicitly
    (stream_close.py) and walk to a key's nodes without their records; and tensors are shared by descriptor before
    hivemind's first MPFuture shares its state (no torch_shm_manager). Each patch applies once per process."""
    from .stream_close import end_replies_explicitly

    guard_unary_replies()
    cap_stream_frames()
    limit_dht_requests()
    share_tensors_by_descriptor()
    end_replies_explicitly()
    walk_to_nodes_only()


def share_tensors_by_descriptor() -> None:
    """Share tensors between processes as torch does by default on Linux (file descriptors), not as hivemind sets it
    at import for every process (`hivemind.utils.mpfuture`: "file_system", overridable only by the environment).

    Under "file_system" the first tensor a process shares starts torch's `torch_shm_manager` beside it: one more
    process per stage, 0.5 CPU-s each to start (5-6% of the swarm tier's CPU: 163 of them in one run, 2 EPYC cores,
    2026-12-02, measured with process accounting), and a shared tensor is a named file under /dev/shm that the
    manager must remove. Under "file_descriptor" a shared tensor is an unlinked file held open: nothing is left
    behind by a process that is killed. Called where a DHT node is made (patch_for_dht_node: HelperDHT, the
    bootstrap node): hivemind's first MPFuture shares its state there, before any averager (which needs the DHT)
    shares a tensor. A stage holds one descriptor per shared tensor (its parameters, the averager's outbox) and one
    per tensor it receives from its averager process; the soft limit on open files is raised towards the hard one
    (at most OPEN_FILES_WANTED) so that a large stage does not run short."""
    import resource

    import hivemind.utils.mpfuture  # noqa: F401  (sets file_system at its import: first, so that this comes after)
    import torch.multiprocessing

    torch.multiprocessing.set_sharing_strategy("file_descriptor")
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    wanted = OPEN_FILES_WANTED if hard == resource.RLIM_INFINITY else min(hard, OPEN_FILES_WANTED)
    if soft != resource.RLIM_INFINITY and soft < wanted:
        resource.setrlimit(resource.RLIMIT_NOFILE, (wanted, hard))


async def _read_from_persistent_conn(self: Any, reader: asyncio.StreamReader) -> None:
    """hivemind's reader of the p2p daemon's persistent connection (ControlClient), which ends only with it.

    hivemind's sets the result of the call each reply answers, also of a call cancelled a moment before (its
    caller's timeout fired in the same turn of the event loop as the reply was read): `set_result` on a
    cancelled future raises InvalidStateError, which ended the reader for good. Every unary call of that
    process then waited out its timeout, and no request to it was answered: a DHT process hit that way lost
    every route and trained its stage alone for the rest of the run (churn soak under load, 2026-11-29;
    tests/swarm/test_p2p_replies.py makes the race happen). Here a reply to a call that is done is
    dropped, as one to an unknown call is. Otherwise as hivemind's of 1.1.11 and 1.1.12 (compared)."""
    from hivemind.p2p.p2p_daemon_bindings.utils import P2PDaemonError, P2PHandlerError, read_pbmsg_safe
    from hivemind.proto import p2pd_pb2

    while True:
        resp = p2pd_pb2.PersistentConnectionResponse()
        try:
            await read_pbmsg_safe(reader, resp)
        except asyncio.IncompleteReadError:
            break
        call_id = UUID(bytes=resp.callId)
        pending = self._pending_calls.get(call_id)
        if pending is not None and pending.done():
            logger.debug("a reply to unary call %s came after the call ended: dropped", call_id)
        elif resp.HasField("callUnaryResponse"):
            if pending is not None and resp.callUnaryResponse.HasField("response"):
                pending.set_result(resp.callUnaryResponse.response)
            elif pending is not None and resp.callUnaryResponse.HasField("error"):
                pending.set_exception(P2PHandlerError(resp.callUnaryResponse.error.decode(errors="ignore")))
            else:
                logger.debug("received an unexpected unary call: %s", resp)
        elif resp.HasField("requestHandling"):
            self._handler_tasks[call_id] = asyncio.create_task(
                self._handle_persistent_request(call_id, resp.requestHandling)
            )
        elif call_id in self._handler_tasks and resp.HasField("cancel"):
            if not self._handler_tasks[call_id].done():
                self._handler_tasks[call_id].cancel()
        elif pending is not None and resp.HasField("daemonError"):
            pending.set_exception(P2PDaemonError(resp.daemonError.message))
        elif pending is not None:
            pending.set_result(None)
        else:
            logger.debug("received an unexpected response from the p2p daemon: %s", resp)


def guard_unary_replies() -> None:
    """Replace ControlClient._read_from_persistent_conn (above) in this process and those it forks after."""
    from hivemind.p2p.p2p_daemon_bindings.control import ControlClient

    ControlClient._read_from_persistent_conn = _read_from_persistent_conn


MAX_FRAME_BYTES = 16 << 20
"""The largest protobuf frame a peer reads from a libp2p stream: ours are at most half a MiB (hivemind's averaging
parts, gather.PAYLOAD_PART, transfer's chunks), a DHT answer a few hundred KiB."""


class FrameTooLarge(ConnectionError):
    """A stream's frame declared more bytes than MAX_FRAME_BYTES: refused before any of them was read."""


async def _receive_raw_data(reader: asyncio.StreamReader) -> bytes:
    """hivemind's P2P.receive_raw_data (1.1.11, 1.1.12: an 8-byte length, then that many bytes), refusing a length
    above MAX_FRAME_BYTES before reading on: hivemind's read and buffered whatever length a peer declared (a 48 MiB
    request took 710 MiB of memory before our checks refused it; a declared 2^40 was waited for as long as the peer
    kept sending)."""
    from hivemind.p2p import P2P

    header = await reader.readexactly(P2P.HEADER_LEN)
    content_length = int.from_bytes(header, P2P.BYTEORDER)
    if content_length > MAX_FRAME_BYTES:
        raise FrameTooLarge(f"a frame of {content_length} bytes declared (the most read is {MAX_FRAME_BYTES})")
    return await reader.readexactly(content_length)


def cap_stream_frames() -> None:
    """Replace P2P.receive_raw_data (above), which reads every frame of every protobuf stream both ways (requests to
    this process's handlers, replies to its calls), in this process and those it forks after. A handler whose
    request is refused closes the stream (hivemind logs "Exception while receiving requests"); a call whose reply
    is refused raises."""
    from hivemind.p2p import P2P

    P2P.receive_raw_data = staticmethod(_receive_raw_data)


DHT_REQUESTS_PER_S = 50.0
DHT_REQUEST_BURST = 500
"""A peer's DHT stores (and, apart, its finds) one DHT node takes a second, and at once after a quiet spell. An honest
member's node asks another a few times a round (its records, a round's and average records, walks 5 nodes wide),
more while it joins and fills its routing table: far below. A flood of valid-looking records cost one signature
check each before."""


def limit_dht_requests() -> None:
    """Wrap DHTProtocol.rpc_store and rpc_find, in this process and those it forks after (the DHT process), so that a
    peer beyond its rate is answered at once with nothing stored (store_ok false) or found (NOT_FOUND), counted and
    logged as faults.RefusalLog says (its 1st, 10th, 100th... time). Idempotent."""
    import functools

    from hivemind.dht.protocol import DHTProtocol
    from hivemind.proto import dht_pb2

    from .faults import RefusalLog
    from .request_limits import RequestRate

    if getattr(DHTProtocol, "_dilocox_limited", False):
        return
    rates = {"store": RequestRate(DHT_REQUESTS_PER_S, DHT_REQUEST_BURST), "find": RequestRate(DHT_REQUESTS_PER_S, DHT_REQUEST_BURST)}
    refusals = RefusalLog()

    def refuses(what: str, context: Any) -> bool:
        if rates[what].take(context.remote_id.to_base58()):
            return False
        if (n := refusals.count(f"DHT {what}")) is not None:
            logger.warning("refused a DHT %s of %s: more than %.0f a second [%d such so far]", what, context.remote_id,
                           DHT_REQUESTS_PER_S, n)  # fmt: skip
        return True

    store, find = DHTProtocol.rpc_store, DHTProtocol.rpc_find

    @functools.wraps(store)
    async def rpc_store(self: Any, request: Any, context: Any) -> Any:
        if refuses("store", context):
            return dht_pb2.StoreResponse(store_ok=[False] * len(request.keys), peer=self.node_info)
        return await store(self, request, context)

    @functools.wraps(find)
    async def rpc_find(self: Any, request: Any, context: Any) -> Any:
        if refuses("find", context):
            results = [dht_pb2.FindResult(type=dht_pb2.NOT_FOUND) for _ in request.keys]
            return dht_pb2.FindResponse(results=results, peer=self.node_info)
        return await find(self, request, context)

    DHTProtocol.rpc_store, DHTProtocol.rpc_find = rpc_store, rpc_find
    DHTProtocol._dilocox_limited = True


def walk_to_nodes_only() -> None:
    """Make DHTNode.find_nearest_nodes (a store's walk to its key's nodes, a node's walk to its own) ask every node
    it meets for the nodes nearest the key's sibling id (its lowest bit flipped), under which nothing is stored, and
    hand the answers back under the key's id, in this process and those it forks after. hivemind asked for the key
    itself, and each node met answered with all it holds under it, which a store throws away: under a stage's
    members key every member's record, from each of the key's 5 nodes, at every store of every member (N^2 per
    member and round, the largest part of the DHT's bytes on the lab: docs/benchmarks.md, section 5). The same nodes
    are found: an XOR distance to the sibling differs from the one to the key in its lowest bit only, which reorders
    no two nodes but two whose ids (hashes) differ in that bit alone. Idempotent."""
    import functools

    from hivemind.dht.node import DHTNode
    from hivemind.dht.routing import DHTID

    if getattr(DHTNode, "_dilocox_nodes_only", False):
        return
    find = DHTNode.find_nearest_nodes

    @functools.wraps(find)
    async def find_nearest_nodes(self: Any, queries: Any, *args: Any, found_callback: Any = None, **kwargs: Any) -> Any:
        keys = {DHTID(int(query) ^ 1): query for query in queries}
        report = found_callback
        if report is not None:

            async def found_callback(sibling: Any, nearest: Any, visited: Any) -> Any:
                return await report(keys[sibling], nearest, visited)

        found = await find(self, tuple(keys), *args, found_callback=found_callback, **kwargs)
        return {keys[sibling]: nodes for sibling, nodes in found.items()}

    DHTNode.find_nearest_nodes = find_nearest_nodes
    DHTNode._dilocox_nodes_only = True


def check_version() -> None:
    """Warn once if the installed hivemind is not one the patches above were checked against."""
    import hivemind

    if hivemind.__version__ not in CHECKED_VERSIONS:
        logger.warning(
            "hivemind %s is not among the versions dilocox-p2p was checked with (%s); "
            "the private methods listed in %s may have changed",
            hivemind.__version__, ", ".join(CHECKED_VERSIONS), __name__,
        )
