"""A bump rehearsed on the testbed with docs/rollout.md's commands only (issue 47): after `testbed up`, `.
DIR/env.sh` gives `rigforge lock` the stand-ins' endpoints, `unset RIGFORGE_RECIPES` leaves the controller to the
recipe commits it cached (A by `up`, B by `lock --recipes`), and `lock --recipes B --out` then `rollout --dry` work
in a shell with none of the variables the tests used to set by hand. With RIGFORGE_RECIPES still exported, the
preview is refused naming both commits, and never advises adding commit A's image (a downgrade) to the lock.

Marked `booted` and `testbed`: Docker Hub's stand-in, which `rigforge lock` asks for digests, runs only there.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from support import REPO, inventory_with

from rigforge.model.pins import load_lock
from rigforge.testbed import recipe_commits

pytestmark = [pytest.mark.testbed, pytest.mark.booted]
REFERENCE = REPO / "tests/fixtures/club-3090-4a29ab57"
# what a user's shell does not have: everything env.sh sets, and the recipe tree
UNSET = (
    "RIGFORGE_RECIPES",
    "HF_ENDPOINT",
    "RIGFORGE_HF_TOKEN",
    "HF_TOKEN",
    "RIGFORGE_REGISTRY",
    "REQUESTS_CA_BUNDLE",
    "RIGFORGE_TOOLKIT_REPO",
)


@pytest.fixture(scope="module")
def rehearsal(testbed_factory, tmp_path_factory):
    from rigforge.testbed import RigSpec

    missing = [tool for tool in ("systemd-nspawn", "nsenter", "ip") if not shutil.which(tool)]
    if missing:
        pytest.skip(f"cannot boot rigs: {', '.join(missing)} not found (apt-get install systemd-container iproute2)")
    tmp = tmp_path_factory.mktemp("rehearsal")
    saved = {name: os.environ.get(name) for name in ("RIGFORGE_RECIPES", "XDG_CACHE_HOME")}
    os.environ["RIGFORGE_RECIPES"] = str(REFERENCE)  # the docs' `export`: up builds the recipe remote from it
    os.environ["XDG_CACHE_HOME"] = str(tmp / "cache")  # this controller's cache, where up caches commit A
    try:
        tb = testbed_factory([RigSpec()], name="rehearsal", booted=True)
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
    inv = inventory_with(tb, tmp / "inventory.py", {"rig1": {"rigforge_variant": "vllm/dual"}})  # up --variant's
    yield tb, inv, tmp
    testbed_factory.release(tb)


def shell(script: str, tmp, **env: str) -> subprocess.CompletedProcess:
    """`script` in bash from the repo, as a user's shell: none of UNSET, the venv's commands on PATH."""
    clean = {k: v for k, v in os.environ.items() if k not in UNSET}
    clean |= {"XDG_CACHE_HOME": str(tmp / "cache"), "PATH": f"{REPO / '.venv/bin'}:{clean.get('PATH', '')}", **env}
    command = ["bash", "-c", f"set -e\n{script}"]
    return subprocess.run(command, cwd=REPO, capture_output=True, text=True, timeout=1200, env=clean)


def test_the_documented_rehearsal_makes_the_candidate_and_previews_it(rehearsal):
    tb, inv, tmp = rehearsal
    out = tmp / "lock-B.yaml"
    res = shell(
        f". {tb.env_file}\n"
        f"rigforge lock --lock {tb.lock} --recipes B --inventory {inv} --out {out}\n"
        f"rigforge rollout {inv} --to {out} --dry",
        tmp,
    )
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    new = load_lock(out)
    b_digest = tb.upstream_digests[recipe_commits.B_IMAGE]
    assert new.git["recipes"].commit == tb.services["git"]["recipes"]["tags"]["B"]
    assert new.images["vllm-stable"].ref == recipe_commits.B_IMAGE and new.images["vllm-stable"].digest == b_digest
    assert f"image: {recipe_commits.A_IMAGE}@" in res.stdout and f"-> {recipe_commits.B_IMAGE}@{b_digest}" in res.stdout
    assert "flag --max-num-batched-tokens: 8192 -> 16384" in res.stdout


def test_the_recipe_tree_still_exported_is_refused_naming_both_commits_without_a_downgrade(rehearsal):
    tb, inv, tmp = rehearsal
    tags = tb.services["git"]["recipes"]["tags"]
    out = tmp / "lock-B2.yaml"
    exported = {"RIGFORGE_RECIPES": str(REFERENCE)}  # as the README's quick start left it
    made = shell(f". {tb.env_file}\nrigforge lock --lock {tb.lock} --recipes B --out {out}", tmp, **exported)
    assert made.returncode == 0, made.stderr[-3000:]  # the candidate is made from B, whatever the tree exported
    res = shell(f"rigforge rollout {inv} --to {out} --dry", tmp, **exported)
    assert res.returncode != 0
    said = res.stdout + res.stderr
    assert f"RIGFORGE_RECIPES={REFERENCE} holds the recipe repo at {tags['A'][:12]}" in said, said[-3000:]
    assert f"the lock pins git.recipes at {tags['B'][:12]}" in said and "unset RIGFORGE_RECIPES" in said
    assert recipe_commits.A_IMAGE not in said and "add images" not in said
