"""An interrupted run exits 130 (SIGINT) or 143 (SIGTERM), naming the operation it cut: pyinfra's own exit code
after Ctrl-C is 0, which a script or CI job would take for a success.
"""

import contextlib
import os
import signal
import sys
from types import FrameType
from typing import NoReturn

from pyinfra.api import State


def install(state: State | None) -> None:
    """Exit 128+signal on SIGINT/SIGTERM, naming the cut operation (idempotent; main thread only)."""

    def stop(signum: int, frame: FrameType | None) -> NoReturn:
        """The signal handler: say which operation the signal cut, then exit 128+signum."""
        try:
            hashes = [(host.name, host.executing_op_hash) for host in (state.inventory if state else ())]
            cut = [f"{name}: {', '.join(sorted(state.get_op_meta(op).names)) or op}" for name, op in hashes if op]
            where = f"cut during {'; '.join(cut)}" if cut else "cut before any operation ran"
            sys.stderr.write(
                f"rigforge: interrupted by {signal.Signals(signum).name}, {where}. The run did not finish (exit "
                f"{128 + signum}); run the deploy again to finish it: it repairs what the cut left.\n"
            )
            sys.stderr.flush()
        finally:  # whatever saying it raised (a closed stderr), the run ends with the signal's code
            os._exit(128 + signum)

    # not the main thread (pyinfra's API used from a thread): ValueError, the handlers are left alone
    with contextlib.suppress(ValueError):
        for signum in (signal.SIGINT, signal.SIGTERM):
            signal.signal(signum, stop)
