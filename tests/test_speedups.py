"""Tier 1: rigforge/speedups.py makes pyinfra's per-operation work cheaper and leaves its results as they were.

Each check also counts the expensive call the speedup removes, so it fails when the patch stops taking effect
(e.g. pyinfra calling `inspect.stack()` by another name), not only when the results change."""

from __future__ import annotations

import inspect
import sys
from types import SimpleNamespace

import pytest
from pyinfra.api import Config, Inventory, arguments, facts, host, util
from pyinfra.api.exceptions import ArgumentTypeError

from rigforge import speedups


def _order(state):
    return util.get_operation_order_from_stack(state)


def _nested(state, depth: int):
    return _order(state) if depth == 0 else _nested(state, depth - 1)


@pytest.fixture
def shipped(monkeypatch):
    """pyinfra as shipped (an earlier test may have run the deploy entry, which installs the speedups); whatever
    was there is restored after the test."""
    monkeypatch.setattr(util, "get_operation_order_from_stack", speedups._SHIPPED_ORDER)
    monkeypatch.setattr(sys.modules["pyinfra.api.operation"], "get_operation_order_from_stack", speedups._SHIPPED_ORDER)
    monkeypatch.setattr(arguments, "all_global_arguments", speedups._ORIGINAL)
    monkeypatch.setattr(facts, "all_global_arguments", speedups._ORIGINAL)
    monkeypatch.setattr(host.HostData, "__getattr__", _SHIPPED_GETATTR)
    monkeypatch.setattr(sys.modules["pyinfra.api.operation"], "signature", inspect.signature)
    for name in speedups._CALLERS:
        monkeypatch.setattr(sys.modules[name], "pop_global_arguments", speedups._SHIPPED_POP)


_SHIPPED_GETATTR = host.HostData.__getattr__


def _counting(monkeypatch, module, name: str) -> list:
    calls: list = []
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


@pytest.mark.parametrize("cli", [True, False])
def test_operation_order_is_unchanged_and_reads_no_source(shipped, monkeypatch, cli):
    """From the deploy file's first frame on (else the last frame; else the whole stack), pyinfra's frames left
    out, the CLI's op file number first."""
    import pyinfra

    monkeypatch.setattr(pyinfra, "is_cli", cli)
    states = [
        SimpleNamespace(current_deploy_filename=name, current_op_file_number=7)
        for name in (__file__, "/not/on/the/stack.py", None)
    ]
    source_reads = _counting(monkeypatch, inspect, "findsource")  # what context=1 costs for every frame
    orders, reads = [], []
    for installed in (False, True):
        if installed:
            speedups.install()
        source_reads.clear()
        orders.append([[_nested(state, 3), _order(state)] for state in states])  # same call sites: the same lines
        reads.append(len(source_reads))
    assert orders[0] == orders[1] and len(orders[0][0][0]) > len(orders[0][0][1]) > 1
    assert util.get_operation_order_from_stack is speedups.operation_order
    assert reads[0] > 0  # pyinfra as shipped reads a source line per frame ...
    assert reads[1] == 0  # ... and with the speedup none: the patch takes effect


def test_global_arguments_are_unchanged_and_computed_once(shipped, monkeypatch):
    """An operation's global arguments: from its kwargs (popped), the current @deploy's kwargs, host data (each
    source in pyinfra's order), else pyinfra's config; a bad type raises as pyinfra's does. The same with the
    speedups, which evaluate the type hints once and merge the groups' data once a call, not once an argument."""
    inventory = Inventory(
        ([("r", {"_sudo": True, "_sudo_user": "rig", "_timeout": 30})], {"_shell_executable": "bash"}),
        rigs=(["r"], {"_sudo_user": "group", "_retries": 2, "_env": {"A": "1"}}),
        override_data={"_timeout": 60},
    )
    (r,) = inventory
    state = SimpleNamespace(config=Config())
    hints = arguments.all_global_arguments()
    cases = [
        ({}, None),
        ({"_sudo": False, "_ignore_errors": True, "name": "Op", "path": "/x"}, None),  # globals popped, the rest kept
        ({"_retries": 5}, {"_sudo_user": "deploy", "_env": {"B": "2"}}),  # the @deploy's kwargs over host data
        ({"_timeout": "soon"}, None),  # a bad type
    ]
    type_hints = _counting(monkeypatch, arguments, "get_type_hints")
    group_merges = _counting(monkeypatch, Inventory, "get_groups_data")
    results, evaluations, merges = [], [], []
    for installed in (False, True):
        if installed:
            speedups.install()
        type_hints.clear()
        group_merges.clear()
        outcomes = []
        for kwargs, deploy_kwargs in cases:
            kwargs = dict(kwargs)
            r.current_deploy_kwargs = deploy_kwargs
            try:
                values, found = arguments.pop_global_arguments(state, r, kwargs)
                outcomes.append((values, found, kwargs))
            except ArgumentTypeError as exc:
                outcomes.append(str(exc))
        results.append((list(arguments.all_global_arguments()), outcomes))
        evaluations.append(len(type_hints))
        merges.append(len(group_merges))
    assert results[0] == results[1] and results[0][0] == hints and len(hints) > 10
    values, found, left = results[1][1][2]
    assert (values["_sudo"], values["_sudo_user"], values["_timeout"], values["_retries"]) == (True, "deploy", 60, 5)
    assert values["_shell_executable"] == "bash" and values["_env"] == {"B": "2"} and found == ["_retries"]
    assert results[1][1][1][2] == {"path": "/x"} and results[1][1][3].startswith("Invalid argument `_timeout`:")
    assert evaluations[0] >= 3  # as shipped: the type hints evaluated on every call ...
    assert evaluations[1] <= 1  # ... with the speedup once: the patch takes effect where pyinfra calls it
    assert merges[0] >= 20 * len(cases) and merges[1] == len(cases)  # the groups merged per argument, then per call
    assert facts.all_global_arguments is arguments.all_global_arguments
    assert all(sys.modules[name].pop_global_arguments is speedups.pop_global_arguments for name in speedups._CALLERS)


