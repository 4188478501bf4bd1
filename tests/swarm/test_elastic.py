"""Peers come and go: a crash mid all-reduce, a late joiner, a peer with another config, a clean stop.

    pytest tests/swarm/test_elastic.py -q
"""

from __future__ import annotations

import os
import signal
import time

import hivemind
import pytest

from benchmarks.soak import worker_peer_id
from dilocox_p2p.proto_gen import envelope_pb2, swarm_pb2
from dilocox_p2p.swarm.record_rules import MEMBER_TTL_S
from tests.helpers.waits import wait_for

pytestmark = pytest.mark.swarm

ROUND_WAIT, CHUNK_TIMEOUT, ALLREDUCE_TIMEOUT = 10.0, 5.0, 30.0  # as in tests/helpers/peers.py


def _hashes(peer):
    return {r["round"]: r["stage_hashes"] for r in peer.metrics()}


def _wait_until_dead(peer, timeout):
    deadline = time.monotonic() + timeout
    while peer.proc.poll() is None:
        assert time.monotonic() < deadline, f"peer still alive after {timeout}s:\n{peer.output()}"
        time.sleep(0.1)
    return time.time()


@pytest.mark.parametrize("compression", [("--compression", "none"), ("--compression", "int8")], ids=["fp32", "int8"])
def test_a_peer_killed_during_an_all_reduce_does_not_stall_the_others(swarm, compression):
    # int8: the victim dies once its parts went out, before its reduced part did (the compressed butterfly);
    # its span is missing alike on both survivors, or one of them mends it from the other
    args = ("--mode", "delayed", "--rounds", "6", "--min-peers", "3", "--stages", "1", *compression)
    survivors = [swarm.start_peer(*args) for _ in range(2)]
    victim = swarm.start_peer(*args, env={"DILOCOX_FAULTS": "kill_peer_in_allreduce:round=2:stage=0"})
    killed_at = _wait_until_dead(victim, timeout=180)
    assert victim.proc.returncode == -signal.SIGKILL
    assert not any(r["round"] >= 3 for r in victim.metrics())  # it died in round 2's all-reduce

    for peer in survivors:
        assert peer.wait(timeout=240) == 0, peer.output()
    a, b = (_hashes(p) for p in survivors)
    assert sorted(a) == sorted(b) == list(range(6))
    assert all(a[t] == b[t] for t in a), "survivors disagree on theta_g"
    records = {r["round"]: r for r in survivors[0].metrics()}
    # the all-reduce of round 2 lost the victim's share on stage 0, identically on both survivors
    applied_2 = next(r for r in records.values() if r["applied_round"] == 2)
    assert applied_2["coverage"] < 1.0 or applied_2["group_sizes"][0] == 2
    # the round after the crash finished within the timeouts plus one round
    one_round = max(r["seconds_round"] for r in records.values() if r["round"] < 2)
    next_round = min((r for r in records.values() if r["time"] > killed_at), key=lambda r: r["round"])
    assert next_round["time"] - killed_at < ROUND_WAIT + ALLREDUCE_TIMEOUT + one_round + 5
    # from then on, the survivors average as a pair
    assert records[5]["group_sizes"] == [2] * len(records[5]["stage_hashes"])


def test_a_stranded_member_waits_for_its_partner_still_in_the_rounds_exchange_and_takes_its_state(swarm):
    # The killed-peer test's race (CI run 229), made to happen: A ends round 2 stranded (as when its leader died
    # before its last answer), B is still in that exchange for HOLD_END_S more (as when it waits out the dead
    # member's parts). A resyncs at its boundary: it must wait for B to reach it and take B's state. It gave up
    # after its attempts (about 8 s), and the pair, 1 against 1, a tie that is never repaired, trained on split.
    args = ("--mode", "delayed", "--rounds", "6", "--min-peers", "2", "--stages", "1")
    a = swarm.start_peer(*args, env={"DILOCOX_FAULTS": "drop_average:round=2:stage=0"})
    b = swarm.start_peer(*args, env={"DILOCOX_FAULTS": "hold_exchange_end:round=2:stage=0"})
    for peer in (a, b):
        assert peer.wait(timeout=240) == 0, peer.output()
    log = a.stage_log(0)
    assert "round 2: nothing applied (stranded)" in log and "took the state of round" in log, log[-3000:]
    assert "could not take the swarm's state" not in log, log[-3000:]
    a_hashes, b_hashes = _hashes(a), _hashes(b)  # A's rounds from its resync on are B's (it may skip some)
    assert a_hashes[5] == b_hashes[5], (a_hashes, b_hashes)
    assert all(a_hashes[t] == b_hashes[t] for t in a_hashes if t >= 3), (a_hashes, b_hashes)


