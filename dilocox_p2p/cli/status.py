"""`dilocox-peer status`: what a running peer is doing, read from its control plane (control.py).

    dilocox-peer status runs/demo                 # the address from runs/demo/control.addr
    dilocox-peer status --target 10.0.0.5:7100    # a peer whose --control-addr is reachable from here
    dilocox-peer status runs/demo --json          # the PeerStatus fields, for scripts and monitors
    dilocox-peer status runs/demo --watch         # one line per round as the peer completes it
    dilocox-peer status --target 10.0.0.5:7100 --operator-key operator.key
                                                  # from another host: a key listed in its control.operator_keys
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path
from typing import Any

import grpc
from google.protobuf.json_format import MessageToDict

from ..endpoints import parse_hostport
from ..errors import DilocoxError
from ..proto_gen import control_pb2, control_pb2_grpc

HELP = "show what a running peer is doing (round, losses, throughput, bytes, group, state hashes)"


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("status", help=HELP, description=HELP)
    p.add_argument("run_dir", nargs="?", metavar="RUN_DIR", help="the peer's run directory (reads RUN_DIR/control.addr)")
    p.add_argument("--target", metavar="HOST:PORT", help="the peer's --control-addr, instead of RUN_DIR")
    p.add_argument("--operator-key", type=Path, metavar="FILE",
                   help="sign each request with this key (`dilocox-peer keygen`): a peer on another host serves only "
                   "keys listed in its control.operator_keys")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the status as JSON (the fields of PeerStatus)")
    p.add_argument("--watch", action="store_true", help="then print one line per completed round until the peer stops")
    p.add_argument("--timeout", type=float, default=5.0, metavar="S", help="seconds to wait for the peer (default 5)")
    p.set_defaults(func=main)


def resolve_target(run_dir: str | None, target: str | None) -> str:
    """The control address to dial: --target, or the one the peer wrote to RUN_DIR/control.addr."""
    if target and run_dir:
        raise DilocoxError("give either RUN_DIR or --target, not both")
    if target:
        parse_hostport(target, flag="--target")
        return target
    if not run_dir:
        raise DilocoxError("name the peer: dilocox-peer status RUN_DIR, or --target HOST:PORT")
    path = Path(run_dir) / "control.addr"
    if not Path(run_dir).is_dir():
        raise DilocoxError(f"{run_dir} is not a directory: pass the peer's --run-dir, or --target HOST:PORT")
    if not path.exists():
        raise DilocoxError(f"{path} does not exist: the peer in {run_dir} is not running (or not started yet)")
    return path.read_text().strip()


def _signed(key: Any, method: str, request: Any) -> Any:
    """The metadata of one call signed by `key` (control_auth.py); None without a key."""
    if key is None:
        return None
    from ..control_auth import signed_metadata

    return signed_metadata(key, f"/dilocox.v1.PeerControl/{method}", request)


def fetch_status(target: str, timeout: float, *, key: Any = None) -> control_pb2.PeerStatus:
    request = control_pb2.StatusRequest()
    with grpc.insecure_channel(target) as channel:
        try:
            return control_pb2_grpc.PeerControlStub(channel).GetStatus(
                request, timeout=timeout, metadata=_signed(key, "GetStatus", request)
            )
        except grpc.RpcError as e:
            raise DilocoxError(_unreachable(target, e)) from None


def _unreachable(target: str, e: grpc.RpcError) -> str:
    code = e.code()
    if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
        return (f"{target} {e.details()}: from another host, pass --operator-key FILE with a key the peer lists in "
                "control.operator_keys (--operator-keys)")  # fmt: skip
    if code == grpc.StatusCode.UNIMPLEMENTED:
        return f"{target} answers gRPC but is not a dilocox peer's control plane"
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return f"no answer from {target} in time: is the address right, and the peer alive (not stopped or frozen)?"
    return f"no dilocox peer answers at {target} ({code.name.lower()}): is the peer running, and is this its --control-addr?"


def status_dict(status: control_pb2.PeerStatus) -> dict[str, Any]:
    """PeerStatus as JSON-ready data: every field present, NaN (not known yet) as null."""
    data = MessageToDict(status, preserving_proto_field_name=True, always_print_fields_with_no_presence=True)
    for key in ("train_loss", "val_loss"):
        value = getattr(status, key)
        data[key] = None if math.isnan(value) else value
    for key in ("round", "rounds", "step", "steps_per_round", "tokens", "bytes_sent", "bytes_received"):
        data[key] = int(data[key])  # int64 arrives as a string in proto JSON
    data["faults"] = {k: int(v) for k, v in data["faults"].items()}
    for summary in data["recent_rounds"]:
        summary["round"] = int(summary["round"])
    return data


def _mb(n: int) -> str:
    return f"{n / 1e6:.1f} MB"


def _loss(value: float) -> str:
    return "-" if math.isnan(value) else f"{value:.4f}"


def render(s: control_pb2.PeerStatus) -> str:
    ago = time.time() - s.updated_at
    lines = [
        f"peer {s.peer_id or '(training alone)'}  run {s.run_id}  dilocox-p2p {s.version}",
        f"state {s.state}: round {s.round}/{s.rounds}, step {s.step}/{s.steps_per_round}; "
        f"mode {s.mode}, compression {s.compression}; last change {ago:.0f}s ago",
        f"loss train {_loss(s.train_loss)} val {_loss(s.val_loss)}; {s.tokens_per_s:,.0f} tokens/s, "
        f"{s.tokens:,} tokens; waited {s.seconds_comm_wait:.2f}s for the network last round",
        f"sent {_mb(s.bytes_sent)}, received {_mb(s.bytes_received)}"
        + (f"; {s.compression_ratio:.1f}x fewer bytes than fp32 all-reduce" if s.compression_ratio else ""),
    ]
    for st in s.stage_status:
        members = f": {', '.join(st.group_members)}" if st.group_members else ""
        client = f"  client member: {st.client}" if st.client else ""
        counted = f", {100 * st.counted_share:.0f}% of its message counted" if st.HasField("counted_share") else ""
        lines.append(
            f"stage {st.stage}: hash {st.state_hash[:16]}  group {st.group_size or '-'} ({st.kind or '-'}{counted})"
            f"  {len(st.group_members)} live members{members}{client}"
        )
    faults = {k: v for k, v in sorted(s.faults.items()) if v}
    lines.append("faults: " + (", ".join(f"{k} {v}" for k, v in faults.items()) or "none"))
    if s.multiaddrs:
        lines.append(f"multiaddr {s.multiaddrs[0]}")
    return "\n".join(lines)


def watch(target: str, *, as_json: bool, key: Any = None) -> int:
    request = control_pb2.WatchRequest(include_current=False)
    with grpc.insecure_channel(target) as channel:
        stub = control_pb2_grpc.PeerControlStub(channel)
        try:
            for event in stub.Watch(request, metadata=_signed(key, "Watch", request)):
                if as_json:
                    print(json.dumps({"event": event.event, "round": event.round, "state": event.state,
                                      "time": event.time, "record": json.loads(event.record_json or "null")}), flush=True)  # fmt: skip
                elif event.event == "round":
                    r = json.loads(event.record_json)
                    print(f"round {r['round'] + 1}: val {r['val_loss']:.4f}, {r['tokens_per_s']:,.0f} tokens/s, "
                          f"group {r.get('group_size') or '-'}, hash {r['stage_hashes'][0][:12]}", flush=True)  # fmt: skip
                else:
                    print(f"state {event.state}", flush=True)
        except grpc.RpcError as e:
            if e.code() in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
                return 0  # the peer stopped
            raise DilocoxError(_unreachable(target, e)) from None
    return 0


def main(args: argparse.Namespace) -> int:
    target = resolve_target(args.run_dir, args.target)
    key = None
    if args.operator_key is not None:
        from ..identity import load_identity

        key = load_identity(args.operator_key)
    status = fetch_status(target, args.timeout, key=key)
    if args.json:
        print(json.dumps(status_dict(status), indent=None if args.watch else 2), flush=True)
    else:
        print(render(status), flush=True)
    if args.watch:
        return watch(target, as_json=args.json, key=key)
    return 0
