"""An interrupted run exits non-zero and says what it cut.

pyinfra answers Ctrl-C with exit code 0, so a script or CI job takes an aborted deploy for a success. `install()`
(roles/site.py `provision`) makes SIGINT and SIGTERM print which operation was running on which host and exit 130
or 143, as a shell reports them; the next run repairs what the cut left.
"""

from __future__ import annotations

import contextlib
import os
import signal
import sys


def running(state) -> list[str]:
    """'host: operation' for every host executing an operation now (empty while preparing)."""
    out = []
    for host in state.inventory if state else ():
        op_hash = host.executing_op_hash
        if op_hash:
            names = ", ".join(sorted(state.get_op_meta(op_hash).names)) or op_hash
            out.append(f"{host.name}: {names}")
    return out


def message(signum: int, cut: list[str]) -> str:
    name = signal.Signals(signum).name
    where = f"cut during {'; '.join(cut)}" if cut else "cut before any operation ran"
    return (
        f"rigforge: interrupted by {name}, {where}. The run did not finish (exit {128 + signum}); "
        "run the deploy again to finish it: it repairs what the cut left."
    )


def install(state) -> None:
    """Exit 128+signal on SIGINT/SIGTERM, naming the cut operation (idempotent; main thread only)."""

    def stop(signum, frame):
        sys.stderr.write(message(signum, running(state)) + "\n")
        sys.stderr.flush()
        os._exit(128 + signum)

    # not the main thread (pyinfra's API used from a thread): ValueError, the handlers are left alone
    with contextlib.suppress(ValueError):
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, stop)
