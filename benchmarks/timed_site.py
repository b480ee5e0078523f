"""deploy/site.py with timing, for benchmarks/bench_converge.py (not a user entry point).

Appends JSON lines to $RIGFORGE_TIMINGS:
- {"kind": "op", host, op, s}: one per (host, operation) executed (execute phase);
- {"kind": "fact", host, role, fact, how, s}: one per fact read (prepare or execute phase), with the role (deploy)
  it was read in and how it was answered (`live`: its own round trip; `probe`: this read ran the batched probe;
  `served`: from the snapshot, no round trip), so the benchmark can say where the round trips go. The wait for
  the rig lock's answer, which carries the probe, is a row of its own, fact "(probe, with the rig lock)", `probe`.

The probe is installed first (as `rig_lock.ask_first()` would), so this timing wraps it and sees every read.
"""

import json
import os
import time

from pyinfra import state
from pyinfra.api import facts as pyinfra_facts
from pyinfra.api.state import BaseStateCallback

from rigforge.observe.facts import probe
from roles import rig_lock

OUT = os.environ["RIGFORGE_TIMINGS"]


def _write(row: dict) -> None:
    with open(OUT, "a") as fh:
        fh.write(json.dumps(row) + "\n")


class _Timer(BaseStateCallback):
    started: dict = {}
    current: dict = {}  # host name -> name of the operation executing there

    @staticmethod
    def operation_host_start(state, host, op_hash):
        _Timer.started[(host.name, op_hash)] = time.monotonic()
        _Timer.current[host.name] = list(state.get_op_meta(op_hash).names)[0]

    @staticmethod
    def operation_host_success(state, host, op_hash, retry_count=0):
        start = _Timer.started.pop((host.name, op_hash), None)
        if start is None:
            return
        name = list(state.get_op_meta(op_hash).names)[0]
        _write({"kind": "op", "host": host.name, "op": name, "s": time.monotonic() - start})


def _role(host) -> str:
    """The role (deploy) a fact is read in: while preparing, the deploy being run; while executing, the role of
    the operation executing on the host."""
    if host.current_deploy_name:
        parts = host.current_deploy_name.split(" | ")  # "rigforge site | <role>"
        return parts[1] if len(parts) > 1 else parts[0]
    parts = _Timer.current.get(host.name, "").split(" | ")  # "rigforge site | <role> | <operation>"
    return parts[1] if len(parts) > 2 else parts[0] or "(top level)"


probe.install_all()
if not getattr(pyinfra_facts, "_rigforge_timed", False):
    _get_fact = pyinfra_facts._get_fact

    def _timed_get_fact(state, host, cls, *args, **kwargs):
        t0 = time.monotonic()
        snap = probe._of(host)
        before = (snap.served, snap.probes)
        try:
            return _get_fact(state, host, cls, *args, **kwargs)
        finally:
            how = "probe" if snap.probes > before[1] else "served" if snap.served > before[0] else "live"
            row = {"kind": "fact", "host": host.name, "role": _role(host), "fact": cls.__name__, "how": how}
            _write({**row, "s": time.monotonic() - t0})

    pyinfra_facts._get_fact = _timed_get_fact
    pyinfra_facts._rigforge_timed = True
    _take = rig_lock.take

    def _timed_take(host, *args, **kwargs):
        """Waiting for the rig lock's answer, which carries the probe (asked for by rig_lock.ask_first before the
        roles load): one row, `probe`, when the probe came with it."""
        t0, snap = time.monotonic(), probe._of(host)
        try:
            return _take(host, *args, **kwargs)
        finally:
            if snap.pending is not None:
                row = {"kind": "fact", "host": host.name, "role": _role(host), "fact": "(probe, with the rig lock)"}
                _write({**row, "how": "probe", "s": time.monotonic() - t0})

    rig_lock.take = _timed_take

if not any(isinstance(h, _Timer) for h in state.callback_handlers):
    state.add_callback_handler(_Timer())
rig_lock.ask_first()  # as deploy/site.py: the lock asked for before roles.site loads
from roles import site  # noqa: E402

site.provision_variant()