def test_a_peer_with_another_config_is_refused_and_sigterm_leaves_cleanly(swarm):
    host = swarm.start_peer("--rounds", "200")
    host.wait_for_round(0, timeout=120)
    # the stranger's first heartbeat is never stored (slow_first_beat): its refusal comes first, as it may on a
    # loaded box, and only the record it leaves behind tells the host (one of 40 runs failed here without it)
    stranger = swarm.start_peer("--rounds", "200", "--inner-lr", "0.003", env={"DILOCOX_FAULTS": "slow_first_beat:stage=0"})
    assert stranger.wait(timeout=120) == 2
    refusal = stranger.output()
    assert "trains with config hash" in refusal and "inner.lr: 0.003 here, 0.001 in the run" in refusal
    deadline = time.monotonic() + 30  # the host, alone, reads the stage's records every HEARTBEAT_S
    while "refusing" not in (host.run_dir / "logs" / "stage0.log").read_text():
        assert time.monotonic() < deadline, "the host never logged the refusal"
        time.sleep(0.5)

    # SIGTERM to the whole process group (systemd's default KillMode, `kill -TERM -PGID`): each stage gets it
    # twice (directly and forwarded by the launcher), its DHT node and p2p daemon die at once; the peer still
    # stops cleanly, promptly, with its checkpoint
    rounds_before = len(host.metrics())
    stopped = time.monotonic()
    os.killpg(host.proc.pid, signal.SIGTERM)
    assert host.wait(timeout=60) == 128 + signal.SIGTERM
    assert time.monotonic() - stopped < 10, "the stop waited out the swarm's timeouts (or a DHT process gone)"
    assert "stopped; the last checkpoint is at round" in host.output()
    checkpoints = sorted((host.run_dir / "checkpoints" / "stage0").glob("round*.pt"))
    assert checkpoints and int(checkpoints[-1].stem[5:]) >= rounds_before
    with pytest.raises(ProcessLookupError):  # nothing of the peer is left running (p2pd included)
        for _ in range(50):
            os.killpg(host.proc.pid, 0)
            time.sleep(0.2)


