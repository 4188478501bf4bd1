"""What the run's DHT records must be, checked by every DHT node on every record it stores or returns.

`EnvelopeValidator` (a hivemind RecordValidator): a record with a string subkey is one of ours (hivemind's own
matchmaking records use bytes subkeys) and must be a SignedEnvelope signed by the worker its subkey names, for the
key it is stored under, of this run, from an admitted key, and expiring no later than its signature allows
(`signed_expiry`: its signing time plus its kind's TTL). A plain value (no subkey) is refused under every key: it
would replace every record under its key. Under the run's fixed keys (`run_keys`) only signed records are taken.
"""

from __future__ import annotations

import logging
from collections.abc import Iterable

from hivemind.dht.protocol import DHTProtocol
from hivemind.dht.routing import DHTID
from hivemind.dht.validation import DHTRecord, RecordValidatorBase
from hivemind.utils import MSGPackSerializer

from ..envelope import Gate
from ..errors import WireRejected
from ..proto_gen import envelope_pb2
from ..wire import swarm_pb2
from .faults import RefusalLog

__all__ = [
    "AVERAGE_RECORD_TTL_S", "EXPIRY_SLACK_S", "EnvelopeValidator", "JOINED_FLOOR", "MEMBER_TTL_S",
    "ROUND_RECORD_TTL_S", "run_keys", "signed_expiry",
]  # fmt: skip

logger = logging.getLogger("dilocox_p2p.swarm.dht")  # its refusals read as the DHT's

MEMBER_TTL_S = 15.0
ROUND_RECORD_TTL_S = 600.0
AVERAGE_RECORD_TTL_S = 300.0
TTL_BY_TYPE = {
    swarm_pb2.MemberRecord.DESCRIPTOR.full_name: MEMBER_TTL_S,
    swarm_pb2.RoundRecord.DESCRIPTOR.full_name: ROUND_RECORD_TTL_S,
    swarm_pb2.ConfigRecord.DESCRIPTOR.full_name: ROUND_RECORD_TTL_S,
    swarm_pb2.AverageRecord.DESCRIPTOR.full_name: AVERAGE_RECORD_TTL_S,
    swarm_pb2.DigestRecord.DESCRIPTOR.full_name: AVERAGE_RECORD_TTL_S,
}  # the longest a record of each kind is stored for (EnvelopeValidator: signed_expiry)
EXPIRY_SLACK_S = 5.0  # between signing and storing a record; a member record's expiration creeps past its TTL by ms
JOINED_FLOOR = 1_700_000_000  # 2023-11-14: a member record's joined_at before it is no time this software ran


MAX_STAGES_GUARDED = 64  # member keys of stages 0..63 only take signed records (EnvelopeValidator)


def run_keys(run_id: str, config_hash: str) -> list[str]:
    """The run's DHT keys known in advance: nobody may store an unsigned or plain value under them."""
    return [f"{run_id}:members:s{s}" for s in range(MAX_STAGES_GUARDED)] + [f"{run_id}:config:{config_hash}"]


class EnvelopeValidator(RecordValidatorBase):
    """hivemind RecordValidator for the run's records, run by the DHT node on every record it is asked
    to store and every record a lookup returns.

    A record with a string subkey is one of ours (hivemind's own matchmaking records use bytes
    subkeys): it must be a SignedEnvelope signed by the worker its subkey names, for the key it is
    stored under, of this run, from an admitted key, expiring no later than `signed_expiry` (the payload
    and protocol version are checked when read, where a peer running other code is told why it is
    refused). A plain value is refused under every key; under the run's fixed keys (`run_keys`) only
    signed records are taken. Refusals are logged at their 1st, 10th, 100th... time.
    """

    def __init__(self, gate: Gate, guarded_keys: Iterable[str]):
        self.gate = gate
        self.guarded = {DHTID.generate(source=k).to_bytes() for k in guarded_keys}
        self.refusals = RefusalLog()

    def validate(self, record: DHTRecord) -> bool:
        try:
            if record.subkey == DHTProtocol.IS_REGULAR_VALUE:  # it would replace every record under its key
                raise WireRejected("a plain value (no signed subkey): it would replace every record under its key")
            subkey = MSGPackSerializer.loads(record.subkey) if record.subkey else None
            if not isinstance(subkey, str):
                if record.key in self.guarded:
                    raise WireRejected("a value with no signed subkey under one of the run's keys")
                return True  # hivemind's matchmaking records (bytes subkeys)
            # another protocol passes here (if signed right) so that its peer is told why it is refused
            envelope = self.gate.check(MSGPackSerializer.loads(record.value), sender=subkey, any_protocol=True)
            if DHTID.generate(source=envelope.topic).to_bytes() != record.key:
                raise WireRejected(f"a record of {subkey[:20]}... signed for {envelope.topic[:60]!r} stored under "
                                   "another key (replayed)")  # fmt: skip
            if (latest := signed_expiry(envelope)) < record.expiration_time:
                raise WireRejected(f"a record expiring later than its signature allows ({subkey[:20]}..., "
                                   f"{record.expiration_time - latest:.0f} s: an old record stored again to outlast "
                                   "newer ones)")  # fmt: skip
            return True
        except WireRejected as e:
            self._log(str(e))
        except Exception as e:  # msgpack or anything else that cannot be read
            self._log(f"unreadable record ({type(e).__name__})")
        return False

    def _log(self, reason: str) -> None:
        n = self.refusals.count(reason)
        if n is not None:
            logger.warning("DHT refused a record: %s [%d such so far]", reason, n)

    @property
    def priority(self) -> int:
        return 20  # checked before any other validator strips anything


def signed_expiry(envelope: envelope_pb2.Envelope) -> float:
    """The latest DHT expiration a signed record may be stored with: its signing time (the sender's clock, as its
    expiration is) plus its kind's TTL and EXPIRY_SLACK_S. A record stored again later keeps its expiration; one
    given a later one (an old record replayed to outlast, and so block, its signer's newer ones) is refused."""
    ttl = TTL_BY_TYPE.get(envelope.type, max(TTL_BY_TYPE.values()))
    return envelope.sent_at + ttl + EXPIRY_SLACK_S
