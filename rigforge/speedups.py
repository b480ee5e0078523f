"""Pieces of pyinfra's per-operation controller work made cheap without changing what they return (a no-op
re-converge is mostly controller CPU, ~60 operations a rig), and rigforge's own bytecode kept.

- Operation order: `inspect.stack()` read a source line per frame, only file names and line numbers are used;
  `getframeinfo` (context 0) is remembered per call site. The same frames, file names and line numbers: the same
  order.
- `all_global_arguments()` (type hints evaluated on every call) and operations' `inspect.signature`: computed once,
  the same values: the type hints are fixed once pyinfra is imported, and a function's signature does not change.
- Host data: `HostData.__getattr__` raised and caught a KeyError per source lacking the key (~2 200 lookups a rig,
  ~2.4x faster with `in`); `pop_global_arguments` merges the sources once a call (~77 us to ~11). Both keep the
  same sources, in the same order, the same copy of the same value.
- Bytecode: pyinfra's CLI sets `sys.dont_write_bytecode`, so an editable install compiled its ~60 modules on every
  run (~90 ms); `keep_bytecode` writes it at exit (not with PYTHONDONTWRITEBYTECODE, nor where not writable), only
  for rigforge/ and roles/ modules this run imported from source. Python re-checks each file's mtime and size, so
  an edited module compiles again.
`benchmarks/bench_converge.py` measures the effect (benchmarks/RESULTS.md).
"""

import atexit
import contextlib
import functools
import importlib.util
import inspect
import os
import py_compile
import sys
import traceback
from collections.abc import Mapping
from copy import copy
from pathlib import Path
from types import FrameType, ModuleType
from typing import Any

import pyinfra
from pyinfra.api import Host, State, arguments, facts, host, util
from pyinfra.api.exceptions import ArgumentTypeError
from pyinfra.context import ctx_config

_ORIGINAL = arguments.all_global_arguments
_SHIPPED_POP = arguments.pop_global_arguments
_SHIPPED_ORDER = util.get_operation_order_from_stack
_FRAMES: dict = {}  # (code, instruction, line) -> inspect.getframeinfo(frame, 0)


def getframeinfo(frame: FrameType) -> inspect.Traceback:
    """`inspect.getframeinfo(frame, 0)`, remembered per call site."""
    key = (frame.f_code, frame.f_lasti, frame.f_lineno)
    if (info := _FRAMES.get(key)) is None:
        info = _FRAMES[key] = inspect.getframeinfo(frame, 0)
    return info


def operation_order(state: State) -> list[int]:
    """`pyinfra.api.util.get_operation_order_from_stack`: the calling stack's line numbers (`getframeinfo`), outermost
    first from the deploy file's first frame, pyinfra's own frames left out (the CLI's op file number first)."""
    infos = [getframeinfo(frame) for frame, _ in traceback.walk_stack(sys._getframe(1))][::-1]
    start = 0
    if state.current_deploy_filename:  # its first frame; else none (pyinfra's loop ends on its own frame)
        found = (i for i, info in enumerate(infos) if info.filename == state.current_deploy_filename)
        start = next(found, len(infos))
    lines = [state.current_op_file_number] if pyinfra.is_cli else []
    return lines + [info.lineno for info in infos[start:] if not info.filename.startswith(util.PYINFRA_INSTALL_DIR)]


def host_data_attr(self: host.HostData, key: str) -> Any:
    """`HostData.__getattr__`: the value of `key` in the first of the host's data sources that has it, copied."""
    for data in self.datas:
        data = data() if callable(data) else data  # @deploy data defaults are read when asked for
        if key in data:
            return copy(data[key])
    raise AttributeError(f"Host `{self.host}` has no data `{key}`")


def pop_global_arguments(state: State, host: Host, kwargs: dict) -> tuple[dict, list[str]]:
    """`pyinfra.api.arguments.pop_global_arguments`: each global argument from the operation's `kwargs` (popped),
    else the current @deploy's kwargs, else the host's data, else pyinfra's config; and the keys `kwargs` had."""
    config = ctx_config.get() if ctx_config.isset() else state.config
    deploy_kwargs = host.current_deploy_kwargs or {}
    data = {}
    for source in reversed(host.data.datas):  # HostData's sources: the first that has a key wins
        data.update(source() if callable(source) else source)
    found = [key for key, _ in arguments.all_global_arguments() if key in kwargs]
    values = {}
    for key, type_ in arguments.all_global_arguments():
        meta = arguments.all_argument_meta[key]
        default = copy(data[key]) if key in data else meta.default(config)
        value = kwargs.pop(key) if key in kwargs else deploy_kwargs.get(key, default)
        if meta.handler:
            value = meta.handler(config, value)
        if value != default:
            arguments.raise_if_bad_type(value, type_, ArgumentTypeError, f"Invalid argument `{key}`:")
        values[key] = value
    return values, found


_CALLERS = ("pyinfra.api.arguments", "pyinfra.api.operation", "pyinfra.api.facts", "pyinfra.api.deploy")
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
    return head != importlib.util.MAGIC_NUMBER + bytes(4) + stamp  # magic, flags (timestamp-based), mtime, size


def keep_bytecode(modules: Mapping[str, ModuleType] | None = None) -> list[str]:
    """Write missing or stale bytecode of rigforge's own modules in `modules` (default: sys.modules); their sources."""
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
    operation = sys.modules["pyinfra.api.operation"]  # (pyinfra.api.operation is the decorator; imported by name)
    util.get_operation_order_from_stack = operation.get_operation_order_from_stack = operation_order
    if not hasattr(operation.signature, "cache_info"):
        operation.signature = functools.cache(inspect.signature)
    host.HostData.__getattr__ = host_data_attr
    for name in _CALLERS:  # each module that imported it by name
        sys.modules[name].pop_global_arguments = pop_global_arguments
    if not hasattr(arguments.all_global_arguments, "cache_info"):
        arguments.all_global_arguments = facts.all_global_arguments = functools.cache(lambda: tuple(_ORIGINAL()))
