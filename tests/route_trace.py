"""Run `pyinfra` with a profiler that records the variant's route: each call into the project's code (rigforge/,
roles/, deploy/) that takes the variant as an argument, by its name or as the object, or the compose file rendered
for it (the text, or a mapping holding it). Writes one "module:function" line per such call, in order, to the file
named by RIGFORGE_ROUTE_OUT; the rest of argv goes to pyinfra.

Usage: python tests/route_trace.py INVENTORY deploy/dual_turbo.py --dry -y
(tests/test_architecture_doc.py runs it on a @fake rig.)
"""

from __future__ import annotations

import os
import sys
import threading
from collections.abc import Mapping
from pathlib import Path
from types import FrameType

REPO = Path(__file__).resolve().parents[1]
ROOTS = tuple(f"{REPO / top}{os.sep}" for top in ("rigforge", "roles", "deploy"))
TESTBED = f"{REPO / 'rigforge' / 'testbed'}{os.sep}"
VARIANT = os.environ.get("RIGFORGE_ROUTE_VARIANT", "dual-turbo")
MARK = f"# Rendered by rigforge for variant {VARIANT}."  # the compose file's first line


def carries_the_variant(value: object) -> bool:
    """Whether an argument is the variant (its name or the object) or its rendered compose file (or holds it)."""
    if isinstance(value, str):
        return value == VARIANT or value.startswith(MARK)
    if getattr(value, "name", None) == VARIANT and hasattr(value, "files"):
        return True
    if isinstance(value, Mapping):  # the files, {name: text} or {name: (text, mode)}
        try:
            texts = [v[0] if isinstance(v, tuple) and v else v for v in value.values()]
        except Exception:  # a mapping that cannot list its values is not the files
            return False
        return any(isinstance(text, str) and text.startswith(MARK) for text in texts)
    return False


def module_of(filename: str) -> str:
    return Path(filename).relative_to(REPO).as_posix()


def main() -> None:
    out = Path(os.environ["RIGFORGE_ROUTE_OUT"])
    route: list[str] = []

    def profile(frame: FrameType, event: str, arg: object) -> None:
        if event != "call":
            return
        filename = os.path.abspath(frame.f_code.co_filename)
        if not filename.startswith(ROOTS) or filename.startswith(TESTBED):
            return
        code = frame.f_code
        names = code.co_varnames[: code.co_argcount + code.co_kwonlyargcount]
        if code.co_name == "<module>" and filename.startswith(ROOTS[2]):
            route.append(f"{module_of(filename)}:<module>")
        elif any(carries_the_variant(frame.f_locals.get(name)) for name in names):
            caller = frame.f_back
            by = f"{caller.f_code.co_filename}:{caller.f_code.co_name}" if caller else "?"
            route.append(f"{module_of(filename)}:{code.co_name} <- {by}")

    sys.setprofile(profile)
    threading.setprofile(profile)
    from pyinfra_cli.main import main as pyinfra_main

    sys.argv = ["pyinfra", *sys.argv[1:]]
    try:
        pyinfra_main()
    except SystemExit as exc:
        code = exc.code
    else:
        code = 0
    finally:
        sys.setprofile(None)
        out.write_text("".join(f"{step}\n" for step in route))
    raise SystemExit(code)


if __name__ == "__main__":
    main()
