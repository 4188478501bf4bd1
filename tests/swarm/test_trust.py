"""Hostile peers cannot make honest ones disagree, crash, or average what they should not
(docs/security.md, DESIGN.md "Wire protocol and trust").

    pytest tests/swarm/test_trust.py -q

Real peers on loopback; the hostile ones are a forging DHT node (tests/helpers/forger.py)
and peers with faults armed (dilocox_p2p/injection.py) that skip their own checks.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from dilocox_p2p.cli.__main__ import main as cli
from dilocox_p2p.identity import peer_id_of, worker_identity
from dilocox_p2p.wire import PROTOCOL_VERSION
from tests.helpers.peers import Swarm
from tests.helpers.waits import wait_for

pytestmark = pytest.mark.swarm

ONE_STAGE = ("--stages", "1", "--inner-steps", "5")


def _by_round(peer) -> dict[int, dict]:
    return {r["round"]: r for r in peer.metrics()}


def _faults(peer, name: str) -> int:
    return sum(r["faults"][name] for r in peer.metrics())


def _agree(*peers) -> None:
    rounds = [_by_round(p) for p in peers]
    assert all(sorted(r) == sorted(rounds[0]) for r in rounds), [sorted(r) for r in rounds]
    for t in rounds[0]:
        assert len({tuple(r[t]["stage_hashes"]) for r in rounds}) == 1, f"round {t}: honest peers disagree"


def _start_forger(swarm, out):
    """The forging DHT node (tests/helpers/forger.py), attacking the swarm's stage-0 workers, once the first
    peer listens (a plain hivemind node tries its initial peers once)."""
    swarm.peers[0].maddrs()
    return subprocess.Popen(
        [sys.executable, "-m", "tests.helpers.forger", "--initial-peers", *swarm.initial, "--run-id", swarm.run_id,
         "--out", str(out), "--seconds", "120"],
        stdout=open(out.with_suffix(".out"), "w"), stderr=subprocess.STDOUT, start_new_session=True,
    )  # fmt: skip


def _passes(out, forger) -> int:
    """The passes of its attack the forger has written to `out` (its JSON counts) so far; it must still run."""
    assert forger.poll() is None, out.with_suffix(".out").read_text()[-3000:]
    try:
        return json.loads(out.read_text())["passes"]
    except (OSError, ValueError):  # not written yet, or half written
        return 0


def test_forged_records_and_nan_or_outsized_contributions_are_refused_their_sender_banned_and_honest_peers_agree(
    swarm, tmp_path
):
    """Two honest peers, a third that sends NaN (round 1) and 1000x (rounds 2 to 5) pseudo-gradients, and
    a forging DHT node that writes every kind of bad record meanwhile. Its third strike may come in round 3, 4
    or 5: a round its contribution reaches no reducer (CI run 155: round 2's leader counted it in after it had
    given up on that leader, and the group averaged without its parts) strikes nobody."""
    args = (*ONE_STAGE, "--mode", "sync", "--rounds", "8", "--min-peers", "3")
    hostile = ";".join([
        "send_nan_pseudo_gradient:round=1:stage=0",
        *(f"send_huge_pseudo_gradient:round={t}:stage=0" for t in (2, 3, 4, 5)),
    ])  # fmt: skip
    honest = [swarm.start_peer(*args), swarm.start_peer(*args)]
    forger = _start_forger(swarm, tmp_path / "forger.json")
    # the run begins (the honest peers wait for the third) once the forger attacks: started with the run, it made two
    # passes in all of its 8 rounds once, beside a busy core (it imports hivemind and joins the DHT meanwhile)
    wait_for(lambda: _passes(tmp_path / "forger.json", forger) >= 2, 120,
             lambda: f"the forger made fewer than 2 passes:\n{(tmp_path / 'forger.out').read_text()[-3000:]}")
    broken = swarm.start_peer(*args, env={"DILOCOX_FAULTS": hostile})
    try:
        for peer in honest:
            assert peer.wait(timeout=300) == 0, peer.output()
    finally:
        forger.kill()
        forger.wait(30)
    broken.kill()
    attempts = json.loads((tmp_path / "forger.json").read_text())
    assert attempts["passes"] >= 3 and all(attempts.values()), attempts

    _agree(*honest)
    a = _by_round(honest[0])
    assert a[0]["group_size"] == 3, "the hostile peer took part before it misbehaved"
    for peer in honest:
        log = peer.stage_log(0)
        # the contributions: left out with the reason, three strikes, banned
        assert "not finite (NaN or Inf)" in log and "x the group's median" in log, "no reason logged"
        assert _faults(peer, "contributions_refused") >= 3
        assert _faults(peer, "peers_banned") == 1
        assert "banned" in log
        # the records: refused by the DHT node with the reason; nothing forged moved an honest peer
        assert _faults(peer, "repairs") == _faults(peer, "catch_ups") == 0, "a forged record moved an honest peer"
        for reason in (
            "claimed by the wrong key",  # a record under a victim's peer id, signed by the forger
            "stored under another key (replayed)",  # a victim's real record of an earlier boundary
            "refused before parsing",  # oversized
            "malformed envelope",
            "a plain value (no signed subkey): it would replace every record under its key",
            "envelope of run 'another-run'",
        ):
            assert reason in log, f"no refusal logged for: {reason}"
    # the forger's third parties (validly signed, no members) never vote, and once banned the hostile
    # peer is in no honest group
    assert all(a[t]["group_size"] == 2 for t in a if t >= 6), {t: a[t]["group_size"] for t in a}
    # nothing it sent reached theta_g: the model stays finite and goes on learning
    losses = [r["val_loss"] for _, r in sorted(a.items()) if r["val_loss"] is not None]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0], losses


def _final_val(peer) -> float:
    return [r["val_loss"] for r in peer.metrics() if r["val_loss"] is not None][-1]


def test_an_admitted_peer_sending_sign_flipped_contributions_under_the_screen_for_ten_rounds_costs_the_others_little(
    swarm, tmp_path
):
    # The hostile peer sends -4x its pseudo-gradient every round (int8, join's default): under the norm screen's
    # bar, so nothing strikes it (at -9x some parts crossed 10x: struck three times, it was banned within the run);
    # the clip (1.5 x the group's lower median) weighs it as 1.5 honest members, and the direction screen leaves it
    # out. Its three honest partners end within 2% of the val loss of the same three (same data) alone, at equal
    # tokens. (With two honest partners the coordinate median is the smaller honest value: late in the run, where
    # the pseudo-gradients are mostly noise, the flip passed it in a CI run, +7% at round 9: three, not two.)
    args = (*ONE_STAGE, "--mode", "sync", "--rounds", "10")
    by_themselves = Swarm(tmp_path / "all-honest", run_id=f"{swarm.run_id}-all-honest")  # both swarms at once
    try:
        alone = [by_themselves.start_peer(*args, "--min-peers", "3") for _ in range(3)]
        honest = [swarm.start_peer(*args, "--min-peers", "4") for _ in range(3)]
        hostile = swarm.start_peer(*args, "--min-peers", "4", env={"DILOCOX_FAULTS": "send_flipped_pseudo_gradient:stage=0"})
        for peer in [*alone, *honest]:
            assert peer.wait(timeout=300) == 0, peer.output()
    finally:
        by_themselves.stop_all()
    hostile.kill()

    _agree(*honest)
    _agree(*alone)
    assert all(r["group_size"] == 4 for r in honest[0].metrics()[1:]), "the hostile peer was left out: not tested"
    base, attacked = _final_val(alone[0]), _final_val(honest[0])
    assert attacked <= 1.02 * base, f"val loss {attacked:.4f} beside the hostile peer, {base:.4f} without it"


def test_a_bit_flipped_message_is_refused_and_a_peer_speaking_another_protocol_is_turned_away(swarm):
    # one strike bans: once the flipper is out, the honest pair averages in clean groups of two
    # (14 rounds: the run must still train when the newcomer, started after round 0, reads its records)
    args = (*ONE_STAGE, "--mode", "sync", "--rounds", "14", "--min-peers", "3", "--compression", "int8",
            "--set", "swarm.ban_after=1")  # fmt: skip
    honest = [swarm.start_peer(*args), swarm.start_peer(*args)]
    flipper = swarm.start_peer(*args, env={"DILOCOX_FAULTS": "flip_served_bit:stage=0"})
    # a newcomer of another release, waiting for peers of its own, is turned away once the run trains. It comes
    # once the run has begun: started with the others, it could join before them (its record's joined_at first),
    # and a peer that was there first is no newcomer to turn away (CI run 153: it waited until killed)
    honest[0].wait_for_round(0, timeout=180)
    other = swarm.start_peer(*args, env={"DILOCOX_FAULTS": "speak_other_protocol"})
    assert other.wait(timeout=120) == 2, other.output()
    ours, theirs = PROTOCOL_VERSION, PROTOCOL_VERSION + 1
    assert f"speaks wire protocol version {ours}" in other.output() and f"this peer speaks {theirs}" in other.output()
    for peer in honest:
        assert peer.wait(timeout=300) == 0, peer.output()
    flipper.kill()

    _agree(*honest)
    for peer in honest:
        log = peer.stage_log(0)
        assert "does not match its author's signed SHA-256 (altered)" in log
        assert _faults(peer, "contributions_refused") >= 1 and _faults(peer, "peers_banned") == 1
    # Each side refuses the other's records with the reason, by the same check (Gate.open). Asserted on the newcomer,
    # which must read the run's records to be turned away: a peer in a group reads the DHT's member records only
    # every REFRESH_S (pushes bring its partners'), and the newcomer's lives MEMBER_TTL_S, so an honest peer may
    # never see it (the official CI of 5083bef; under load, neither did, nor the banned flipper)
    first = peer_id_of(worker_identity(honest[0].run_dir / "identity" / "stage0.ed25519"))
    assert f"protocol version {ours} from {first[:20]}" in other.stage_log(0), other.stage_log(0)[-3000:]
    assert all(r["group_size"] <= 2 for r in honest[0].metrics()), "a tampered message was averaged"


def test_a_reducer_that_sends_members_different_bytes_is_proven_by_its_own_digests_and_banned(swarm):
    # The liar serves each member its reduced part with another bit flipped, behind a digest it signs for those
    # very bytes: nothing was altered on the way, so no single copy shows it. Side by side in phase 5 (each
    # member announces the digests its copy was assembled from), two digests it signed for one part prove it.
    # int8, join's default. The fp32 butterfly signed nothing before (issue 38, point 1): its digests are proven in
    # test_allreduce (three real averagers), and phase 5 and the ban that follow are the same code as here
    args = (*ONE_STAGE, "--mode", "sync", "--rounds", "6", "--min-peers", "3", "--compression", "int8")
    honest = [swarm.start_peer(*args), swarm.start_peer(*args)]
    liar = swarm.start_peer(*args, env={"DILOCOX_FAULTS": "equivocate_reduced:stage=0"})
    for peer in honest:
        assert peer.wait(timeout=300) == 0, peer.output()
    liar.kill()

    _agree(*honest)  # phase 5 gave both members one copy, whatever each was sent
    liar_id = peer_id_of(worker_identity(liar.run_dir / "identity" / "stage0.ed25519"))
    for peer in honest:
        log = peer.stage_log(0)
        assert f"{liar_id} proven to lie" in log and "it signed two different reduced parts" in log, log[-3000:]
        assert _faults(peer, "peers_banned") == 1
    assert all(r["group_size"] <= 2 for r in honest[0].metrics()[1:]), "the proven liar was averaged with again"


def test_a_serving_peer_that_names_only_itself_cannot_skip_a_borrowers_vote(swarm):
    # The third peer's pseudo-gradient of round 2 is NaN: the other two average without it and it borrows their
    # average. Both serve an outsider the negated average, signed, with a group list naming only the server: with
    # the borrower's voters taken from that list (one voter: no vote) it applied the lie. Its voters are now the
    # admitted members whose own signed records name the group: they hold another copy, the borrower cannot have
    # theirs (the same liars serve it), and it takes the swarm's state at the boundary instead of applying the lie.
    args = (*ONE_STAGE, "--mode", "sync", "--rounds", "5", "--min-peers", "3", "--compression", "none")
    liars = [swarm.start_peer(*args, env={"DILOCOX_FAULTS": "lie_to_borrowers:round=2:stage=0"}) for _ in range(2)]
    borrower = swarm.start_peer(*args, env={"DILOCOX_FAULTS": "nan_pseudo_gradient:round=2:stage=0"})
    for peer in (*liars, borrower):
        assert peer.wait(timeout=300) == 0, peer.output()

    _agree(*liars)
    theirs, its = _by_round(liars[0]), _by_round(borrower)
    assert 4 in its
    for t, record in its.items():  # every state it recorded is the group's: it never used the negated average
        # (round 2's record is there or not, as the state it took was the boundary's or the one after)
        assert record["stage_hashes"] == theirs[t]["stage_hashes"], f"round {t}: the borrower's state differs"
    log = borrower.stage_log(0)
    assert "differs from its group's majority (2 of 2 hold" in log, log[-3000:]
    assert _faults(borrower, "downloads_failed") >= 1  # the liars' copies, refused against their own records' hash
    assert "its copy is not the one its record announced" in log


def test_a_message_cut_short_on_the_way_is_asked_again_and_never_costs_its_author_a_strike(swarm):
    # A connection reset mid-reply ends hivemind's stream as cleanly as a finished one: fewer bytes come than
    # the author signed. That is the link failing, not a forgery. One strike bans here, and CI once saw an
    # honest peer banned for it (its pair then trained apart). The first message `cut` serves ends halfway.
    args = (*ONE_STAGE, "--mode", "sync", "--rounds", "4", "--min-peers", "2", "--compression", "int8",
            "--set", "swarm.ban_after=1")  # fmt: skip
    whole = swarm.start_peer(*args)
    cut = swarm.start_peer(*args, env={"DILOCOX_FAULTS": "cut_served_message:stage=0:serve=1"})
    for peer in (whole, cut):
        assert peer.wait(timeout=240) == 0, peer.output()

    _agree(whole, cut)
    assert "cut short: " in whole.stage_log(0) and "asking again" in whole.stage_log(0)
    for peer in (whole, cut):
        assert _faults(peer, "peers_banned") == 0 and _faults(peer, "contributions_refused") == 0
        assert _faults(peer, "messages_left_out") == 0, "the message asked again did not arrive whole"
        assert all(r["group_size"] == 2 for r in peer.metrics()), "the pair did not average together every round"


def test_a_closed_run_never_averages_a_key_it_does_not_admit(swarm, tmp_path, capsys):
    keys = {}
    for name in ("run", "a", "b", "outsider"):
        assert cli(["keygen", "--out", str(tmp_path / f"{name}.pem")]) == 0
        keys[name] = capsys.readouterr().out.strip()
    assert cli(["certify", "--run-key", str(tmp_path / "run.pem"), "--run-id", swarm.run_id,
                "--peer-key", keys["a"], "--out", str(tmp_path / "a.cert")]) == 0  # fmt: skip
    closed = (
        *ONE_STAGE, "--mode", "sync", "--rounds", "5", "--min-peers", "2",
        "--set", "swarm.admission=closed", "--set", f"swarm.run_key={keys['run']}",
        "--set", f'swarm.allowlist=["{keys["b"]}"]',
    )  # fmt: skip
    a = swarm.start_peer(*closed, "--identity", str(tmp_path / "a.pem"), "--certificate", str(tmp_path / "a.cert"))
    b = swarm.start_peer(*closed, "--identity", str(tmp_path / "b.pem"))
    # an outsider that ignores its own refusal and joins anyway
    outsider = swarm.start_peer(*closed, "--identity", str(tmp_path / "outsider.pem"),
                                env={"DILOCOX_FAULTS": "ignore_admission"})  # fmt: skip
    for peer in (a, b):
        assert peer.wait(timeout=240) == 0, peer.output()
    outsider.kill()

    _agree(a, b)
    for peer in (a, b):
        assert all(r["group_size"] == 2 for r in peer.metrics()), [r["group_size"] for r in peer.metrics()]
        assert "not on this closed run's allowlist and holds no certificate" in peer.stage_log(0)
    assert _faults(a, "requests_refused") + _faults(b, "requests_refused") > 0, "the outsider's requests were not refused"
    # the outsider's own averages never held an honest peer's parts either
    assert all((r["group_size"] or 1) == 1 for r in outsider.metrics()), [r["group_size"] for r in outsider.metrics()]
