"""benchmarks/part_overhead.py: what a member serves in a round of the compressed butterfly, beside its payload."""

from __future__ import annotations

import pytest

from benchmarks.part_overhead import measure

pytestmark = pytest.mark.unit


def test_a_member_serves_2_n_minus_1_over_n_of_its_message_plus_one_signed_digest_and_header_per_part():
    n = 3
    row = measure("tiny", "int8", n)
    assert row["pulls_served"] == 2 * (n - 1)  # its parts to the other reducers, its reduced part to the others
    assert 300 < row["signed_head_bytes"] < 500  # an Ed25519-signed envelope with the sender's certificate
    step = row["steps"][0]
    assert 0 < step["part_header_bytes"] < 100 and step["part_bytes"] < row["message_bytes"] / 2
    payload = row["counted_bytes"] - row["pulls_served"] * row["signed_head_bytes"]
    assert row["butterfly_bytes"] <= payload <= 1.01 * row["butterfly_bytes"]  # parts' headers and chunk framing
    low_rank = measure("tiny", "lowrank", n)
    assert [s["phase"] for s in low_rank["steps"]] == [1, 2] and low_rank["pulls_served"] == 4 * (n - 1)
    # a phase-2 part also carries its author's energies (two doubles per factored matrix) and its basis digest
    assert low_rank["steps"][1]["part_header_bytes"] > low_rank["steps"][0]["part_header_bytes"] + 32
