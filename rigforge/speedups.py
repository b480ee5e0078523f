"""Two pieces of pyinfra's per-operation controller work, made cheap without changing what they return.

A no-op re-converge is mostly controller CPU once the rig is read in one probe (rigforge/facts/probe.py), and
that CPU grows with the number of rigs: ~50 operations a rig, each paying for both of these, on every host.

- Operation order. pyinfra orders operations by the line numbers of the calling stack
  (`pyinfra.api.util.get_operation_order_from_stack`), through `inspect.stack()` and `getframeinfo()` with their
  default context of one source line: for every frame of every operation, Python finds the frame's module (a scan
  of `sys.modules`) and reads its source. Only file names and line numbers are used, so context 0 gives the same
  order without reading any source. Even then, finding a frame's line walks its code's positions up to the
  current instruction, ~25 frames an operation; the same call sites recur for every operation and every host,
  so each (code, instruction, line) is looked up once and remembered: `inspect.getframeinfo(frame, 0)` depends
  on nothing else.
- Global arguments. `pyinfra.api.arguments.all_global_arguments()` evaluates the type hints of `AllArguments`
  on every operation and fact read. They are fixed once pyinfra is imported, so they are computed once.

`benchmarks/bench_converge.py` measures the effect (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import functools
import inspect
import sys

from pyinfra.api import arguments, facts, util

_ORIGINAL = arguments.all_global_arguments
_FRAMES: dict = {}  # (code, instruction, line) -> inspect.getframeinfo(frame, 0)


def getframeinfo(frame) -> inspect.Traceback:
    """`inspect.getframeinfo(frame, 0)`, remembered per call site."""
    key = (frame.f_code, frame.f_lasti, frame.f_lineno)
    info = _FRAMES.get(key)
    if info is None:
        info = _FRAMES[key] = inspect.getframeinfo(frame, 0)
    return info


def stack() -> list[inspect.FrameInfo]:
    """`inspect.stack(0)`, from the remembered frame infos."""
    frames, frame = [], sys._getframe(1)
    while frame is not None:
        info = getframeinfo(frame)
        frames.append(inspect.FrameInfo(frame, *info, positions=info.positions))
        frame = frame.f_back
    return frames


def install() -> None:
    """Idempotent."""
    util.stack = stack
    util.getframeinfo = getframeinfo
    if not hasattr(arguments.all_global_arguments, "cache_info"):
        cached = functools.cache(lambda: tuple(_ORIGINAL()))
        arguments.all_global_arguments = facts.all_global_arguments = cached