def test_a_peer_frozen_for_two_rounds_catches_up_with_the_swarm(swarm):
    # the run lasts until the thawed peer has caught up and averaged with both others again, however long that
    # takes on a loaded box; then every peer stops. The freeze outlasts every member record (MEMBER_TTL_S): the
    # thawed peer's view of the others expired, and its first lookups after waking may find nobody (its DHT
    # requests in flight all failed at once on waking): it must not take that for the others' departure and train
    # on alone, ahead of them (churn soak, CI run 170: it raced 20 rounds ahead, and the others took its state)
    args = ("--mode", "delayed", "--rounds", "200", "--min-peers", "3", "--stages", "1")
    others = [swarm.start_peer(*args) for _ in range(2)]
    frozen = swarm.start_peer(*args)
    frozen.wait_for_round(1, timeout=180)
    frozen.freeze()  # SIGSTOP: a swapped-out machine, a preempted VM
    frozen_at = time.monotonic()
    try:
        stopped_at = max(r["round"] for r in frozen.metrics())
        wait_for(lambda: max(r["round"] for r in others[0].metrics()) >= stopped_at + 3, 180,
                  lambda: f"the others stalled while a peer was frozen:\n{others[0].output()}")
        time.sleep(max(0.0, frozen_at + MEMBER_TTL_S + 2 - time.monotonic()))
    finally:
        frozen.thaw()
    thawed_at = max(r["round"] for r in others[0].metrics())
    wait_for(lambda: any(r["round"] > thawed_at and r["group_sizes"] == [3] for r in frozen.metrics()), 180,
              lambda: f"the thawed peer never averaged with both others again:\n{frozen.output()}")
    for peer in [*others, frozen]:
        peer.signal(signal.SIGTERM)
    for peer in [*others, frozen]:
        assert peer.wait(timeout=120) == 128 + signal.SIGTERM, peer.output()

    a, b, c = (_hashes(p) for p in (*others, frozen))
    # SIGTERM may stop a peer a round earlier; and one of them may be stranded in the round the third froze in and
    # take the swarm's state, skipping the rounds its download covered: a request to the frozen peer, whose
    # declaration stays in the DHT, waits out request_timeout, and on a loaded box two such waits used up its
    # matchmaking (busy-core run of 29ae5fa). They agree on every round both recorded all the same
    common = sorted(set(a) & set(b))
    assert len(common) >= 3 and common[:2] == [0, 1], f"the peers that kept going share rounds {common} only"
    assert all(a[t] == b[t] for t in common), "the peers that kept going disagree"
    records = {r["round"]: r for r in frozen.metrics()}
    # thawed, it takes the swarm's state through whichever check fires first: that it is rounds behind
    # (a catch-up) or that its state differs from the majority's (a repair)
    caught_up = [t for t, r in sorted(records.items()) if r["faults"]["catch_ups"] or r["faults"]["repairs"]]
    assert caught_up, "the frozen peer never took the swarm's state"
    assert "this process did not run for" in frozen.stage_log(0)  # it knew it had been stopped (swarm/stall.py)
    alone = [t for t, r in records.items() if "alone" in r["kinds"]]
    assert not alone, f"the thawed peer trained alone in rounds {alone} while the others trained:\n{frozen.output()}"
    assert set(range(max(records))) - set(records), "the frozen peer skipped no round: it was never two rounds behind"
    after = [t for t in records if t >= caught_up[0] and t in a]
    assert after and all(c[t] == a[t] for t in after), "the frozen peer differs from the swarm after catching up"


def test_a_two_peer_swarm_survives_a_crash_and_the_restarted_peer_resumes_into_it(swarm):
    # the run lasts until the restarted peer has averaged with the survivor again, however long its
    # start-up takes on a loaded box (the survivor trains on alone meanwhile); then both stop
    args = ("--mode", "delayed", "--rounds", "80", "--min-peers", "2", "--stages", "1")
    survivor = swarm.start_peer(*args)
    victim = swarm.start_peer(*args, env={"DILOCOX_FAULTS": "kill_peer_in_allreduce:round=2:stage=0"})
    killed_at = _wait_until_dead(victim, timeout=180)
    assert victim.proc.returncode == -signal.SIGKILL
    checkpointed = max(r["round"] for r in victim.metrics()) + 1
    restarted_at = time.time()
    resumed = swarm.start_peer(*args, "--resume", run_dir=victim.run_dir)  # restarted at once, as a supervisor would

    def back():
        return {r["round"]: r for r in resumed.metrics() if r["time"] > restarted_at}

    wait_for(lambda: sum(r["group_sizes"] == [2] for r in back().values()) >= 3, 300,
              lambda: f"the resumed peer never averaged with the survivor again:\n{resumed.output()}")
    agreed_until = max(back())
    for peer in (survivor, resumed):
        peer.signal(signal.SIGTERM)
    for peer in (survivor, resumed):
        assert peer.wait(timeout=120) == 128 + signal.SIGTERM, peer.output()

    alone = {r["round"]: r for r in survivor.metrics()}
    assert sorted(alone) == list(range(len(alone)))
    one_round = max(r["seconds_round"] for r in alone.values() if r["round"] < 2)
    next_round = min((r for r in alone.values() if r["time"] > killed_at), key=lambda r: r["round"])
    assert next_round["time"] - killed_at < ROUND_WAIT + ALLREDUCE_TIMEOUT + one_round + 5, "the survivor stalled"

    resumed_rounds = {t: r for t, r in back().items() if t <= agreed_until}
    # until the restarted peer was back the survivor trained alone; a restart that takes the state at once (its
    # pending average follows while it trains) is back at the next boundary, and the survivor never is alone
    # (the victim died in the exchange of round 2, before or after it recorded round 2: the survivor's record of
    # round 3, which applies that exchange, may be anything)
    assert all(r["kinds"] == ["alone"] for t, r in alone.items() if 3 < t <= min(resumed_rounds)), (
        [(t, r["kinds"]) for t, r in sorted(alone.items())]
    )
    # the average of round 2 was in flight at the checkpoint: the restarted peer must take the swarm's state
    # before it trains, of a later boundary if the survivor moved on meanwhile, or of the checkpoint's own
    # boundary once the survivor, still waiting out the lost exchange there, completes it
    first = resumed_rounds[min(resumed_rounds)]
    assert first["round"] >= checkpointed and first["faults"]["catch_ups"] >= 1, (
        "the restarted peer trained from its checkpoint, not the swarm's state"
    )
    # nor did it wait out the deadline of phase 5 for the copy of a member that had died in the round (restarted
    # at once, its new life never announces it: it held the survivor's round 2 back 30 s in CI)
    waited_out = [line for line in survivor.stage_log(0).splitlines() if "records in after" in line]
    assert not waited_out, waited_out
    s = _hashes(survivor)
    common = [t for t in resumed_rounds if t in s]  # SIGTERM may stop the survivor a round earlier
    assert any(resumed_rounds[t]["group_sizes"] == [2] for t in common)
    assert all(s[t] == resumed_rounds[t]["stage_hashes"] for t in common), "the resumed peer differs from the survivor"


