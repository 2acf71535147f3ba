"""Run a container runtime as the child of a subreaper, in a mount namespace of its own.

    unshare --mount --propagation private -- python3 subreaper.py [--tmpfs DIR]... -- COMMAND [ARG]...

A runtime's shims daemonize: they leave their parent and are re-parented to the nearest subreaper, else
to PID 1, which on these machines is not an init and never reaps them. This process makes itself that
subreaper (``PR_SET_CHILD_SUBREAPER``), so every shim and container process that outlives its parent
becomes its child and is reaped here. Each ``--tmpfs DIR`` is mounted first (containerd 1.6 and 1.7 put
their shim sockets in ``/run/containerd/s`` whatever their ``state`` says, so a private tmpfs there keeps
one containerd apart from another and from the host's). SIGTERM and SIGINT go on to COMMAND. When COMMAND
has exited, what is left under this process (shims of containers not removed, their containers) is
killed and reaped, and this process exits with COMMAND's status.

It is a separate process with a blocking wait loop of its own, so that the test's event loop never
inherits orphans.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from pathlib import Path

PR_SET_CHILD_SUBREAPER = 36


def children() -> set[int]:
    """This process's children, as the kernel lists them (every thread's list)."""
    pids: set[int] = set()
    for task in Path("/proc/self/task").iterdir():
        with contextlib.suppress(FileNotFoundError):
            pids.update(int(pid) for pid in (task / "children").read_text().split())
    return pids


def main(argv: list[str]) -> int:
    if "--" not in argv:
        print("usage: subreaper.py [--tmpfs DIR]... -- COMMAND [ARG]...", file=sys.stderr)
        return 2
    split = argv.index("--")
    options, command = argv[:split], argv[split + 1 :]
    tmpfs = [options[i + 1] for i, opt in enumerate(options) if opt == "--tmpfs"]

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        print(f"subreaper: prctl: {os.strerror(ctypes.get_errno())}", file=sys.stderr)
        return 1
    for directory in tmpfs:
        subprocess.run(["mount", "-t", "tmpfs", "-o", "mode=0711", "tmpfs", directory], check=True)

    child = subprocess.Popen(command)

    def forward(sig: int, _frame: object) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(child.pid, sig)

    signal.signal(signal.SIGTERM, forward)
    signal.signal(signal.SIGINT, forward)

    status = 1
    while True:
        pid, wstatus = os.wait()
        if pid == child.pid:
            status = os.waitstatus_to_exitcode(wstatus)
            break

    # What outlived the runtime: kill it, and whatever that re-parents here, until nothing is left.
    while left := children():
        for pid in left:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(-1, 0)
    return status if status >= 0 else 128 - status


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
