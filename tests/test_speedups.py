"""Tier 1: roles/speedups.py makes pyinfra's per-operation work cheaper and leaves its results as they were."""

from __future__ import annotations

import inspect
from types import SimpleNamespace

from pyinfra.api import arguments, facts, util

from roles import speedups


def _order(state):
    return util.get_operation_order_from_stack(state)


def _nested(state, depth: int):
    return _order(state) if depth == 0 else _nested(state, depth - 1)


def test_operation_order_and_global_arguments_are_unchanged(monkeypatch):
    # pyinfra as shipped (another test may have imported roles.site, which installs the speedups), restored after
    monkeypatch.setattr(util, "stack", inspect.stack)
    monkeypatch.setattr(util, "getframeinfo", inspect.getframeinfo)
    monkeypatch.setattr(arguments, "all_global_arguments", speedups._ORIGINAL)
    monkeypatch.setattr(facts, "all_global_arguments", speedups._ORIGINAL)
    state = SimpleNamespace(current_deploy_filename=__file__, current_op_file_number=7)
    hints, stack = arguments.all_global_arguments(), util.stack
    orders = []
    for installed in (False, True):
        if installed:
            speedups.install()
        orders.append([_nested(state, 3), _order(state)])  # same call sites, so the same line numbers
    assert util.stack is not stack  # installed
    assert orders[0] == orders[1] and len(orders[0][0]) > len(orders[0][1]) > 1
    assert list(arguments.all_global_arguments()) == hints and len(hints) > 10
    assert arguments.all_global_arguments() is arguments.all_global_arguments()  # computed once
    assert facts.all_global_arguments is arguments.all_global_arguments
