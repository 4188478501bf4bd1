#!/usr/bin/env bash
# Start or resume one peer of a dilocox-p2p run, configured by environment variables (systemd's
# peer/dilocox-peer.service, a container and a shell use it alike):
#
#   DILOCOX_CONFIG=peer/one-gpu.toml DILOCOX_RUN_DIR=/var/lib/dilocox-peer/runs/open-350m \
#   DILOCOX_INITIAL_PEERS="/ip4/203.0.113.7/tcp/31337/p2p/12D3KooW..." peer/launch.sh
#
# 1. `dilocox-peer doctor` with the join flags: ports, announce address, initial peers, clock,
#    memory, disk. What a failed check does is set by DILOCOX_DOCTOR (below).
# 2. `dilocox-peer join --resume auto`: it continues the run when RUN_DIR holds one (run.json and
#    a checkpoint of every stage) and starts it otherwise. The join is exec'd: it keeps this
#    script's PID, so a SIGTERM from systemd or `kill` reaches the launcher, which stops every
#    stage cleanly.
#    With DILOCOX_TORCHRUN set (peer/torchrun.sh) it execs torchrun instead, one stage per process.
#
# Variables (the first two are required; an empty one leaves the config file's value):
#   DILOCOX_CONFIG           the TOML config (peer/*.toml)
#   DILOCOX_RUN_DIR          checkpoints, logs, metrics.jsonl, identity/: keep it across restarts
#   DILOCOX_INITIAL_PEERS    bootstrap nodes or live peers, space-separated complete multiaddrs
#   DILOCOX_HOST_MADDRS      listen addresses; stage s listens on PORT+s
#   DILOCOX_ANNOUNCE_MADDRS  the address others dial (public IP / NAT mapping), same base PORT
#   DILOCOX_IDENTITY         the peer key from `dilocox-peer keygen` (default RUN_DIR/identity/peer.pem)
#   DILOCOX_AUTO_RELAY=1     behind NAT without port forwarding: reachable through a relay among
#                            the initial peers (a `dilocox-bootstrap --relay` node)
#   DILOCOX_EXTRA_ARGS       more join flags, split on spaces: "--control-addr 127.0.0.1:7101"
#   DILOCOX_DOCTOR           auto (default): a failed check stops a first start, but is only reported
#                            when RUN_DIR holds checkpoints (one bootstrap node down must not keep a
#                            training peer down);
#                            strict: a failed check always stops; off: no doctor
#   DILOCOX_BIN              the dilocox-peer executable (default: dilocox-peer on PATH)
#   DILOCOX_TORCHRUN         torchrun flags (set by peer/torchrun.sh); DILOCOX_TORCHRUN_BIN (torchrun)
#   DILOCOX_DRY_RUN=1        print the commands, one per line, instead of running them
set -euo pipefail

: "${DILOCOX_CONFIG:?set DILOCOX_CONFIG to the TOML config, e.g. peer/one-gpu.toml}"
: "${DILOCOX_RUN_DIR:?set DILOCOX_RUN_DIR to the run directory (kept across restarts)}"
bin=${DILOCOX_BIN:-dilocox-peer}
doctor=${DILOCOX_DOCTOR:-auto}
dry_run=${DILOCOX_DRY_RUN:-0}

words() { read -r -a "$1" <<< "${2:-}"; }  # split on whitespace without glob expansion

args=(--config "$DILOCOX_CONFIG" --run-dir "$DILOCOX_RUN_DIR")
words peers "${DILOCOX_INITIAL_PEERS:-}"
words host "${DILOCOX_HOST_MADDRS:-}"
words announce "${DILOCOX_ANNOUNCE_MADDRS:-}"
words extra "${DILOCOX_EXTRA_ARGS:-}"
if ((${#peers[@]})); then args+=(--initial-peers "${peers[@]}"); fi
if ((${#host[@]})); then args+=(--host-maddrs "${host[@]}"); fi
if ((${#announce[@]})); then args+=(--announce-maddrs "${announce[@]}"); fi
if [[ -n ${DILOCOX_IDENTITY:-} ]]; then args+=(--identity "$DILOCOX_IDENTITY"); fi
if [[ ${DILOCOX_AUTO_RELAY:-0} == 1 ]]; then args+=(--auto-relay); fi
if ((${#extra[@]})); then args+=("${extra[@]}"); fi

started=0  # for the doctor policy only; join decides with --resume auto
if compgen -G "$DILOCOX_RUN_DIR/checkpoints/stage*/round*.pt" > /dev/null; then
    started=1
    echo "launch.sh: $DILOCOX_RUN_DIR holds checkpoints: the peer will resume" >&2
fi

show() {
    local line
    printf -v line '%q ' "$@"
    echo "${line% }"
}

case $doctor in
    off) ;;
    auto | strict)
        if [[ $dry_run == 1 ]]; then
            show "$bin" doctor "${args[@]}"
        elif ! "$bin" doctor "${args[@]}"; then
            if [[ $doctor == strict || $started == 0 ]]; then
                echo "launch.sh: doctor failed (FAIL lines above): fix them, or set DILOCOX_DOCTOR=off" >&2
                exit 1
            fi
            echo "launch.sh: doctor failed (FAIL lines above); resuming anyway (DILOCOX_DOCTOR=auto)" >&2
        fi
        ;;
    *)
        echo "launch.sh: DILOCOX_DOCTOR must be auto, strict or off, not '$doctor'" >&2
        exit 2
        ;;
esac

if [[ -n ${DILOCOX_TORCHRUN:-} ]]; then
    words torchrun_args "$DILOCOX_TORCHRUN"
    cmd=("${DILOCOX_TORCHRUN_BIN:-torchrun}" "${torchrun_args[@]}" -m dilocox_p2p.cli join)
else
    cmd=("$bin" join)
fi
cmd+=("${args[@]}" --resume auto)
if [[ $dry_run == 1 ]]; then
    show "${cmd[@]}"
    exit 0
fi
exec "${cmd[@]}"
