"""Tier 1: every operation in roles/operations/ documents its arguments as pyinfra's own do (`+ name: meaning`)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

OPERATIONS = sorted((Path(__file__).parent.parent / "roles" / "operations").glob("*.py"))


def operations(path: Path):
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.FunctionDef) and any("operation" in ast.unparse(d) for d in node.decorator_list):
            yield node


@pytest.mark.parametrize("path", OPERATIONS, ids=lambda p: p.name)
def test_operation_docstrings_list_every_argument(path):
    for node in operations(path):
        doc = ast.get_docstring(node) or ""
        names = [a.arg for a in node.args.args + node.args.kwonlyargs]
        listed = re.findall(r"^\+ (\w+):", doc, re.M)
        assert doc, f"{path.name}: {node.name} has no docstring"
        assert listed == names or (not names and "no arguments" in doc), (
            f"{path.name}: {node.name}'s docstring lists {listed}, its arguments are {names}"
        )


@pytest.mark.parametrize("path", OPERATIONS, ids=lambda p: p.name)
def test_every_operation_shows_a_call_as_pyinfras_own_do(path):
    """Issue 48: each operation's docstring has pyinfra's Example(s) block, a ``.. code:: python`` call of it."""
    for node in operations(path):
        doc = ast.get_docstring(node) or ""
        assert re.search(r"^\*\*Examples?:\*\*$", doc, re.M), f"{path.name}: {node.name} has no **Example:** block"
        code = doc.split(".. code:: python", 1)[-1] if ".. code:: python" in doc else ""
        assert f"{node.name}(" in code, f"{path.name}: {node.name}'s example does not call it"