@pytest.mark.parametrize(
    "mode",
    [("--mode", "eager"), ("--mode", "streaming", "--fragments", "2", "--overlap-steps", "2", "--inner-steps", "10")],
    ids=["eager", "streaming"],
)
def test_an_overlapped_swarm_loses_a_killed_peer_and_takes_in_a_late_joiner_in_agreement(swarm, mode):
    # eager and streaming train from weights of their own (theta_g plus a correction, or merged weights); the
    # shared state must still agree through a crash mid all-reduce and a join from a downloaded state
    args = (*mode, "--rounds", "60", "--stages", "1")
    survivors = [swarm.start_peer(*args, "--min-peers", "3") for _ in range(2)]
    victim = swarm.start_peer(*args, "--min-peers", "3", env={"DILOCOX_FAULTS": "kill_peer_in_allreduce:round=2:stage=0"})
    _wait_until_dead(victim, timeout=180)
    assert victim.proc.returncode == -signal.SIGKILL
    joiner = swarm.start_peer(*args)
    # twice in a group of 3 after round 2: the joiner's first record may apply round 2's average, which it took
    # with the state it downloaded (the victim's group, of 3 too); counted, it let the test stop the survivors
    # before the first of them had recorded a later round (busy CI run: `later` was empty)
    wait_for(lambda: sum(r["group_sizes"] == [3] and (r["applied_round"] or 0) > 2 for r in joiner.metrics()) >= 2,
              360, lambda: f"the joiner never averaged with the survivors twice:\n{joiner.output()}")  # fmt: skip
    for peer in [*survivors, joiner]:
        peer.signal(signal.SIGTERM)
    for peer in [*survivors, joiner]:
        assert peer.wait(timeout=120) == 128 + signal.SIGTERM, peer.output()

    a, b, mine = (_hashes(p) for p in (*survivors, joiner))
    common = sorted(set(a) & set(b))
    assert common[:4] == [0, 1, 2, 3] and all(a[t] == b[t] for t in common), "the survivors disagree"
    assert min(mine) >= 3, "the joiner started from round 0, not from the swarm's state"
    joined = [t for t in mine if t in a and t in b]
    assert joined and all(mine[t] == a[t] for t in joined), "the joiner differs from the survivors"
    # the survivors went on without the victim: every later exchange was the pair's, or the joiner's too (a
    # joiner quick to catch up can be in the very next one, so that the two never average as a pair)
    later = [r for r in survivors[0].metrics() if (r["applied_round"] or 0) > 2]
    assert later and all(r["group_sizes"] == [2] or r["applied_round"] in mine for r in later), [
        (r["applied_round"], r["group_sizes"]) for r in later
    ]


