"""A state download between two real averager processes on loopback: a joiner takes theta_g and the
momentum at once while the donor's pending average is in flight (STATE_NOW), then that average alone
once the donor has it (STATE_PENDING); a request for the whole state still waits for it.

    pytest tests/swarm/test_state_download.py -q
"""

from __future__ import annotations

import time
from concurrent.futures import ThreadPoolExecutor

import pytest
import torch

from dilocox_p2p.average import Average, AverageKind
from dilocox_p2p.config_network import SwarmConfig
from dilocox_p2p.state import PendingAverage, StageState
from dilocox_p2p.swarm.agreement import Agreement
from dilocox_p2p.swarm.averager import DilocoxAverager
from dilocox_p2p.swarm.deadlines import Deadlines
from dilocox_p2p.swarm.dht import RunRecords
from dilocox_p2p.swarm.faults import FaultCounter
from dilocox_p2p.swarm.membership import Membership
from dilocox_p2p.wire import swarm_pb2
from tests.helpers.signed import signed_node

pytestmark = pytest.mark.swarm

SHAPES = [(300, 200), (5000,), (7,)]
BOUNDARY = 6


class Donor:
    """The host side of a worker at BOUNDARY whose average of round BOUNDARY - 1 is still in flight."""

    def __init__(self):
        gen = torch.Generator().manual_seed(3)
        self.theta = [torch.randn(s, generator=gen) for s in SHAPES]
        self.momentum = [torch.randn(s, generator=gen) for s in SHAPES]
        self.average = Average(AverageKind.AVERAGED, [torch.randn(s, generator=gen) for s in SHAPES], group=("a", "b"))
        self.ready = False

    def offered_state(self, boundary: int, now: bool = False) -> StageState | None:
        if boundary != BOUNDARY:
            return None
        if self.ready:
            return StageState(BOUNDARY, self.theta, self.momentum, PendingAverage(BOUNDARY - 1, self.average))
        return StageState(BOUNDARY, self.theta, self.momentum, follows=BOUNDARY - 1) if now else None


@pytest.fixture
def nodes():
    first = signed_node("sd")
    return [first, signed_node("sd", initial_peers=first[0].get_visible_maddrs())]


@pytest.fixture
def pair(nodes):
    averagers = [
        DilocoxAverager(
            [torch.zeros(s) for s in SHAPES], dht, run_id="sd", config_hash="0" * 64, stage=0, prefix="sd_s0",
            start=True, min_group_size=2, min_matchmaking_time=5.0, request_timeout=5.0, allreduce_timeout=30.0,
            next_chunk_timeout=5.0, allow_state_sharing=False, signer=signer, gate=gate,
        )  # fmt: skip
        for dht, signer, gate in nodes
    ]
    yield averagers, [dht.peer_id.to_base58() for dht, _, _ in nodes]
    for averager in averagers:
        averager.shutdown()
    for dht, _, _ in nodes:
        dht.shutdown()


def test_a_joiner_takes_the_state_at_once_and_the_pending_average_once_the_donor_has_it(pair):
    (joiner, donor_averager), (_, donor_id) = pair
    donor = Donor()
    donor_averager.set_state_provider(donor.offered_state)
    donor_averager.set_state_boundary(BOUNDARY, ready=False)

    whole = joiner.download_round(donor_id, BOUNDARY, wait_s=0.5, timeout=10.0)
    assert whole.status == swarm_pb2.STATE_NOT_READY, whole  # the whole state waits for the average

    started = time.monotonic()
    now = joiner.download_round(donor_id, BOUNDARY, wait_s=10.0, timeout=10.0, part=swarm_pb2.STATE_NOW)
    assert now.status == swarm_pb2.STATE_OK and time.monotonic() - started < 5.0, now
    assert now.state.follows == BOUNDARY - 1 and now.state.pending is None
    assert all(torch.equal(a, b) for a, b in zip(now.state.theta_g, donor.theta))
    assert all(torch.equal(a, b) for a, b in zip(now.state.momentum, donor.momentum))
    assert now.state_hash == now.state.hash()

    with ThreadPoolExecutor(1) as pool:
        asked = pool.submit(joiner.download_round, donor_id, BOUNDARY, wait_s=30.0, timeout=10.0,
                            part=swarm_pb2.STATE_PENDING)  # fmt: skip
        while not donor_averager.state_wanted():  # the request waits in the donor's averager process
            assert not asked.done(), asked.result()
            time.sleep(0.05)
        donor.ready = True
        donor_averager.set_state_boundary(BOUNDARY, ready=True)
        pending = asked.result(timeout=60)
    assert pending.status == swarm_pb2.STATE_OK, pending
    assert pending.state.theta_g == [] and pending.state.momentum == []  # the average alone
    assert pending.state_hash == now.state_hash and pending.state.pending.round == BOUNDARY - 1
    assert pending.state.pending.average.kind is AverageKind.AVERAGED
    assert all(torch.equal(a, b) for a, b in zip(pending.state.pending.average.tensors, donor.average.tensors))


def test_an_average_handed_over_while_the_host_holds_the_buffers_is_kept_and_served_at_once(pair):
    # The host keeps the buffers locked until the averager has its copy (exchange._hold: a stray all-reduce must
    # not overwrite them in between). The averager took the same lock in its event loop, and a lock held elsewhere
    # (by the host, or by an all-reduce of its own process: then for good) stood its whole loop still: the call
    # timed out after 30 s, and nothing it serves was answered meanwhile.
    (holder, asker), (holder_id, _) = pair
    gen = torch.Generator().manual_seed(5)
    average = [torch.randn(s, generator=gen) for s in SHAPES]
    with holder.get_tensors() as buffers:
        for buf, t in zip(buffers, average):
            buf.copy_(t)
        started = time.monotonic()
        holder.hold_buffers(4, AverageKind.AVERAGED, (holder_id,), b"group-4")
        assert time.monotonic() - started < 5.0, "the averager waited for the buffers the host holds"
        with ThreadPoolExecutor(1) as pool:  # asked by another member while the buffers are still locked
            collected = pool.submit(asker.collect, 4, [holder_id], start=None, wait_s=5.0, deadline_s=10.0).result(20)
    assert collected.average is not None, collected.failures
    assert all(torch.equal(a, b) for a, b in zip(collected.average.tensors, average))