def test_an_operations_signature_is_worked_out_once_per_function(shipped, monkeypatch):
    """What preparing an operation binds its arguments to (pyinfra.api.operation `signature(func).bind`)."""
    operation = sys.modules["pyinfra.api.operation"]

    def op(path, present=True): ...

    worked_out = _counting(monkeypatch, inspect, "_signature_from_callable")
    results = []
    for installed in (False, True):
        if installed:
            speedups.install()
        worked_out.clear()
        signatures = [operation.signature(op) for _ in range(3)]
        results.append((signatures[0], len(worked_out)))
        assert operation.signature(op).bind("/x").arguments == {"path": "/x"}
        with pytest.raises(TypeError):
            operation.signature(op).bind("/x", True, "a third")
    assert results[0][0] == results[1][0] and str(results[1][0]) == "(path, present=True)"
    assert results[0][1] == 3 and results[1][1] == 1


def test_host_data_lookups_are_pyinfras(shipped):
    """Each data source in pyinfra's order (override, host, groups in order, global, @deploy defaults), the first
    that has the key wins, its value copied; a key none has is an AttributeError (`.get` gives the default)."""
    inventory = Inventory(
        ([("r", {"h": "host", "gd": "host"})], {"g": 0, "all": 0}),
        first=(["r"], {"g": 1, "gd": 1, "listed": [1]}),
        second=(["r"], {"g": 2, "gd": 2}),
        override_data={"o": "override"},
    )
    (r,) = inventory
    r.data.set_by_the_run = "set"
    r.current_deploy_data = {"d": "default", "g": "deploy"}
    keys = ("o", "h", "g", "gd", "all", "d", "listed", "set_by_the_run", "missing")
    results = []
    for installed in (False, True):
        if installed:
            speedups.install()
        assert host.HostData.__getattr__ is (speedups.host_data_attr if installed else _SHIPPED_GETATTR)
        values = {key: r.data.get(key, "<absent>") for key in keys}
        with pytest.raises(AttributeError, match="Host `r` has no data `missing`"):
            r.data.missing  # noqa: B018
        r.data.listed.append(2)  # a copy: the inventory's list stays as it was
        results.append(values)
    assert results[0] == results[1]
    assert results[1] == {
        "o": "override",
        "h": "host",
        "g": 2,
        "gd": "host",
        "all": 0,
        "d": "default",
        "listed": [1],
        "set_by_the_run": "set",
        "missing": "<absent>",
    }


def test_frame_infos_are_inspects_and_looked_up_once_per_call_site(shipped, monkeypatch):
    speedups.install()
    for _ in range(2):  # the second time from remembered call sites
        theirs = inspect.stack(0)
        assert [speedups.getframeinfo(f.frame) for f in theirs] == [inspect.getframeinfo(f.frame, 0) for f in theirs]
    state = SimpleNamespace(current_deploy_filename=__file__, current_op_file_number=7)
    lookups = _counting(monkeypatch, inspect, "getframeinfo")
    orders, counts = [], []
    for _ in range(3):  # one call site: looked up the first time only
        lookups.clear()
        orders.append(_order(state))
        counts.append(len(lookups))
    assert orders[0] == orders[1] == orders[2] and counts[0] > 0 and counts[1:] == [0, 0]


def test_own_bytecode_is_kept_for_the_next_run(monkeypatch, tmp_path):
    """pyinfra's CLI sets sys.dont_write_bytecode: at exit, the bytecode of rigforge's own modules imported from
    source is written where Python reads it, once (then only when a source changes); not for other modules, and
    not when the user set PYTHONDONTWRITEBYTECODE."""
    import importlib.util
    import marshal

    import pyinfra.api.util as other

    import rigforge.model.driver_table as own

    def module(source, cached):
        spec = importlib.util.spec_from_file_location("m", source)
        spec.cached = str(cached)
        return SimpleNamespace(__spec__=spec)

    modules = {"own": module(own.__file__, tmp_path / "own.pyc"), "other": module(other.__file__, tmp_path / "o.pyc")}
    monkeypatch.setenv("PYTHONDONTWRITEBYTECODE", "1")
    assert speedups.keep_bytecode(modules) == [] and not (tmp_path / "own.pyc").exists()
    monkeypatch.delenv("PYTHONDONTWRITEBYTECODE")
    assert speedups.keep_bytecode(modules) == [own.__file__]
    assert not (tmp_path / "o.pyc").exists()
    data = (tmp_path / "own.pyc").read_bytes()
    assert data[:4] == importlib.util.MAGIC_NUMBER and marshal.loads(data[16:]).co_filename == own.__file__
    assert speedups.keep_bytecode(modules) == []  # up to date: nothing written
    (tmp_path / "own.pyc").write_bytes(data[:8] + bytes(8) + data[16:])  # another source mtime and size
    assert speedups.keep_bytecode(modules) == [own.__file__]
