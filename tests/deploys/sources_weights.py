"""Test deploy: the sources and weights roles alone, on the hosts of an inventory (the testbed's).

The plan comes from roles/site.py (host data validated, lock from host data `rigforge_lock`, token checks) for
a variant shaped by the environment: RIGFORGE_TEST_SOURCES (comma-separated git names, default all of the
lock's) and RIGFORGE_TEST_ASSETS (comma-separated `key[=dir]`, default every hf entry into a dir of its own
name); an empty value skips that role.
"""

import os
from dataclasses import replace

from pyinfra import host

from rigforge.layout import AssetDir
from rigforge.model.catalog import load_catalog
from rigforge.model.pins import load_lock
from roles import site, sources, weights

lock = load_lock(host.data.get("rigforge_lock"))
names = os.environ.get("RIGFORGE_TEST_SOURCES", ",".join(lock.git))
items = os.environ.get("RIGFORGE_TEST_ASSETS", ",".join(lock.hf))
assets = dict((item.split("=", 1) + [item])[:2] for item in items.split(",")) if items else {}
variant = replace(
    load_catalog().variants["dual"],
    name="sources-weights-test",
    sources=tuple(names.split(",")) if names else (),
    assets=tuple(assets),
    asset_dirs=tuple(AssetDir(a, folder, 0) for a, folder in assets.items()),
)
plan = site.prepare(site.the_fleet(variant))
if plan and names:
    sources.apply(plan)
if plan and assets:
    weights.apply(plan)
