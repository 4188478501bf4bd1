"""Several bootstrap nodes, each on a host of its own: peers given them all end in one DHT, every time.

    sudo pytest tests/netns/test_bootstrap_nodes.py -q

hivemind#624: four peers given the same initial peers sometimes formed two separate DHTs. Here two
bootstrap nodes, each listing the other, and four peers listing both all start at the same moment,
ten times over; each time every peer must find every other's entry under one key within
ONE_DHT_S. The nodes run in agent processes (tests/helpers/dht_agent.py) that import hivemind once,
so each repeat costs only the nodes' own starts.
"""

from __future__ import annotations

import json
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from benchmarks.netlab import NetLab
from dilocox_p2p.bootstrap import load_node_identity
from dilocox_p2p.identity import peer_id_of

pytestmark = pytest.mark.netns

REPEATS = 10
PEERS = 4
ONE_DHT_S = 20.0  # a peer pings every initial peer at once, and asks a missing one again every 2 s
LOOK_S = 0.5
ANSWER_S = 60.0


class Agent:
    def __init__(self, lab: NetLab, host: int, args: list[str], log: Path):
        self.log = log
        self.proc = lab.popen(host, [sys.executable, "-m", "tests.helpers.dht_agent", *args], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, stderr=open(log, "w"), text=True)  # fmt: skip

    def send(self, command: str) -> None:
        self.proc.stdin.write(command + "\n")
        self.proc.stdin.flush()

    def answer(self) -> dict:
        line = self.proc.stdout.readline()
        assert line, f"the agent exited ({self.proc.poll()}):\n{self.log.read_text()[-3000:]}"
        reply = json.loads(line)
        assert "error" not in reply, f"{reply['error']}\n{reply.get('trace', '')}\n{self.log.read_text()[-2000:]}"
        return reply

    def ask(self, command: str) -> dict:
        self.send(command)
        return self.answer()


def _all_at_once(agents: list[Agent], command: str) -> list[dict]:
    for agent in agents:
        agent.send(command)
    with ThreadPoolExecutor(len(agents)) as pool:
        return list(pool.map(lambda a: a.answer(), agents))


@pytest.mark.timeout(900)
def test_four_peers_started_with_two_bootstrap_nodes_at_once_form_one_dht_every_time(tmp_path):
    with NetLab(n_hosts=2 + PEERS, rate_mbit=None) as lab:
        boot_dirs = [tmp_path / f"bootstrap{i}" for i in range(2)]
        for d in boot_dirs:
            d.mkdir(mode=0o700)
        boot_ids = [peer_id_of(load_node_identity(d / "identity.key")) for d in boot_dirs]  # their keys, made here
        boot_maddrs = [f"/ip4/{lab.ip(i)}/tcp/31337/p2p/{boot_ids[i]}" for i in range(2)]
        agents = [Agent(lab, i, ["bootstrap", str(boot_dirs[i]), f"/ip4/{lab.ip(i)}/tcp/31337", boot_maddrs[1 - i]],
                        tmp_path / f"bootstrap{i}.err") for i in range(2)]  # fmt: skip
        for k in range(PEERS):
            (tmp_path / f"peer{k}").mkdir()
            agents.append(Agent(lab, 2 + k, ["peer", str(tmp_path / f"peer{k}"), f"/ip4/{lab.ip(2 + k)}/tcp/0",
                                             *boot_maddrs], tmp_path / f"peer{k}.err"))  # fmt: skip
        peers = agents[2:]
        seconds = []
        for repeat in range(REPEATS):
            started = _all_at_once(agents, "start")  # two bootstrap nodes and four peers, all at the same moment
            assert [s["started"] for s in started[:2]] == boot_ids
            ids = sorted(s["started"] for s in started[2:])
            began, seen = time.monotonic(), {}
            while time.monotonic() - began < ONE_DHT_S:
                seen = {k: reply["seen"] for k, reply in enumerate(_all_at_once(peers, "look"))}
                if all(found == ids for found in seen.values()):
                    break
                time.sleep(LOOK_S)
            assert all(found == ids for found in seen.values()), (
                f"repeat {repeat}: after {ONE_DHT_S:.0f} s the peers see {seen}, not one DHT of {ids}")
            seconds.append(round(time.monotonic() - began, 2))
            _all_at_once(agents, "stop")
        for agent in agents:
            agent.proc.stdin.close()
            assert agent.proc.wait(ANSWER_S) == 0, agent.log.read_text()[-2000:]
    print(f"one DHT in every one of {REPEATS} starts; seconds from the start to one DHT: {seconds}")
