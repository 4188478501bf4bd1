"""What a peer brings to a run: its identity key, its certificate, and the run's admission policy.

    creds = Credentials.load(cfg)          # refuses (AdmissionError, exit 2) a closed run's outsider
    signer = creds.signer(worker_key, worker_id, stage=0, peer_name="host:run")
    gate = creds.gate()

Checked by the launcher before any stage starts, so an unsafe key file, a missing
certificate or a key the closed run does not admit is one clear error, not a worker failure.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from cryptography.hazmat.primitives.asymmetric.ed25519 import Ed25519PrivateKey

from .. import injection
from ..config import Config
from ..envelope import Gate, Policy, Signer
from ..errors import AdmissionError
from ..identity import certify_worker, load_identity, load_run_certificate, public_raw, run_identity
from ..proto_gen import envelope_pb2

__all__ = ["Credentials"]


@dataclass(frozen=True)
class Credentials:
    peer_key: Ed25519PrivateKey
    admission: envelope_pb2.RunCertificate | None
    policy: Policy

    @classmethod
    def load(cls, cfg: Config) -> Credentials:
        sw = cfg.swarm
        peer_key = load_identity(Path(sw.identity).expanduser()) if sw.identity else run_identity(cfg.run.path)
        admission = load_run_certificate(Path(sw.certificate).expanduser()) if sw.certificate else None
        policy = Policy(
            run_id=cfg.run.run_id,
            closed=sw.admission == "closed",
            allowlist=frozenset(bytes.fromhex(k) for k in sw.allowlist),
            run_key=bytes.fromhex(sw.run_key),
        )
        creds = cls(peer_key, admission, policy)
        if injection.armed("ignore_admission"):  # a hostile peer: joins anyway (docs/security.md)
            return cls(peer_key, admission, Policy(run_id=cfg.run.run_id))
        creds.check_admitted()
        return creds

    @property
    def public_hex(self) -> str:
        return public_raw(self.peer_key).hex()

    def check_admitted(self) -> None:
        """Raise AdmissionError (with what to do) if this peer's own run would refuse it."""
        probe = envelope_pb2.Envelope(sender=envelope_pb2.StageCertificate(peer_key=public_raw(self.peer_key)))
        if self.admission is not None:
            probe.admission.CopyFrom(self.admission)
        refusal = self.policy.refusal(probe)
        if refusal:
            raise AdmissionError(
                f"this closed run does not admit this peer: {refusal}. Ask the run's operator to add the key "
                f"{self.public_hex} to swarm.allowlist, or for a certificate (`dilocox-peer certify --peer-key "
                f"{self.public_hex} ...`) to pass as swarm.certificate"
            )

    def signer(self, worker_key: Ed25519PrivateKey, worker_id: str, *, stage: int, peer_name: str) -> Signer:
        cert = certify_worker(self.peer_key, worker_id, run_id=self.policy.run_id, stage=stage, peer_name=peer_name)
        return Signer(worker_key, cert, self.admission)

    def gate(self) -> Gate:
        return Gate(self.policy)
