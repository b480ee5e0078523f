"""Two pieces of pyinfra's per-operation controller work, made cheap without changing what they return.

A no-op re-converge is mostly controller CPU once the rig is read in one probe (roles/facts/probe.py), and
that CPU grows with the number of rigs: ~50 operations a rig, each paying for both of these, on every host.

- Operation order. pyinfra orders operations by the line numbers of the calling stack
  (`pyinfra.api.util.get_operation_order_from_stack`), through `inspect.stack()` and `getframeinfo()` with their
  default context of one source line: for every frame of every operation, Python finds the frame's module (a scan
  of `sys.modules`) and reads its source. Only file names and line numbers are used, so context 0 gives the same
  order without reading any source.
- Global arguments. `pyinfra.api.arguments.all_global_arguments()` evaluates the type hints of `AllArguments`
  on every operation and fact read. They are fixed once pyinfra is imported, so they are computed once.

`benchmarks/bench_converge.py` measures the effect (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import functools
import inspect

from pyinfra.api import arguments, facts, util

_ORIGINAL = arguments.all_global_arguments


def install() -> None:
    """Idempotent."""
    util.stack = functools.partial(inspect.stack, 0)
    util.getframeinfo = functools.partial(inspect.getframeinfo, context=0)
    if not hasattr(arguments.all_global_arguments, "cache_info"):
        cached = functools.cache(lambda: tuple(_ORIGINAL()))
        arguments.all_global_arguments = facts.all_global_arguments = cached
