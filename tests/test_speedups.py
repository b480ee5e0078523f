"""Tier 1: rigforge/speedups.py makes pyinfra's per-operation work cheaper and leaves its results as they were.

Each check also counts the expensive call the speedup removes, so it fails when the patch stops taking effect
(e.g. pyinfra calling `inspect.stack()` by another name), not only when the results change."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

import pytest
from pyinfra.api import Config, Inventory, arguments, facts, host, util

from rigforge import speedups


def _order(state):
    return util.get_operation_order_from_stack(state)


def _nested(state, depth: int):
    return _order(state) if depth == 0 else _nested(state, depth - 1)


@pytest.fixture
def shipped(monkeypatch):
    """pyinfra as shipped (an earlier test may have run the deploy entry, which installs the speedups); whatever
    was there is restored after the test."""
    monkeypatch.setattr(util, "stack", inspect.stack)
    monkeypatch.setattr(util, "getframeinfo", inspect.getframeinfo)
    monkeypatch.setattr(arguments, "all_global_arguments", speedups._ORIGINAL)
    monkeypatch.setattr(facts, "all_global_arguments", speedups._ORIGINAL)
    monkeypatch.setattr(host.HostData, "__getattr__", _SHIPPED_GETATTR)


_SHIPPED_GETATTR = host.HostData.__getattr__


def _counting(monkeypatch, module, name: str) -> list:
    calls: list = []
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(args)
        return original(*args, **kwargs)

    monkeypatch.setattr(module, name, counted)
    return calls


def test_operation_order_is_unchanged_and_reads_no_source(shipped, monkeypatch):
    state = SimpleNamespace(current_deploy_filename=__file__, current_op_file_number=7)
    source_reads = _counting(monkeypatch, inspect, "findsource")  # what context=1 costs for every frame
    orders, reads = [], []
    for installed in (False, True):
        if installed:
            speedups.install()
        source_reads.clear()
        orders.append([_nested(state, 3), _order(state)])  # same call sites, so the same line numbers
        reads.append(len(source_reads))
    assert orders[0] == orders[1] and len(orders[0][0]) > len(orders[0][1]) > 1
    assert reads[0] > 0  # pyinfra as shipped reads a source line per frame ...
    assert reads[1] == 0  # ... and with the speedup none: the patch takes effect


def test_global_arguments_are_unchanged_and_computed_once(shipped, monkeypatch):
    host = SimpleNamespace(current_deploy_kwargs=None, data=SimpleNamespace())
    state = SimpleNamespace(config=Config())
    hints = arguments.all_global_arguments()
    type_hints = _counting(monkeypatch, arguments, "get_type_hints")
    results, evaluations = [], []
    for installed in (False, True):
        if installed:
            speedups.install()
        type_hints.clear()
        keys = [sorted(arguments.pop_global_arguments(state, host, {})[0]) for _ in range(3)]
        results.append((list(arguments.all_global_arguments()), keys))
        evaluations.append(len(type_hints))
    assert results[0] == results[1] and results[0][0] == hints and len(hints) > 10
    assert evaluations[0] >= 3  # as shipped: the type hints evaluated on every call ...
    assert evaluations[1] <= 1  # ... with the speedup once: the patch takes effect where pyinfra calls it
    assert facts.all_global_arguments is arguments.all_global_arguments


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
    assert results[1] == {"o": "override", "h": "host", "g": 2, "gd": "host", "all": 0, "d": "default",
                          "listed": [1], "set_by_the_run": "set", "missing": "<absent>"}  # fmt: skip


def _both():
    return util.stack(), inspect.stack(0)


def test_stack_and_frame_infos_are_inspects_and_looked_up_once_per_call_site(shipped, monkeypatch):
    speedups.install()
    for _ in range(2):  # the second time from remembered call sites
        ours, theirs = _both()
        assert [f.frame for f in ours] == [f.frame for f in theirs] and len(ours) > 5
        assert ours[1:] == theirs[1:]  # below _both (whose own line differs), every field equal
        assert [util.getframeinfo(f.frame) for f in theirs] == [inspect.getframeinfo(f.frame, 0) for f in theirs]
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

    import rigforge.driver_table as own

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
