from __future__ import annotations

from rigforge.layout import DEFAULT_ROOT

DEFAULTS = {
    "rigforge_root": DEFAULT_ROOT,  # root of the host layout; checkouts go to <root>/src/<name>
}
