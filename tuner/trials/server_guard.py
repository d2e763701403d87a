"""Runs a server command inside this process group and ends the whole group when the process that started it dies.

    python -m tuner.trials.server_guard GRACE_S -- COMMAND ...

The tuner starts a server per configuration through this guard, in a new session, so that the server and every
process it spawns share one group. The kernel sends the guard SIGTERM when the tuner dies, however it dies (``kill -9``
included: PR_SET_PDEATHSIG); the guard then sends SIGTERM to the group and SIGKILL after ``GRACE_S`` seconds. A
server's own clean-up is not enough: vLLM's API server, sent SIGTERM while its engine is still compiling, keeps its
engine processes running. When the server exits by itself, the guard ends what it left in the group and exits with
its code. Standard library and psutil only: it starts fast and never imports the tuner.
"""

from __future__ import annotations

import ctypes
import os
import signal
import subprocess
import sys
import time
from types import FrameType

import psutil

_PR_SET_PDEATHSIG = 1


def _others_in_group() -> list[psutil.Process]:
    me, group = os.getpid(), os.getpgrp()
    out = []
    for p in psutil.process_iter():
        try:
            if p.pid != me and os.getpgid(p.pid) == group and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except (psutil.Error, OSError):
            pass
    return out


def _end_group(grace: float) -> None:
    """SIGTERM to every other process of the group, SIGKILL to those left after ``grace`` seconds."""
    for p in _others_in_group():
        try:
            p.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    deadline = time.monotonic() + grace
    while time.monotonic() < deadline and _others_in_group():
        time.sleep(0.2)
    for p in _others_in_group():
        try:
            p.kill()
        except psutil.Error:
            pass


def main(argv: list[str]) -> int:
    if len(argv) < 3 or argv[1] != "--":
        print("usage: python -m tuner.trials.server_guard GRACE_S -- COMMAND ...", file=sys.stderr)
        return 2
    grace, command = float(argv[0]), argv[2:]
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(_PR_SET_PDEATHSIG, signal.SIGTERM)
    except OSError:
        pass
    if os.getppid() == 1:  # the tuner died before the line above took effect
        return 1
    child = subprocess.Popen(command)

    def stop(signum: int, frame: FrameType | None) -> None:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        _end_group(grace)
        sys.exit(128 + signum)

    signal.signal(signal.SIGTERM, stop)
    signal.signal(signal.SIGINT, stop)
    code = child.wait()
    _end_group(grace)
    return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
