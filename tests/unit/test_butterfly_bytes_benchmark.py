"""benchmarks/butterfly_bytes.py's own arithmetic (the runs need root and namespaces: docs/benchmarks.md, section 5)."""

from __future__ import annotations

import pytest
import torch

from benchmarks.butterfly_bytes import message_bytes, stage_shapes, table

pytestmark = pytest.mark.unit


def test_message_sizes_are_the_codecs_own_int8_a_byte_and_fp4_half_a_byte_per_value_plus_block_scales():
    shapes = [torch.Size((64, 128)), torch.Size((128,))]
    values = 64 * 128 + 128
    int8, fp4 = message_bytes("int8", shapes), message_bytes("fp4", shapes)
    assert values * (1 + 2 / 64) < int8 < values * (1 + 2 / 64) + 200  # codes, bf16 scales, a header
    assert values * (0.5 + 2 / 64) < fp4 < values * (0.5 + 2 / 64) + 200
    assert message_bytes("lowrank", shapes) < fp4  # factors at a fixed rank
    assert sum(s.numel() for s in stage_shapes("tiny")) == 241024


def test_the_table_shows_each_runs_ratios_and_a_dash_where_a_run_measured_nothing():
    row = {"kind": "int8", "peers": 4, "message_bytes": 1000, "all_gather_bytes": 3000, "butterfly_bytes": 1500,
           "counted_vs_butterfly": 1.01, "wire_vs_butterfly": None, "wire_not_counted": None,
           "wire_vs_fp32_ring": None, "hashes_equal": True}  # fmt: skip
    line = table([row]).splitlines()[-1]
    assert line == "| int8 | 4 | 1,000 B | 1.010 | 2.00x | - | - | - | - | - | - | True |"
    row.update(exchange_s=0.3, fixed_s=0.26446896)
    assert table([row]).splitlines()[-1] == "| int8 | 4 | 1,000 B | 1.010 | 2.00x | - | - | - | - | 0.300 | 0.264 | True |"


def test_what_the_wire_carried_beside_the_payload_is_split_by_source_per_member_round():
    from benchmarks.butterfly_bytes import _not_counted, sources_per_direction

    # two member-rounds: the exchange both times, a DHT read in one; metered 1.2 MB and 1.0 MB, the interface 1.2 MB
    by_source = {"exchange": [1_000_000, 1_000_000], "dht": [40_000], "own_stages": [5_000]}
    sources = sources_per_direction(by_source, 2, metered=[1_060_000, 1_000_000], wire=1_100_000)
    assert sources == {"dht": 20_000, "exchange": 1_000_000, "libp2p": 10_000, "tcp/ip": 70_000}
    row = {"sources_per_direction": sources, "counted_sent": 990_000, "counted_received": 990_000}
    assert _not_counted(row) == "tcp/ip 70k, dht 20k, exchange 10k, libp2p 10k"
    assert sources_per_direction({}, 0, [], None) == {}


def test_the_spread_of_a_phases_end_is_the_first_members_wait_for_the_last_over_rounds_every_member_recorded():
    from benchmarks.butterfly_bytes import end_spreads

    def record(round, ends):
        return {"round": round, "exchange_phase_ends": [ends]}

    records = [  # two members, three rounds; the second member's round 2 has no phase2 (it borrowed)
        [record(1, {"encode": 10.0, "phase2": 10.5}), record(2, {"encode": 20.0, "phase2": 20.4}), record(3, {})],
        [record(1, {"encode": 10.1, "phase2": 10.8}), record(2, {"encode": 20.3}), record(3, {"encode": 30.0})],
    ]
    assert end_spreads(records, range(1, 4)) == {"encode": 0.2, "phase2": 0.3}
    assert end_spreads([[record(1, {})]], range(1, 2)) == {}
    assert end_spreads([[{"round": 1}], [{"round": 1, "exchange_phase_ends": [None]}]], range(1, 2)) == {}
