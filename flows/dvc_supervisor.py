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

A DVC killed on its own (`kill -9 <dvc pid>`) takes its stage with it the same way. Once DVC has exited,
killed or not, its entries in DVC's `.dvc/tmp/rwlock` are dropped (`forget_locks`).

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


def forget_locks(pid: int, tmp_dir: str = os.path.join(".dvc", "tmp")) -> None:
    """Drop the entries of DVC process `pid`, which has exited, from DVC's rwlock file in `tmp_dir`.

    DVC records there which paths each running command reads and writes, and removes its own entries on the
    way out; a killed DVC cannot, and each later command whose paths overlap some of them warned "Process
    ... had been killed. Auto removed it from the lock file" and removed only those: the warning came back,
    command after command. Edited under the flock DVC itself takes (`rwlock.lock`, zc.lockfile).
    """
    import fcntl
    import json

    path = os.path.join(tmp_dir, "rwlock")
    if not os.path.isfile(path):
        return
    with open(os.path.join(tmp_dir, "rwlock.lock"), "a+", encoding="utf-8") as guard:
        fcntl.flock(guard.fileno(), fcntl.LOCK_EX)
        try:
            with open(path, encoding="utf-8") as source:
                lock = json.load(source)
            writes = {key: info for key, info in lock.get("write", {}).items() if info.get("pid") != pid}
            reads = {key: kept for key, infos in lock.get("read", {}).items()
                     if (kept := [info for info in infos if info.get("pid") != pid])}
        except (OSError, ValueError, AttributeError):
            return   # unreadable: DVC reports it on its next command
        if writes == lock.get("write", {}) and reads == lock.get("read", {}):
            return
        with open(f"{path}.{os.getpid()}", "w", encoding="utf-8") as target:
            json.dump({**({"write": writes} if writes else {}), **({"read": reads} if reads else {})}, target)
        os.replace(f"{path}.{os.getpid()}", path)


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
        elif code < 0 and others_in_group():  # DVC killed under its stage: nothing would record its result
            stop_group(child, grace_s)
        forget_locks(child.pid)
        return code if code >= 0 else 128 - code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
