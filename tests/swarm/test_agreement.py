"""The stage group agrees on its shared state across CPUs and faults (DESIGN.md, "Agreement").

    pytest tests/swarm/test_agreement.py -q

Real peers on loopback; faults come from dilocox_p2p/injection.py.
"""

from __future__ import annotations


import pytest

from dilocox_p2p.checkpoint import load_checkpoint
from dilocox_p2p.state import state_hash
from tests.helpers.cpu import capabilities

pytestmark = pytest.mark.swarm


def _by_round(peer) -> dict[int, dict]:
    return {r["round"]: r for r in peer.metrics()}


def _faults(peer, name: str) -> int:
    return sum(r["faults"][name] for r in peer.metrics())


def test_peers_on_different_cpu_capabilities_and_inner_precisions_hold_identical_state_every_round_without_repairs(
    swarm,
):
    # one peer trains in fp32 on the lowest instruction set, the other in bf16 on the best: theta_g and the outer
    # step never see bf16, so the two still hold one state bit for bit. (Not bf16 on the lowest: on a CPU with AMX,
    # torch 2.13's bf16 attention below AVX512 fails, "pack_vnni2 is only supported when avx512 is supported".)
    lowest, best = capabilities()[0], capabilities()[-1]
    assert lowest != best, f"this CPU offers only {capabilities()}"
    args = ("--mode", "delayed", "--rounds", "6", "--min-peers", "2", "--stages", "1")
    peers = [
        swarm.start_peer(*args, "--set", "inner.precision=fp32", env={"ATEN_CPU_CAPABILITY": lowest}),
        swarm.start_peer(*args, "--set", "inner.precision=bf16", env={"ATEN_CPU_CAPABILITY": best}),
    ]
    for peer in peers:
        assert peer.wait(timeout=240) == 0, peer.output()
    for peer, capability, precision in zip(peers, (lowest, best), ("fp32", "bf16")):
        assert f"CPU capability {capability.upper()}" in peer.stage_log(0), "the capability was not applied"
        assert f"inner: {precision} on cpu" in peer.stage_log(0), "the precision was not applied"

    a, b = (_by_round(p) for p in peers)
    assert sorted(a) == sorted(b) == list(range(6))
    assert all(a[t]["stage_hashes"] == b[t]["stage_hashes"] for t in a), "the state differs between the CPUs"
    assert all(r["kinds"] == ["averaged"] for r in a.values() if r["applied_round"] is not None)
    for peer in peers:
        assert _faults(peer, "repairs") == _faults(peer, "catch_ups") == 0


def test_a_corrupted_state_is_found_by_the_hash_check_and_repaired_from_the_majority(swarm):
    # corrupted twice: after round 1, and after the last round, which no later hash check looks at
    args = ("--mode", "delayed", "--rounds", "5", "--min-peers", "3")
    healthy = [swarm.start_peer(*args) for _ in range(2)]
    corrupted = swarm.start_peer(*args, env={"DILOCOX_FAULTS": "corrupt_state:round=1:stage=1;corrupt_state:round=4:stage=0"})
    for peer in [*healthy, corrupted]:
        assert peer.wait(timeout=300) == 0, peer.output()

    a, b, c = (_by_round(p) for p in (*healthy, corrupted))
    assert all(a[t]["stage_hashes"] == b[t]["stage_hashes"] for t in a), "the healthy peers disagree"
    # the flipped bit shows in stage 1's hash right after round 1 ...
    assert c[1]["stage_hashes"][0] == a[1]["stage_hashes"][0]
    assert c[1]["stage_hashes"][1] != a[1]["stage_hashes"][1]
    # ... the check of that boundary runs as soon as the others' records are in, during round 2, and the next
    # boundary repairs it: one round trained on the diverged state, never two. The repair takes the state of
    # that boundary, or of a later one where the others moved on while it downloaded (under load): then
    # round 2, the one trained on the diverged state, is dropped and nothing else was trained on it
    repaired = [t for t, r in sorted(c.items()) if r["faults"]["repairs"]]
    after = min(t for t in c if t > 1)
    assert repaired and repaired[0] == after, f"repaired at rounds {repaired}, the first record after 1 is {after}"
    assert after == 2 or c[after]["dropped_round"] == 2, f"rounds 2..{after - 1} were trained on the diverged state"
    assert all(c[t]["stage_hashes"] == a[t]["stage_hashes"] for t in c if t >= repaired[0])
    assert max(c) == 4, "the repaired peer did not finish the run"
    # the last round's state is compared as soon as the others' records are in, and taken from them before
    # the peer records, checkpoints and leaves (both stages: a peer's stages take the swarm's state together)
    assert c[4]["faults"]["repairs"] == 2 and c[4]["replaced_stages"] == [0, 1], c[4]
    saved = [load_checkpoint(corrupted.run_dir, stage, 5)["outer"] for stage in range(2)]
    final = [state_hash([*s["theta_g"], *s["momentum"]]) for s in saved]
    assert final == a[4]["stage_hashes"], "the checkpoint of the last round holds the diverged state"
    for peer in healthy:
        assert _faults(peer, "repairs") == 0


