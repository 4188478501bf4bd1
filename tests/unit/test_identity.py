"""Worker keys are libp2p keys: our own copy of libp2p's key messages reads and writes exactly the bytes
hivemind's (and p2pd's) do, so that a peer id computed without hivemind is the one its DHT node announces.

    pytest tests/unit/test_identity.py -q
"""

from __future__ import annotations

import subprocess
import sys

import pytest
from hivemind.proto import crypto_pb2

from dilocox_p2p.errors import IdentityError
from dilocox_p2p.identity import peer_id_of, public_key_of, public_raw, worker_identity
from dilocox_p2p.proto_gen import libp2p_keys_pb2

pytestmark = pytest.mark.unit


def test_a_worker_key_file_is_a_libp2p_private_key_that_hivemind_reads_back(tmp_path):
    key = worker_identity(tmp_path / "stage0.ed25519")
    theirs = crypto_pb2.PrivateKey.FromString((tmp_path / "stage0.ed25519").read_bytes())
    assert theirs.key_type == crypto_pb2.KeyType.Ed25519 and theirs.data[32:] == public_raw(key)
    assert public_raw(worker_identity(tmp_path / "stage0.ed25519")) == public_raw(key)  # read back, not made again


def test_the_marshalled_public_key_is_byte_for_byte_hivemind_s(tmp_path):
    key = worker_identity(tmp_path / "k")
    ours = libp2p_keys_pb2.PublicKey(key_type=libp2p_keys_pb2.KEY_ED25519, data=public_raw(key)).SerializeToString()
    theirs = crypto_pb2.PublicKey(key_type=crypto_pb2.KeyType.Ed25519, data=public_raw(key)).SerializeToString()
    assert ours == theirs
    assert public_raw(public_key_of(peer_id_of(key))) == public_raw(key)


def test_reading_a_key_and_its_peer_id_loads_neither_hivemind_nor_torch(tmp_path):
    code = (
        "import sys; from pathlib import Path; from dilocox_p2p.identity import peer_id_of, worker_identity; "
        f"print(peer_id_of(worker_identity(Path({str(tmp_path / 'k')!r})))); "
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'hivemind', 'torch'}))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=True).stdout
    peer_id, loaded = out.split()
    assert peer_id.startswith("12D3KooW") and loaded == "[]"


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604], ids=["0644", "0640", "0604"])
def test_a_worker_key_others_can_read_is_refused_with_the_fix(tmp_path, mode):
    path = tmp_path / "stage0.ed25519"
    worker_identity(path)
    path.chmod(mode)  # it signs every envelope of its stage: a copy of it is the stage's identity

    with pytest.raises(IdentityError, match=f"worker key {path} is readable by others \\(mode {mode:04o}\\).*chmod 600"):
        worker_identity(path)