def test_a_peer_that_stops_tells_the_others_at_once_that_it_no_longer_trains(swarm):
    # its last member record must outlive the one before it: a DHT node keeps the latest expiration, and a
    # record that expired sooner was refused everywhere; the others then took the peer that had left for a
    # training member until its last heartbeat expired, and dialed it in vain when they borrowed an average
    args = ("--rounds", "200", "--stages", "1", "--min-peers", "2")
    stays, leaves = (swarm.start_peer(*args) for _ in range(2))
    leaves.wait_for_round(1, timeout=120)
    leaves.signal(signal.SIGTERM)
    assert leaves.wait(timeout=60) == 128 + signal.SIGTERM, leaves.output()
    assert "could not store" not in leaves.stage_log(0)
    client = hivemind.DHT(initial_peers=swarm.initial, start=True)
    try:
        found = client.get(f"{swarm.run_id}:members:s0", latest=True)
    finally:
        client.shutdown()
    records = {}
    for worker_id, item in found.value.items():
        body = envelope_pb2.Envelope.FromString(envelope_pb2.SignedEnvelope.FromString(item.value).body)
        records[worker_id] = swarm_pb2.MemberRecord.FromString(body.payload)
    assert records[worker_peer_id(stays.run_dir, 0)].training
    assert not records[worker_peer_id(leaves.run_dir, 0)].training, "the others still take the stopped peer for a member"
    stays.signal(signal.SIGTERM)
    assert stays.wait(timeout=60) == 128 + signal.SIGTERM, stays.output()


@pytest.mark.parametrize("compression", [(), ("--compression", "int8")], ids=["fp32", "int8"])
def test_a_member_whose_matchmaking_fails_after_its_leader_counted_it_in_costs_the_others_no_wait(swarm, compression):
    # issue 37's asymmetric matchmaking failure: a follower gives up on its leader's ACCEPTED (its request_timeout
    # ran out) while the leader counts it in, so the group runs with a member that never learnt of it. In the
    # netns lab the three others waited out 125 s of deadlines for it. It answers their parts at once, they leave
    # it out (its span stays as it was: partial), and it borrows their average: their exchange of that round runs
    # out none of its deadlines (a sender banned before another started kept them 5 s: allreduce.py; a part that
    # reached it after another member's had, once it looked for a group again, 12-18 s: group_admission._outside_group).
    # Compressed, the span it was to reduce is missing on every member alike, and nobody asks the others for copies
    # that cannot fill it (each a whole average: 0.5 s of a 0.3 s exchange in the lab, benchmarks/matchmaking_failure.py)
    faulty = range(1, 3)  # the faulty member follows a leader in these rounds (it declares a later start) and gives up
    # the fault is in matchmaking: the others of a whole group would form the next round's without it (group_reuse.py)
    args = ("--mode", "sync", "--stages", "1", "--rounds", "4", "--min-peers", "3", "--set", "swarm.reuse_groups=false",
            *compression)  # fmt: skip
    others = [swarm.start_peer(*args) for _ in range(2)]
    failing = swarm.start_peer(*args, env={"DILOCOX_FAULTS": ";".join(f"abandon_accepted:round={r}:stage=0" for r in faulty)})
    for peer in [*others, failing]:
        assert peer.wait(timeout=300) == 0, peer.output()

    mine = {r["applied_round"]: r for r in failing.metrics() if r["applied_round"] is not None}
    kinds = {t: r["kinds"][0] for t, r in sorted(mine.items())}
    hit = [t for t in faulty if kinds[t] not in ("averaged", "partial", "mended")]  # it was not in their group
    assert hit and "abandon_accepted: dropped the group" in failing.stage_log(0), kinds
    assert all(kinds[t] == "borrowed" for t in hit), kinds  # the others had an average: it took theirs
    for peer in others:
        rounds = {r["applied_round"]: r for r in peer.metrics() if r["applied_round"] is not None}
        seconds = {t: r["allreduce_windows"][0][1] - r["allreduce_windows"][0][0] for t, r in rounds.items()}
        moving = {t: sum(r["exchange_phases"][0].get(k, 0.0) for k in ("transfer", "mend")) for t, r in rounds.items()}
        # a deadline run out lasts as long as the deadline: a sender awaited until sender_timeout (= chunk_timeout)
        # lies in the transfer (after the group formed) and mend of the exchange, a member awaited until round_wait
        # in the exchange as a whole. So each stays below its deadline, far above what scheduling adds: with a core
        # kept busy beside another test the slowest hit round took 3.8 s in all, 2.3 s of it in transfer and mend
        # (its clean rounds 0.3-0.7 s and 0.1-0.3 s); comparing with twice the median failed there (3.78 s)
        shown = {t: (round(seconds[t], 2), round(moving[t], 2)) for t in sorted(rounds)}
        assert all(moving[t] < CHUNK_TIMEOUT and seconds[t] < ROUND_WAIT for t in hit), shown
        if compression:  # the faulty member's span: reduced by nobody, so not mended from anybody
            assert all(rounds[t]["kinds"] == ["partial"] and "mend" not in rounds[t]["exchange_phases"][0] for t in hit), \
                {t: (rounds[t]["kinds"], rounds[t]["exchange_phases"][0]) for t in hit}
        assert all(rounds[t]["stage_hashes"] == mine[t]["stage_hashes"] for t in rounds), "the members disagree"


