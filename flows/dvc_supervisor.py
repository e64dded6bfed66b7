"""`python flows/dvc_supervisor.py <parent pid> <grace s> <command...>`: DVC that dies with its parent.

The flows start DVC in its own session (`dvc_runner.run_dvc`), so that stopping a flow run stops DVC and the
stage command DVC started (one `killpg`). The price: a worker killed with its process group, or a flow-run
process killed alone, left `dvc exp run` and its stage running in the dead worker's clone, racing the retry.
This script is what the flows start instead: the leader of that new session, it runs the command as its
child and, once a second, checks that the process which started it is still its parent. When it is not (that
process died, however: SIGKILL, OOM, a lost worker), it sends SIGTERM to its whole group (DVC and the stage,
which then puts its outputs back: stages/common.py), gives them `grace` seconds to exit, then SIGKILLs
what is left. A stop meant for DVC (SIGTERM to the group) is for the command: this outlives it until the
rest of the group has exited too (up to `grace`), so whoever stopped it knows the stage has cleaned up.

Standard library only, run by path: it needs no PYTHONPATH, in any clone. Linux counts the group's members
from /proc; elsewhere the grace period is waited in full before the SIGKILL.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

POLL_S = 0.5


def others_in_group() -> list[int] | None:
    """The pids of this process group but this process (zombies included); None without /proc."""
    me = os.getpid()
    try:
        entries = os.listdir("/proc")
    except OSError:
        return None
    members = []
    for entry in entries:
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/stat", encoding="utf-8", errors="replace") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()  # after the command name: state ppid pgrp
        except (OSError, IndexError):
            continue
        if int(fields[2]) == me and fields[0] != "Z":
            members.append(int(entry))
    return members


def group_emptied(child: subprocess.Popen, grace_s: float) -> bool:
    """Whether the rest of the group exits within `grace_s` (DVC's stage puts its outputs back first)."""
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline:
        child.poll()  # reap DVC, so it no longer counts
        if others_in_group() == []:
            return True
        time.sleep(0.1)
    return False


def stop_group(child: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM to the group; when something is still in it after `grace_s`, SIGKILL (this process too)."""
    os.killpg(0, signal.SIGTERM)
    if not group_emptied(child, grace_s):
        os.killpg(0, signal.SIGKILL)


def main(argv: list[str]) -> int:
    parent, grace_s, command = int(argv[0]), float(argv[1]), argv[2:]
    if os.getpgrp() != os.getpid():  # run_dvc makes it a session leader; by hand, its own group at least
        os.setpgid(0, 0)
    stopped: list[int] = []
    # A handler, not SIG_IGN, which the command would inherit: SIGTERM to the group stops the command, and
    # this exits once the group has (`_stop_group` of dvc_runner then returns after the stage cleaned up).
    signal.signal(signal.SIGTERM, lambda signum, frame: stopped.append(signum))
    child = subprocess.Popen(command)
    while True:
        try:
            code = child.wait(timeout=POLL_S)
        except subprocess.TimeoutExpired:
            if os.getppid() != parent:  # re-parented: whoever started this is gone
                stop_group(child, grace_s)
            continue
        if stopped:
            group_emptied(child, grace_s)
        return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