def test_a_donor_keeps_a_state_it_served_without_its_pending_average_until_the_taker_asks_for_that_average(pair):
    # A taker asks for the pending average only once it installed the state (its stages agree first: seconds under
    # load). A donor training alone moved past the boundary meanwhile, with no request waiting, kept nothing and
    # answered STATE_GONE: the taker was stranded and took the state again (CI of 5f6bf01, test_agreement's split
    # pair: one repair, then a catch-up).
    (joiner, donor_averager), (_, donor_id) = pair
    donor = Donor()
    donor_averager.set_state_provider(donor.offered_state)
    donor_averager.set_state_boundary(BOUNDARY, ready=False)
    assert not donor_averager.state_wanted(BOUNDARY)

    now = joiner.download_round(donor_id, BOUNDARY, wait_s=10.0, timeout=10.0, part=swarm_pb2.STATE_NOW)
    assert now.status == swarm_pb2.STATE_OK and now.state.follows == BOUNDARY - 1, now
    assert donor_averager.state_wanted(BOUNDARY) and not donor_averager.state_wanted(BOUNDARY + 1)

    # the donor's average arrives and it steps past the boundary, as SwarmWorker._keep_for_joiner does it
    donor.ready = True
    donor_averager.set_state_boundary(BOUNDARY, ready=True)
    donor_averager.set_kept_boundary(BOUNDARY if donor_averager.state_wanted(BOUNDARY) else -1)
    donor_averager.set_state_boundary(BOUNDARY + 1, ready=False)

    pending = joiner.download_round(donor_id, BOUNDARY, wait_s=5.0, timeout=10.0, part=swarm_pb2.STATE_PENDING)
    assert pending.status == swarm_pb2.STATE_OK, pending
    assert pending.state_hash == now.state_hash and pending.state.pending.round == BOUNDARY - 1
    assert all(torch.equal(a, b) for a, b in zip(pending.state.pending.average.tensors, donor.average.tensors))
    assert not donor_averager.state_wanted(BOUNDARY)  # served: the donor need not keep it past its next step


def test_a_pending_average_served_before_its_announcement_shows_is_taken_once_the_announcement_comes(pair, nodes):
    # the donor announces its pending average's hash (its round record) before it serves that average, but the
    # DHT the taker reads may show the record a moment later (a node that missed the store: a peer restarted
    # under the same key, whose old address the donor's daemon still dialled). The taker refused the average as
    # announced by nobody, stranded the round and resynced again (busy-core run of 3911798, test_elastic)
    (joiner, donor_averager), (joiner_id, donor_id) = pair
    (joiner_dht, joiner_signer, joiner_gate), (donor_dht, donor_signer, donor_gate) = nodes
    faults = FaultCounter()
    joiner_records = RunRecords(joiner_dht, "sd", 0, faults, signer=joiner_signer, gate=joiner_gate)
    donor_records = RunRecords(donor_dht, "sd", 0, FaultCounter(), signer=donor_signer, gate=donor_gate)
    donor_records.publish_member(swarm_pb2.MemberRecord(run_id="sd", config_hash="0" * 64, stage=0, boundary=BOUNDARY,
                                                        training=True, joined_at=time.time(), peer_name="donor"))  # fmt: skip
    membership = Membership(joiner_records, config_hash="0" * 64, faults=faults)
    membership.refresh()
    sw = SwarmConfig(round_wait=5.0, allreduce_timeout=10.0)
    agreement = Agreement(joiner_records, joiner, membership, sw, faults, Deadlines(sw))
    donor = Donor()
    donor_averager.set_state_provider(donor.offered_state)
    donor_averager.set_state_boundary(BOUNDARY, ready=False)
    complete = StageState(BOUNDARY, donor.theta, donor.momentum, PendingAverage(BOUNDARY - 1, donor.average))
    record = swarm_pb2.RoundRecord(boundary=BOUNDARY, state_hash=complete.hash())
    donor_records.publish_round(record)  # announced at the boundary, the average still in flight

    taken = joiner.download_round(donor_id, BOUNDARY, wait_s=10.0, timeout=10.0, part=swarm_pb2.STATE_NOW)
    assert taken.status == swarm_pb2.STATE_OK and taken.state.follows == BOUNDARY - 1, taken
    with ThreadPoolExecutor(1) as pool:
        fetched = pool.submit(agreement.fetch_pending, taken, [donor_id], lambda: False)
        while not donor_averager.state_wanted():  # the taker's request waits in the donor's averager process
            assert not fetched.done(), fetched.result()
            time.sleep(0.05)
        donor.ready = True
        donor_averager.set_state_boundary(BOUNDARY, ready=True)  # served now; its announcement shows 1.5 s later
        time.sleep(1.5)
        record.pending_hash = complete.pending_hash()
        donor_records.publish_round(record)
        average = fetched.result(timeout=60)
    assert average.kind is AverageKind.AVERAGED, average.note
    assert all(torch.equal(a, b) for a, b in zip(average.tensors, donor.average.tensors))
    assert faults.take()["downloads_failed"] == 0