def test_a_pair_split_evenly_is_repaired_by_neither_side(swarm):
    # Both stages of the second peer are corrupted after round 1: each stage of the pair is split one against one.
    # The tie went to the peer of the smaller key, and the other took its state: but a hostile peer can force a tie
    # (announce another hash) and generate keys until its own ranks first, then every honest peer it is paired with
    # took the state it served. A tie is now kept: both train on, each on its own state, each told why.
    args = ("--mode", "delayed", "--rounds", "5", "--min-peers", "2")
    peers = [
        swarm.start_peer(*args),
        swarm.start_peer(*args, env={"DILOCOX_FAULTS": "corrupt_state:round=1:stage=0;corrupt_state:round=1:stage=1"}),
    ]
    for peer in peers:
        assert peer.wait(timeout=240) == 0, peer.output()

    rounds = [_by_round(p) for p in peers]
    assert rounds[0][0]["stage_hashes"] == rounds[1][0]["stage_hashes"]
    for stage in (0, 1):  # (a split of the lowest bit may round away in later outer steps)
        assert rounds[0][1]["stage_hashes"][stage] != rounds[1][1]["stage_hashes"][stage], f"stage {stage} not split"
    for peer in peers:
        assert _faults(peer, "repairs") == 0 and _faults(peer, "ties_kept") >= 2, "a tie was taken"
        assert "split evenly among 2 workers" in peer.stage_log(0) and "no side is repaired" in peer.stage_log(1)
        assert all(r["group_sizes"] == [2, 2] for r in peer.metrics()[1:]), "the split pair stopped averaging"


def test_members_that_each_miss_a_different_reducers_parts_mend_them_into_one_average(swarm):
    # Every reducer of stage 0 keeps round 1's average from the member after it in the group's
    # order: each member misses a different span (equal coverage, different coordinates).
    faults = {"DILOCOX_FAULTS": "withhold_average:round=1:stage=0"}
    args = ("--mode", "sync", "--rounds", "4", "--min-peers", "3", "--stages", "1")
    peers = [swarm.start_peer(*args, env=faults) for _ in range(3)]
    for peer in peers:
        assert peer.wait(timeout=240) == 0, peer.output()

    rounds = [_by_round(p) for p in peers]
    for t in range(4):
        assert len({tuple(r[t]["stage_hashes"]) for r in rounds}) == 1, f"round {t}: the peers disagree"
    mended = [r[1] for r in rounds]
    assert all(m["kinds"] == ["mended"] for m in mended), [m["kinds"] for m in mended]
    assert all(m["coverage"] == 1.0 and m["group_sizes"] == [3] for m in mended)
    # the reducers that withheld answered the others' requests: none is suspected, all stay in the group
    assert all(any(r[t]["group_sizes"] == [3] for t in (2, 3)) for r in rounds), "a live member was left out"
    for peer in peers:
        assert _faults(peer, "repairs") == 0
        assert "parts that missed this worker were taken from" in peer.stage_log(0)


