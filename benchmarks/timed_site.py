"""deploy/site.py with per-operation timing, for benchmarks/bench_converge.py (not a user entry point).

Appends one JSON line per (host, operation) to $RIGFORGE_TIMINGS: host, op name, seconds, changed.
"""

import json
import os
import time

from pyinfra import state
from pyinfra.api.state import BaseStateCallback

from roles import site


class _Timer(BaseStateCallback):
    started: dict = {}

    @staticmethod
    def operation_host_start(state, host, op_hash):
        _Timer.started[(host.name, op_hash)] = time.monotonic()

    @staticmethod
    def operation_host_success(state, host, op_hash, retry_count=0):
        start = _Timer.started.pop((host.name, op_hash), None)
        if start is None:
            return
        meta = state.get_op_meta(op_hash)
        with open(os.environ["RIGFORGE_TIMINGS"], "a") as fh:
            fh.write(json.dumps({"host": host.name, "op": list(meta.names)[0], "s": time.monotonic() - start}) + "\n")


if not any(isinstance(h, _Timer) for h in state.callback_handlers):
    state.add_callback_handler(_Timer())
site.provision()
