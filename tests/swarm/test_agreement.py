"""The stage group agrees on its shared state across CPUs and faults (DESIGN.md, "Agreement").

    pytest tests/swarm/test_agreement.py -q

Real peers on loopback; faults come from dilocox_p2p/injection.py.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

from benchmarks.soak import worker_peer_id
from dilocox_p2p.checkpoint import load_checkpoint
from dilocox_p2p.identity import load_identity, peer_id_of, public_raw, worker_identity
from dilocox_p2p.state import state_hash
from tests.helpers.cpu import capabilities

pytestmark = pytest.mark.swarm


def _by_round(peer) -> dict[int, dict]:
    return {r["round"]: r for r in peer.metrics()}


def _faults(peer, name: str) -> int:
    return sum(r["faults"][name] for r in peer.metrics())


def _rank(peer, stage: int = 0) -> tuple[bytes, str]:
    """Who wins a tie (RunRecords.rank): the worker of the smallest peer key, then of the smallest worker id."""
    return public_raw(load_identity(peer.run_dir / "identity" / "peer.pem")), worker_peer_id(peer.run_dir, stage)


def _crossed_worker_keys(a: Path, b: Path) -> None:
    """Make the stage workers' keys of run directories `a` and `b` so that `a`'s worker id is the smaller in stage
    0 and the larger in stage 1 (a quarter of random draws are)."""
    for _ in range(100):
        for run_dir in (a, b):
            shutil.rmtree(run_dir / "identity", ignore_errors=True)
        ids = [[peer_id_of(worker_identity(d / "identity" / f"stage{s}.ed25519")) for s in (0, 1)] for d in (a, b)]
        if ids[0][0] < ids[1][0] and ids[0][1] > ids[1][1]:
            return
    raise AssertionError("no crossed worker keys in 100 draws")


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
    args = ("--mode", "delayed", "--rounds", "7", "--min-peers", "3")
    healthy = [swarm.start_peer(*args) for _ in range(2)]
    corrupted = swarm.start_peer(*args, env={"DILOCOX_FAULTS": "corrupt_state:round=1:stage=1;corrupt_state:round=6:stage=0"})
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
    assert max(c) == 6, "the repaired peer did not finish the run"
    # the last round's state is compared as soon as the others' records are in, and taken from them before
    # the peer records, checkpoints and leaves (both stages: a peer's stages take the swarm's state together)
    assert c[6]["faults"]["repairs"] == 2 and c[6]["replaced_stages"] == [0, 1], c[6]
    saved = [load_checkpoint(corrupted.run_dir, stage, 7)["outer"] for stage in range(2)]
    final = [state_hash([*s["theta_g"], *s["momentum"]]) for s in saved]
    assert final == a[6]["stage_hashes"], "the checkpoint of the last round holds the diverged state"
    for peer in healthy:
        assert _faults(peer, "repairs") == 0


def test_a_pair_split_in_both_stages_is_repaired_one_way_the_peer_with_the_smaller_key_keeping_its_state(swarm):
    # Both stages of the second peer are corrupted after round 1: each stage of the pair is split one against one.
    # The first peer's worker id is the smaller in stage 0 and the larger in stage 1: a tie broken by worker id put
    # each peer in the minority of one stage, both resynced at once and neither found a donor that trained. Broken by
    # peer key, one peer wins the tie in both stages and the other takes its state.
    _crossed_worker_keys(swarm.root / "peer0", swarm.root / "peer1")
    args = ("--mode", "delayed", "--rounds", "5", "--min-peers", "2")
    peers = [
        swarm.start_peer(*args),
        swarm.start_peer(*args, env={"DILOCOX_FAULTS": "corrupt_state:round=1:stage=0;corrupt_state:round=1:stage=1"}),
    ]
    for peer in peers:
        assert peer.wait(timeout=240) == 0, peer.output()

    rounds = [_by_round(p) for p in peers]
    assert rounds[0][1]["stage_hashes"][0] != rounds[1][1]["stage_hashes"][0], "stage 0 was not split"
    assert rounds[0][1]["stage_hashes"][1] != rounds[1][1]["stage_hashes"][1], "stage 1 was not split"
    winner = 0 if _rank(peers[0]) < _rank(peers[1]) else 1
    repaired = [_faults(p, "repairs") for p in peers]
    assert repaired[winner] == 0 and repaired[1 - winner] == 2, f"repairs {repaired}, peer {winner} wins the tie"
    assert [r["replaced_stages"] for r in rounds[1 - winner].values() if r["replaced_stages"]] == [[0, 1]]
    common = sorted(set(rounds[0]) & set(rounds[1]))
    assert max(common) == 4, f"rounds in common {common}"
    assert all(rounds[0][t]["stage_hashes"] == rounds[1][t]["stage_hashes"] for t in common if t >= 2), "split after"
    for peer in peers:
        assert "could not take the swarm's state" not in peer.stage_log(0)


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


def test_members_that_cannot_take_the_copy_their_group_agreed_on_take_the_swarms_state_before_recording_a_split(
    swarm,
):
    # As below, three copies of round 1's average, the tie going to the smallest peer key's; but the other two
    # cannot download it (their requests fail). Each knows its copy is off: it takes the swarm's state at the
    # boundary, before that round's state is used or recorded, instead of training a round on a split.
    faults = "withhold_average:round=1:stage=0;skip_mending:round=1:stage=0;skip_adopting:round=1:stage=0"
    args = ("--mode", "sync", "--rounds", "3", "--min-peers", "3", "--stages", "1")
    peers = [swarm.start_peer(*args, env={"DILOCOX_FAULTS": faults}) for _ in range(3)]
    for peer in peers:
        assert peer.wait(timeout=240) == 0, peer.output()

    rounds = [_by_round(p) for p in peers]
    ranks = [_rank(p) for p in peers]
    kept = ranks.index(min(ranks))
    for t in range(3):  # a repaired member took a later state and dropped the round: it recorded no split
        held = {tuple(r[t]["stage_hashes"]) for r in rounds if t in r}
        assert len(held) == 1, f"round {t}: the peers disagree"
    assert rounds[kept][1]["kinds"] == ["partial"] and rounds[kept][1]["coverage"] < 1.0
    assert all(2 in r for r in rounds), "a peer ended without a record of the last round"
    for i, peer in enumerate(peers):
        assert _faults(peer, "averages_adopted") == 0
        off = "differs from its group's majority" in peer.stage_log(0)
        assert off == (i != kept), f"peer {i}: its copy was {'' if off else 'not '}found off the group's"
        if i != kept:  # the kept peer may be repaired too, at the last boundary: it trained the round between alone
            assert "resyncing with the swarm (hash mismatch)" in peer.stage_log(0)
            assert rounds[i].get(1, rounds[i][2])["faults"]["repairs"] == 1


def test_members_left_with_three_different_copies_all_take_the_one_of_the_smallest_peer_key(swarm):
    # Every reducer keeps round 1's average from the member after it, and no member mends: three copies, each
    # missing another span. No majority: the tie goes to the copy of the peer with the smallest key (as the hash
    # check's does), which the other two download and check against its announced hash.
    faults = {"DILOCOX_FAULTS": "withhold_average:round=1:stage=0;skip_mending:round=1:stage=0"}
    args = ("--mode", "sync", "--rounds", "3", "--min-peers", "3", "--stages", "1")
    peers = [swarm.start_peer(*args, env=faults) for _ in range(3)]
    for peer in peers:
        assert peer.wait(timeout=240) == 0, peer.output()

    rounds = [_by_round(p) for p in peers]
    for t in (0, 1):  # later rounds may leave out members suspected for the parts they withheld
        assert len({tuple(r[t]["stage_hashes"]) for r in rounds}) == 1, f"round {t}: the peers disagree"
    adopted = sorted(r[1]["faults"]["averages_adopted"] for r in rounds)
    assert adopted == [0, 1, 1], adopted
    assert all(r[1]["kinds"] == ["partial"] and r[1]["coverage"] < 1.0 for r in rounds)
    ranks = [_rank(p) for p in peers]
    kept = [i for i, r in zip(ranks, rounds) if r[1]["faults"]["averages_adopted"] == 0]
    assert kept == [min(ranks)], "the copy kept is not the one of the peer with the smallest key"
    # one copy by adoption, no repair; round 2 may leave out a member suspected for the parts it withheld,
    # which then takes the others' final state (a repair at the last boundary)
    assert all(r[t]["faults"]["repairs"] == 0 for r in rounds for t in (0, 1))