@pytest.mark.parametrize("compression", [(), ("--compression", "lowrank")], ids=["fp32", "lowrank"])
def test_a_follower_whose_leaders_answer_is_lost_after_it_was_accepted_joins_the_group_late(swarm, compression):
    # The split every CI failure of late November began with: a follower's leader ACCEPTED it, then the answer
    # stream closed before BEGIN_ALLREDUCE, while the leader counted it in; it was left out and borrowed. Here
    # the follower drops BEGIN_ALLREDUCE in rounds 1-4 (fault injection), knowing it was accepted: it asks a
    # member whose part reaches it which group began and joins that group late. Every member averages every
    # round with all three, and nobody waits out a deadline for it. A compressed round learns of the group from
    # a member's request for its message (gather.py) instead of a part.
    faulty = range(1, 5)  # (matchmaking's fault: the groups are not formed again without it, group_reuse.py)
    args = ("--mode", "sync", "--stages", "1", "--rounds", "6", "--min-peers", "3", "--set", "swarm.reuse_groups=false",
            *compression)  # fmt: skip
    others = [swarm.start_peer(*args) for _ in range(2)]
    late = swarm.start_peer(*args, env={"DILOCOX_FAULTS": ";".join(f"lose_begin:round={r}:stage=0" for r in faulty)})
    for peer in [*others, late]:
        assert peer.wait(timeout=300) == 0, peer.output()

    log = late.stage_log(0)
    assert "lose_begin: dropped the group" in log
    assert "to take this worker into its group: accepted, then no group after" in log
    assert "late: its leader accepted this worker" in log
    rounds = [{r["applied_round"]: r for r in p.metrics() if r["applied_round"] is not None} for p in (*others, late)]
    for t in range(6):
        assert len({tuple(r[t]["stage_hashes"]) for r in rounds}) == 1, f"round {t}: the members disagree"
    for t in faulty:  # (round 0 may split on its own at a start on 2 busy cores: seen once in CI, borrowed)
        # every member averaged in the group of 3, the late joiner too; one may have mended a span whose reducer's
        # stream to it ended short (seen twice in fp32 under load, each time with another member's average whole:
        # not this test's point; allreduce.py now says why a reducer's stream ends early)
        kinds = [r[t]["kinds"] for r in rounds]
        assert all(k in (["averaged"], ["mended"]) for k in kinds), (t, kinds)
        assert [r[t]["group_sizes"] for r in rounds] == [[3]] * 3
    # nobody waited out a deadline for it: no reducer banned it for parts that had not started within its
    # sender_timeout, and its question to a member did not fail. Said by the logs, not by the rounds' seconds: in
    # two CI runs one round's every phase, on all three peers, ran about ten times its usual length (matchmaking
    # 1-3 s, transfer 3-5 s; the reniced peers yield to a neighbouring test at nice 0) and the round took 6.4 s
    # with no deadline run out. Once, under the whole tier, a member's parts did not start within 5 s after it joined
    # late: the neighbour's peers were starting at nice 0, 10 levels above these settled ones (peers.py now keeps
    # side-by-side tests at one priority)
    for peer in (*others, late):
        log = peer.stage_log(0)
        assert "never started within" not in log and "could not join group" not in log, log
