"""Three pieces of pyinfra's per-operation controller work, made cheap without changing what they return; and
rigforge's own bytecode kept.

A no-op re-converge is mostly controller CPU once the rig is read in one probe (rigforge/facts/probe.py), and
that CPU grows with the number of rigs: ~60 operations a rig, each paying for all of these, on every host.

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
- Host data. Every operation and fact read looks up each of ~30 global arguments in host data
  (`pyinfra.api.host.HostData.__getattr__`, ~2 200 lookups a rig), nearly all absent: each lookup walks five
  data sources (override, host, groups, global, deploy defaults) and raises and catches a KeyError in each source
  that lacks the key. `host_data_attr` asks each source with `in` instead: the same sources, in the same order,
  the same copy of the same value, ~2.4x faster.
- Bytecode. pyinfra's CLI sets `sys.dont_write_bytecode`, so an editable install (the repository) compiled its
  ~60 own modules from source on every run (~90 ms of a no-op's start-up). At exit, `keep_bytecode` writes the
  bytecode of the rigforge and roles modules this run imported from source, as a plain `python` would have: the
  next run reads it (Python checks each file's source mtime and size, so an edited module compiles again). Not
  when PYTHONDONTWRITEBYTECODE is set (the user's own choice), nor where the package is not writable.

`benchmarks/bench_converge.py` measures the effect (benchmarks/RESULTS.md).
"""

from __future__ import annotations

import atexit
import contextlib
import functools
import importlib.util
import inspect
import os
import py_compile
import sys
from copy import copy
from pathlib import Path

from pyinfra.api import arguments, facts, host, util

_ORIGINAL = arguments.all_global_arguments
_FRAMES: dict = {}  # (code, instruction, line) -> inspect.getframeinfo(frame, 0)


def getframeinfo(frame) -> inspect.Traceback:
    """`inspect.getframeinfo(frame, 0)`, remembered per call site."""
    key = (frame.f_code, frame.f_lasti, frame.f_lineno)
    if (info := _FRAMES.get(key)) is None:
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


def host_data_attr(self, key: str):
    """`HostData.__getattr__`: the value of `key` in the first of the host's data sources that has it, copied."""
    for data in self.datas:
        data = data() if callable(data) else data  # @deploy data defaults are read when asked for
        if key in data:
            return copy(data[key])
    raise AttributeError(f"Host `{self.host}` has no data `{key}`")


_TIMESTAMP = py_compile.PycInvalidationMode.TIMESTAMP  # what Python's import writes (whatever SOURCE_DATE_EPOCH)
_OWN = tuple(str(Path(__file__).resolve().parents[1] / name) + os.sep for name in ("roles", "rigforge"))


def _stale(source: str, cached: str) -> bool:
    """Whether `cached` is not the bytecode Python would read for `source` (magic, mtime and size in its header)."""
    try:
        st = os.stat(source)
        with open(cached, "rb") as fh:
            head = fh.read(16)
    except OSError:
        return True
    stamp = (int(st.st_mtime) & 0xFFFFFFFF).to_bytes(4, "little") + (st.st_size & 0xFFFFFFFF).to_bytes(4, "little")
    return head[:4] != importlib.util.MAGIC_NUMBER or head[4:8] != bytes(4) or head[8:16] != stamp


def keep_bytecode(modules=None) -> list[str]:
    """Write the bytecode of rigforge's own modules (rigforge/, roles/) that is missing or stale, as Python's import
    would when allowed (see the module doc); the sources written for. `modules`: default sys.modules."""
    if os.environ.get("PYTHONDONTWRITEBYTECODE"):
        return []
    written = []
    for module in list((sys.modules if modules is None else modules).values()):
        spec = getattr(module, "__spec__", None)
        source, cached = getattr(spec, "origin", None), getattr(spec, "cached", None)
        if source and cached and source.endswith(".py") and source.startswith(_OWN) and _stale(source, cached):
            # a read-only install (pip compiled it already) or a file being edited: left as it is
            with contextlib.suppress(OSError, py_compile.PyCompileError):
                py_compile.compile(source, cfile=cached, doraise=True, invalidation_mode=_TIMESTAMP)
                written.append(source)
    return written


def install() -> None:
    """Idempotent."""
    atexit.unregister(keep_bytecode)
    atexit.register(keep_bytecode)
    util.stack = stack
    util.getframeinfo = getframeinfo
    host.HostData.__getattr__ = host_data_attr
    if not hasattr(arguments.all_global_arguments, "cache_info"):
        cached = functools.cache(lambda: tuple(_ORIGINAL()))
        arguments.all_global_arguments = facts.all_global_arguments = cached
