"""Tier 4: a slug's card count on a FRESH testbed rig (issue 50): a 2-card rig asked for a TP=4 slug
(`vllm/qwen-27b-multi-fast`) is refused before anything on it changes, the refusal naming both counts. The rig is
snapshotted before and after as tests/test_converge_refusals.py does (packages, /etc/apt, /opt/rigforge,
/etc/systemd/system, with checksums). The 4-card rig that serves it is tests/testbed/test_booted_cards.py.
"""

from __future__ import annotations

import os

import pytest
from support import REPO, changed, inventory_with, pyinfra_run
from test_converge_refusals import NO_TOKEN, snapshot
from test_recipes import REFERENCE

pytestmark = pytest.mark.testbed


@pytest.fixture(scope="module")
def two_cards(testbed_factory):
    """One fresh chroot rig with 2x RTX 3090, the recipe repo the club-3090 reference."""
    from rigforge.testbed import RigSpec

    saved = os.environ.get("RIGFORGE_RECIPES")
    os.environ["RIGFORGE_RECIPES"] = str(REFERENCE)  # testbed up builds its recipes remote from it; deploys read it
    try:
        yield testbed_factory([RigSpec(gpus=2)], name="cards")
    finally:
        if saved is None:
            os.environ.pop("RIGFORGE_RECIPES", None)
        else:
            os.environ["RIGFORGE_RECIPES"] = saved


def test_a_two_card_rig_asked_for_a_tp4_slug_is_refused_with_nothing_changed(two_cards, tmp_path):
    rig = two_cards.rig("rig1")
    fresh = snapshot(rig)
    assert "/opt/rigforge" not in fresh
    inv = inventory_with(two_cards, tmp_path / "inv.py", {"rig1": {"rigforge_variant": "vllm/qwen-27b-multi-fast"}})
    results, err = pyinfra_run(inv, REPO / "deploy" / "site.py", env=NO_TOKEN)
    assert results.get("failed_hosts") in ("all", ["rig1"]), err[-3000:]
    message = err[err.index("preflight failed on rig1:") :]
    assert (
        "variant vllm-qwen-27b-multi-fast needs 4 GPUs, the PCI bus shows 2 NVIDIA GPU(s); this rig has 2 GPU(s) "
        "and the variant runs tensor-parallel over 4: add 2 GPU(s)"
    ) in message, message[:2000]
    assert "Nothing was changed on this host." in message
    assert changed(results, "rig1") == []
    assert snapshot(rig) == fresh
