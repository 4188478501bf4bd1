"""A warm interpreter that forks `dilocox-peer` processes for the swarm tier.

Every peer a test starts imports torch and hivemind (and torch._dynamo where it compiles) before
it trains: about 2.5 s of CPU in its fork server, a third of the swarm tier's CPU on 2 cores. A test session
instead starts one zygote (per pytest process), which imports them once and forks each peer:

    python -m tests.helpers.zygote SOCKET      # serves until its stdin closes

Each peer is then a real process of its own (its own session, working directory, environment,
resource limits and log), running `python -m dilocox_p2p.cli ARGS` as a fresh interpreter
would; its launcher holds the stage modules already, so its stages fork from it instead of from
a fork server (launch.py), and import nothing either. The zygote reaps its children and writes
each one's exit code beside its log; `Forked` is the test's handle, with the parts of
subprocess.Popen's interface the tests use.

Peers whose environment changes more than DILOCOX_* variables (ATEN_CPU_CAPABILITY, thread
counts: read once per process by torch) start as fresh interpreters instead (peers.py), as do
the tests that check the fork server itself.
"""

from __future__ import annotations

import atexit
import importlib
import json
import os
import resource
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Any

PRELOAD = (
    "dilocox_p2p.cli.__main__",
    "dilocox_p2p.stage_process",
    "torch._dynamo",
    "dilocox_p2p.swarm.worker",
)
START_TIMEOUT_S = 120.0
REPORT_TIMEOUT_S = 10.0  # from a peer's exit to its code beside its log


# ---- the zygote process ------------------------------------------------------------------------------


def _become_peer(request: dict[str, Any], closing: list[Any]) -> None:
    """In the forked child: become `python -m dilocox_p2p.cli ARGV` as started by subprocess.Popen with
    start_new_session=True, then exit with its code. Never returns."""
    code: Any = 1
    try:
        os.setsid()
        for item in closing:
            item.close()
        signal.set_wakeup_fd(-1)
        for signum in (signal.SIGCHLD, signal.SIGTERM):
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        from dilocox_p2p.swarm.hivemind_patches import own_process_locks

        own_process_locks()  # not the zygote's, which every peer of the session would share (a killed one's held)
        for which, value in request["limits"]:
            resource.setrlimit(which, (value, value))
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(os.open(os.devnull, os.O_RDONLY), 0)
        os.dup2(log, 1)
        os.dup2(log, 2)
        os.close(log)
        import numpy
        import torch

        numpy.random.seed()  # a fresh interpreter's generators differ from process to process: so do these
        torch.seed()
        from dilocox_p2p.cli.__main__ import main

        sys.argv = [sys.modules["dilocox_p2p.cli.__main__"].__file__, *request["argv"]]
        code = main(request["argv"])
    except SystemExit as e:
        code = e.code
    except BaseException:
        traceback.print_exc()
    finally:
        if code is not None and not isinstance(code, int):
            print(code, file=sys.stderr)
            code = 1
        try:
            atexit._run_exitfuncs()  # as an interpreter that exits: logging, multiprocessing's children
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code or 0)


def _write_exit(path: str, status: int) -> None:
    tmp = f"{path}.tmp"
    Path(tmp).write_text(str(os.waitstatus_to_exitcode(status)))
    os.replace(tmp, path)


def serve(path: str) -> None:
    for name in PRELOAD:
        importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_r, False)
    os.set_blocking(wake_w, False)
    signal.set_wakeup_fd(wake_w)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    exits: dict[int, str] = {}  # child pid -> the file its exit code goes to
    print("ready", flush=True)
    while True:
        ready, _, _ = select.select([listener, wake_r, sys.stdin], [], [], 1.0)
        if sys.stdin in ready and not os.read(sys.stdin.fileno(), 1024):
            return  # the test session ended
        if wake_r in ready:
            while True:
                try:
                    os.read(wake_r, 4096)
                except BlockingIOError:
                    break
        while exits:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            if pid in exits:
                _write_exit(exits.pop(pid), status)
        if listener in ready:
            conn, _ = listener.accept()
            with conn:
                request = json.loads(conn.makefile("rb").readline())
                pid = os.fork()
                if pid == 0:
                    _become_peer(request, [listener, conn, os.fdopen(wake_r), os.fdopen(wake_w)])
                exits[pid] = request["exit_file"]
                conn.sendall(json.dumps({"pid": pid}).encode() + b"\n")


# ---- the test's side ---------------------------------------------------------------------------------


class Forked:
    """A peer forked by the zygote: the parts of subprocess.Popen the tests use."""

    def __init__(self, pid: int, exit_file: Path, argv: list[str]):
        self.pid, self.args, self.returncode = pid, argv, None
        self._exit_file = exit_file
        self._pidfd = os.pidfd_open(pid)

    def poll(self) -> int | None:
        if self.returncode is None and self._exit_file.exists():
            self.returncode = int(self._exit_file.read_text())
            os.close(self._pidfd)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        exited = None  # when the pidfd said the peer had exited
        while self.poll() is None:
            left = None if deadline is None else deadline - time.monotonic()
            if left is not None and left <= 0:
                raise subprocess.TimeoutExpired(self.args, timeout)
            # readable once the peer exited; the zygote writes its code a moment later
            ready, _, _ = select.select([self._pidfd], [], [], 0.5 if left is None else min(left, 0.5))
            if ready:
                exited = exited or time.monotonic()
                if time.monotonic() - exited > REPORT_TIMEOUT_S:
                    raise RuntimeError(f"peer {self.pid} exited, but the zygote never wrote its exit code")
                time.sleep(0.005)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, signum: int) -> None:
        if self.poll() is None:
            os.kill(self.pid, signum)

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Zygote:
    """This pytest process's zygote, started on first use, gone when pytest exits (its stdin closes)."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="dilocox-zygote-"))
        self.socket = self.dir / "socket"
        self._count = 0
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.helpers.zygote", str(self.socket)], stdin=subprocess.PIPE,
            stdout=subprocess.PIPE, stderr=open(self.dir / "zygote.log", "w"), start_new_session=True,
        )  # fmt: skip
        ready, _, _ = select.select([self.proc.stdout], [], [], START_TIMEOUT_S)
        if not ready or self.proc.stdout.readline().strip() != b"ready":  # type: ignore[union-attr]
            self.proc.kill()
            raise RuntimeError(f"the zygote did not start: {(self.dir / 'zygote.log').read_text()[-3000:]}")
        atexit.register(self.close)

    def fork(self, argv: list[str], *, env: dict[str, str], log: Path, limits: dict[int, int] | None = None) -> Forked:
        """`python -m dilocox_p2p.cli ARGV` in a new session, its stdout and stderr appended to `log`."""
        self._count += 1
        exit_file = self.dir / f"exit-{self._count}"
        request = {"argv": argv, "env": env, "cwd": os.getcwd(), "log": str(log), "exit_file": str(exit_file),
                   "limits": sorted((limits or {}).items())}  # fmt: skip
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(60.0)
            conn.connect(str(self.socket))
            conn.sendall(json.dumps(request).encode() + b"\n")
            reply = json.loads(conn.makefile("rb").readline())
        return Forked(reply["pid"], exit_file, argv)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.stdin.close()  # type: ignore[union-attr]
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        shutil.rmtree(self.dir, ignore_errors=True)


_zygote: Zygote | None = None


def zygote() -> Zygote:
    global _zygote
    if _zygote is None or _zygote.proc.poll() is not None:
        _zygote = Zygote()
    return _zygote


if __name__ == "__main__":
    serve(sys.argv[1])
