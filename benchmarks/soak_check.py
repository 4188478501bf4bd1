"""What the churn soak's peers did (benchmarks/soak.py), read from their records and logs, and judged.

check tests the invariants that benchmarks/soak.py's docstring lists (group, agreement, resumption, crashes,
learning; leftovers finds the processes that survived the soak) against every peer's metrics.jsonl, stage-0
log, start-up marks and key files; summarize turns a run into the report's figures per peer, and timeline
draws what each peer did each round beside the val loss.
"""

from __future__ import annotations

import json
import re
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

from benchmarks.soak_chaos import MAX_RETRIES, Soak, SoakPeer, read_records
from dilocox_p2p.swarm.agreement import majority_hash

__all__ = [
    "check", "check_rejoins", "final_val_loss", "group_splits", "leftovers", "minority_streaks",
    "reference_peer", "restart_to_group", "resumptions", "summarize", "timeline", "worker_peer_id",
]  # fmt: skip


# ----- reading what happened --------------------------------------------------------------------------
def check(soak: Soak) -> dict[str, Any]:
    """The invariants (benchmarks/soak.py's docstring) as {name: list of violations}, and the figures of the report."""
    records = {p.index: {r["round"]: r for r in read_records(p.run_dir)} for p in soak.peers}
    violations: dict[str, list[str]] = {"group": [], "agreement": [], "resumption": [], "crashes": [], "learning": []}
    ids = {(p.index, s): worker_peer_id(p.run_dir, s) for p in soak.peers for s in range(soak.args.stages)}
    for stage in range(soak.args.stages):
        violations["group"] += group_splits(records, stage)
        violations["agreement"] += minority_streaks(records, stage, {i: ids[(i, stage)] for i in records})
    for peer in soak.peers:
        violations["resumption"] += check_rejoins(soak, peer, records)
        if peer.proc is not None and peer.proc.returncode not in (0, None):
            violations["crashes"].append(f"peer{peer.index} exited {peer.proc.returncode}")
        if peer.retries > MAX_RETRIES:
            violations["crashes"].append(f"peer{peer.index} could not reach the swarm at {peer.retries} starts")
    vals = [r["val_loss"] for t, r in sorted(records[reference_peer(soak, records)].items())]
    quarter = max(1, len(vals) // 4)
    initial = json.loads((soak.peers[0].run_dir / "run.json").read_text())["initial_val_loss"]
    if not (vals and vals[-1] < initial and sum(vals[-quarter:]) < sum(vals[:quarter])):
        violations["learning"].append(f"val loss {initial:.3f} -> {vals[-1] if vals else None}")
    return {"violations": violations, "records": records}


def reference_peer(soak: Soak, records: dict[int, dict[int, dict]]) -> int:
    """The peer whose curve stands for the swarm's: the first of those holding the majority's state at the last
    round recorded by most (with a tie, the smallest peer id's), among the peers that recorded it."""
    last = max(t for recs in records.values() for t in recs)
    here = {i: recs[last] for i, recs in records.items() if last in recs}
    ids = {i: ":".join(worker_peer_id(soak.peers[i].run_dir, s) for s in range(soak.args.stages)) for i in here}
    majority = majority_hash({ids[i]: "|".join(r["stage_hashes"]) for i, r in here.items()})
    return min(i for i, r in here.items() if "|".join(r["stage_hashes"]) == majority)


def final_val_loss(soak: Soak, records: dict[int, dict[int, dict]]) -> float | None:
    if not any(records.values()):
        return None
    recs = records[reference_peer(soak, records)]
    return recs[max(recs)]["val_loss"]


def group_splits(records: dict[int, dict[int, dict]], stage: int) -> list[str]:
    """Rounds where two peers that held one state applied one group's average and then held different ones."""
    found = []
    for t in sorted({t for recs in records.values() for t in recs}):
        members: dict[tuple[str, str], dict[int, str]] = {}  # (group, hash before) -> {peer: hash after}
        for i, recs in records.items():
            r, before = recs.get(t), recs.get(t - 1)
            if r is None or before is None or not r.get("groups") or r["groups"][stage] is None or r["replaced_stages"]:
                continue
            members.setdefault((r["groups"][stage], before["stage_hashes"][stage]), {})[i] = r["stage_hashes"][stage]
        for (group, _), after in members.items():
            if len(set(after.values())) > 1:
                camps = ", ".join(f"peer{i} {h[:8]}" for i, h in sorted(after.items()))
                found.append(f"stage {stage} round {t}: group {group[:8]} split ({camps})")
    return found


def minority_streaks(records: dict[int, dict[int, dict]], stage: int, ids: dict[int, str]) -> list[str]:
    """Peers holding a minority hash at two rounds running (the majority as the swarm's hash checks define
    it: most holders, a tie to the smallest peer id)."""
    found, diverged = [], {}  # peer -> last round it held a minority hash
    for t in sorted({t for recs in records.values() for t in recs}):
        here = {i: recs[t] for i, recs in records.items() if t in recs}
        majority = majority_hash({ids[i]: r["stage_hashes"][stage] for i, r in here.items()})
        for i, r in here.items():
            if r["stage_hashes"][stage] != majority:
                if diverged.get(i) == t - 1:
                    found.append(f"peer{i} stage {stage}: minority hash at rounds {t - 1} and {t}")
                diverged[i] = t
    return found


def check_rejoins(soak: Soak, peer: SoakPeer, records: dict[int, dict[int, dict]]) -> list[str]:
    """Each restart of `peer` resumed from its last checkpoint and was back in a group within --rejoin-rounds
    swarm rounds of resuming; fills in each kill's figures (seconds to resume and to rejoin, rounds)."""
    found, resumed = [], resumptions(peer.run_dir)
    mine = records[peer.index]
    for n, kill in enumerate(peer.kills):
        restart = soak.t0_wall + kill.get("restart_time", float("inf"))
        after = [(when, k) for when, k in resumed if when >= restart - 1.0]  # log times have whole seconds
        if n + 1 < len(peer.kills) and (not after or after[0][0] > soak.t0_wall + peer.kills[n + 1]["time"]):
            kill["superseded"] = True  # killed again while starting: the next restart is the one to judge
            continue
        if not after:
            found.append(f"peer{peer.index}: restart {n} never resumed (kill at round {kill['last_round']})")
            continue
        when, k = after[0]
        kill["resumed_from_round"], kill["seconds_to_resume"] = k, round(when - restart, 1)
        if k < kill["last_round"]:  # checkpoint k starts round k: the last round recorded is at most lost
            found.append(f"peer{peer.index}: kill {n} at round {kill['last_round']}, resumed from round {k}")
        back = sorted(t for t, r in mine.items() if r["time"] > when and (r.get("group_size") or 0) >= 2)
        swarm_round = 1 + max((t for recs in records.values() for t, r in recs.items() if r["time"] <= when), default=-1)
        kill["resumed_at_swarm_round"], kill["back_round"] = swarm_round, back[0] if back else None
        kill["seconds_to_rejoin"] = round(mine[back[0]]["time"] - when, 1) if back else None
        kill["restart_to_group_s"] = restart_to_group(peer.run_dir, restart)
        if n + 1 < len(peer.kills) and (not back or mine[back[0]]["time"] > soak.t0_wall + peer.kills[n + 1]["time"]):
            kill["superseded"] = True  # killed again before it was back: the next restart is the one to judge
        elif not back or back[0] - swarm_round > soak.args.rejoin_rounds:
            found.append(f"peer{peer.index}: not back in a group within {soak.args.rejoin_rounds} rounds of resuming "
                         f"(restart {n}: resumed at swarm round {swarm_round}, back at {kill['back_round']})")  # fmt: skip
    return found


def restart_to_group(run_dir: Path, restart: float) -> float | None:
    """Seconds from a restart (a Unix time) to the end of the restarted peer's first exchange in a group of two
    or more: its start-up marks (RUN_DIR/startup.jsonl), the life that began at the restart."""
    from dilocox_p2p.startup import read_lives

    for life in read_lives(run_dir):
        if life[0]["phase"] == "process" and life[0]["time"] >= restart - 1.0:
            grouped = [m["time"] for m in life if m["phase"] == "first_group" and m["stage"] == 0]
            return round(grouped[0] - life[0]["time"], 1) if grouped else None
    return None


def resumptions(run_dir: Path) -> list[tuple[float, int]]:
    """(unix time, round) of every "resumed from round k" line of stage 0's log."""
    path = run_dir / "logs" / "stage0.log"
    text = path.read_text(errors="replace") if path.exists() else ""
    return [
        (time.mktime(time.strptime(stamp, "%Y-%m-%d %H:%M:%S")), int(k))
        for stamp, k in re.findall(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d) .*resumed from round (\d+)", text, re.M)
    ]


def worker_peer_id(run_dir: Path, stage: int) -> str:
    """The libp2p peer id of a peer's stage worker (its key file in RUN_DIR/identity/)."""
    from dilocox_p2p.identity import peer_id_of, worker_identity

    path = run_dir / "identity" / f"stage{stage}.ed25519"
    return peer_id_of(worker_identity(path)) if path.exists() else f"~{run_dir.name}"


def leftovers(root: Path) -> list[str]:
    """Processes whose command line names the soak's directory (p2pd's names its identity file there)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                cmdline = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            except OSError:
                continue
            if str(root) in cmdline:
                found.append(f"{proc.name}: {cmdline[:120]}")
    return found


def summarize(soak: Soak, checked: dict[str, Any]) -> dict[str, Any]:
    records = checked["records"]
    peers = {}
    for peer in soak.peers:
        recs = records[peer.index]
        trained = {t for t, r in recs.items() if r.get("dropped_round") is None}
        first = min(recs, default=0)
        peers[f"peer{peer.index}"] = {
            "joined_at_s": round(peer.joined_at, 1),
            "rounds_recorded": len(recs),
            "rounds_lost": len(set(range(first, soak.args.rounds * soak.syncs)) - trained),
            "repairs": sum(r["faults"].get("repairs", 0) for r in recs.values()),
            "catch_ups": sum(r["faults"].get("catch_ups", 0) for r in recs.values()),
            "averages_adopted": sum(r["faults"].get("averages_adopted", 0) for r in recs.values()),
            "retries": peer.retries,
            "bytes_sent": sum(r["bytes_sent"] for r in recs.values()),
            "bytes_received": sum(r["bytes_received"] for r in recs.values()),
            "kills": peer.kills,
            "final_val_loss": recs[max(recs)]["val_loss"] if recs else None,
        }
    return {"events": [asdict(e) for e in soak.events], "peers": peers,
            "final_val_loss": final_val_loss(soak, records)}  # fmt: skip


def timeline(soak: Soak, checked: dict[str, Any], path: Path, baseline_loss: float | None) -> None:
    """One row per peer: what it did each round (averaged, alone, repaired, dropped, absent), events marked."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    colors = {"group": "#4c9a2a", "first round": "#a6d68f", "alone": "#e0b000", "repaired": "#d05a00",
              "dropped": "#c00000", "absent": "#dddddd"}  # fmt: skip
    records, n_rounds = checked["records"], soak.args.rounds * soak.syncs
    fig, (ax, loss_ax) = plt.subplots(2, 1, figsize=(12, 1.2 + 0.45 * len(soak.peers) + 3), height_ratios=[len(soak.peers), 4])
    for row, peer in enumerate(soak.peers):
        for t in range(n_rounds):
            r = records[peer.index].get(t)
            state = ("absent" if r is None else "dropped" if r.get("dropped_round") is not None
                     else "repaired" if r.get("replaced_stages") else "first round" if r.get("group_size") is None
                     else "group" if r["group_size"] >= 2 else "alone")  # fmt: skip
            ax.add_patch(plt.Rectangle((t, row - 0.4), 1, 0.8, color=colors[state], lw=0))
    for e in soak.events:
        if e.time is not None and e.peer is not None:
            ax.annotate(e.kind, (e.fired_round, e.peer), fontsize=7, ha="center", va="center", color="black",
                        bbox={"boxstyle": "round,pad=0.1", "fc": "white", "alpha": 0.8})  # fmt: skip
    ax.set_xlim(0, n_rounds)
    ax.set_ylim(-0.6, len(soak.peers) - 0.4)
    ax.set_yticks(range(len(soak.peers)), [f"peer{p.index}" for p in soak.peers])
    ax.set_xlabel("round")
    ax.legend(handles=[Patch(color=c, label=k) for k, c in colors.items()], ncol=6, loc="upper center",
              bbox_to_anchor=(0.5, 1.25), fontsize=8)  # fmt: skip
    for peer in soak.peers:
        recs = sorted(records[peer.index].items())
        loss_ax.plot([t for t, _ in recs], [r["val_loss"] for _, r in recs], lw=1, label=f"peer{peer.index}")
    if baseline_loss is not None:
        loss_ax.axhline(baseline_loss, ls="--", color="gray", label="churn-free final")
    loss_ax.set_xlabel("round")
    loss_ax.set_ylabel("val loss (theta_g)")
    loss_ax.legend(fontsize=7, ncol=4)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
