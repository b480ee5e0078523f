"""Test deploy: the sources and weights roles alone, on the hosts of an inventory (the testbed's).

Reads the lock from host data `rigforge_lock`. Which entries: env RIGFORGE_TEST_SOURCES (comma-separated git
names, default all of the lock's) and RIGFORGE_TEST_ASSETS (comma-separated `key[=dir]`, default every hf
entry into a dir of its own name); an empty value skips that role.
"""

import os

from pyinfra import host

from rigforge.pins import load_lock
from roles import sources, weights

lock = load_lock(host.data.get("rigforge_lock"))
names = os.environ.get("RIGFORGE_TEST_SOURCES", ",".join(lock.git))
assets = os.environ.get("RIGFORGE_TEST_ASSETS", ",".join(lock.hf))

if names:
    sources.apply(lock, names.split(","))
if assets:
    weights.apply(lock, dict((item.split("=", 1) + [item])[:2] for item in assets.split(",")))
