"""`dilocox-peer keygen` and `dilocox-peer certify`: peer identities and closed-run certificates.

    dilocox-peer keygen --out peer.pem                 # prints the public key (hex)
    dilocox-peer keygen --out run.pem                  # the run key of a closed run, made the same way
    dilocox-peer certify --run-key run.pem --run-id RUN --peer-key HEX --out peer.cert
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from ..errors import IdentityError


def add_parsers(sub: argparse._SubParsersAction) -> None:
    keygen = sub.add_parser(
        "keygen",
        help="create an Ed25519 identity key (mode 0600) and print its public key",
        description="Create an Ed25519 key for `join --identity` (or a closed run's run key) and print its "
        "public key in hex: what swarm.allowlist, swarm.run_key and `certify --peer-key` take.",
    )
    keygen.add_argument("--out", required=True, metavar="FILE", help="where to write the key (never overwritten)")
    keygen.set_defaults(func=keygen_main)

    certify = sub.add_parser(
        "certify",
        help="admit a peer key to a closed run: sign a certificate with the run key",
        description="Sign a certificate admitting --peer-key to closed run --run-id; the peer passes it as "
        "swarm.certificate (--certificate). Peers of the run set swarm.run_key to the run key's public key.",
    )
    certify.add_argument("--run-key", required=True, metavar="FILE", help="the run key (from `keygen`)")
    certify.add_argument("--run-id", required=True, help="the run the certificate admits to")
    certify.add_argument("--peer-key", required=True, metavar="HEX", help="the peer's public key, as keygen printed it")
    certify.add_argument("--note", default="", help="free text kept in the certificate (whom it was issued to)")
    certify.add_argument("--out", required=True, metavar="FILE", help="where to write the certificate")
    certify.set_defaults(func=certify_main)


def keygen_main(args: argparse.Namespace) -> int:
    from ..identity import public_raw, write_identity  # hivemind (and torch) load only for the key commands

    key = write_identity(Path(args.out))
    print(public_raw(key).hex())
    return 0


def certify_main(args: argparse.Namespace) -> int:
    from ..identity import certify_peer, load_identity

    try:
        peer_key = bytes.fromhex(args.peer_key)
    except ValueError:
        raise IdentityError(f"--peer-key {args.peer_key[:70]!r} is not hex: pass the key `keygen` printed") from None
    cert = certify_peer(load_identity(Path(args.run_key)), peer_key, run_id=args.run_id, note=args.note)
    out = Path(args.out)
    if out.exists():
        raise IdentityError(f"{out} already exists: refusing to overwrite it")
    out.write_bytes(cert.SerializeToString())
    os.chmod(out, 0o644)  # a certificate is not secret: it only works with the peer's own key
    print(f"certificate for {args.peer_key} in run {args.run_id!r} written to {out}")
    return 0