def test_a_member_holding_more_than_its_group_takes_the_groups_copy_without_a_download(swarm):
    # Stage 0's reducer on the third peer keeps round 1's averaged parts from both others and lends its copy to
    # nobody (a reducer whose uplink collapsed once it had everyone's data): it holds the whole average, the
    # others cannot mend its span. Before phase 5 it alone kept the whole average (a split, repaired a round
    # later); now it takes the majority's copy by leaving their missing span out of its own.
    args = ("--mode", "sync", "--rounds", "4", "--min-peers", "3", "--stages", "1")
    others = [swarm.start_peer(*args) for _ in range(2)]
    hoarder = swarm.start_peer(*args, env={"DILOCOX_FAULTS": "hoard_average:round=1:stage=0"})
    for peer in [*others, hoarder]:
        assert peer.wait(timeout=240) == 0, peer.output()

    a, b, c = (_by_round(p) for p in (*others, hoarder))
    for t in (0, 1):
        assert a[t]["stage_hashes"] == b[t]["stage_hashes"] == c[t]["stage_hashes"], f"round {t}: the group split"
    # the others suspect the hoarder (it failed them as a reducer) and may average without it for a round or two
    assert all(a[t]["stage_hashes"] == b[t]["stage_hashes"] for t in range(4))
    assert [r[1]["kinds"] for r in (a, b, c)] == [["partial"]] * 3
    assert a[1]["coverage"] == b[1]["coverage"] == c[1]["coverage"] < 1.0
    assert c[1]["faults"]["averages_adopted"] == 1 and c[1]["faults"]["downloads_failed"] == 0
    assert a[1]["groups"] == b[1]["groups"] == c[1]["groups"]
    for peer in others:
        assert _faults(peer, "repairs") == 0
    assert c[1]["faults"]["repairs"] == c[2]["faults"]["repairs"] == 0, "the hoarder's round-1 state was repaired"
    assert a[1]["faults"]["averages_adopted"] == b[1]["faults"]["averages_adopted"] == 0


def test_members_left_with_three_different_copies_apply_none_of_them_and_stay_as_one(swarm):
    # Every reducer keeps round 1's average from the member after it, and no member mends: three copies, each
    # missing another span, one vote each. The tie went to the copy of the peer with the smallest key, which the
    # other two downloaded: the copy a key generated to rank first would win whenever its own lie made a tie. A tie
    # is never adopted now: nobody applies round 1's average, and the three stay as one without a download.
    faults = {"DILOCOX_FAULTS": "withhold_average:round=1:stage=0;skip_mending:round=1:stage=0"}
    args = ("--mode", "sync", "--rounds", "3", "--min-peers", "3", "--stages", "1")
    peers = [swarm.start_peer(*args, env=faults) for _ in range(3)]
    for peer in peers:
        assert peer.wait(timeout=240) == 0, peer.output()

    rounds = [_by_round(p) for p in peers]
    for t in (0, 1):  # later rounds may leave out members suspected for the parts they withheld
        assert len({tuple(r[t]["stage_hashes"]) for r in rounds}) == 1, f"round {t}: the peers disagree"
    assert all(r[1]["kinds"] == ["stranded"] for r in rounds), [r[1]["kinds"] for r in rounds]
    assert all(r[1]["faults"]["ties_kept"] == 1 and r[1]["faults"]["averages_adopted"] == 0 for r in rounds)
    assert all(r[t]["faults"]["repairs"] == 0 for r in rounds for t in (0, 1))
    assert all("split evenly (1 / 1 / 1 of 3 voters)" in p.stage_log(0) for p in peers)
