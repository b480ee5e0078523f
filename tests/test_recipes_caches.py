"""Caches stay rigforge's (issue 47): a bind mount whose target is vLLM's torch_compile or triton cache comes from
<root>/cache/<name>, whatever its source or variable, so the compile caches are outside the recipe checkout a bump
replaces. The later composes' form, `${CLUB3090_ENGINE_CACHE_DIR:-../../../cache}/...`, is in
tests/fixtures/club-3090-engine-cache (4a29ab57 has none)."""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
import yaml
from support import render_variant

from rigforge.layout import HostLayout
from rigforge.model import recipes
from rigforge.model.schema import Settings, apply_overrides
from rigforge.testbed import recipe_commits

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "tests/fixtures/club-3090-4a29ab57"
LATER = REPO / "tests/fixtures/club-3090-engine-cache/fp8-mtp.yml"
IMAGE = "vllm/vllm-openai:v0.27.1@sha256:" + "ab" * 32
TORCH, TRITON = "/root/.cache/vllm/torch_compile_cache", "/root/.triton/cache"
CACHES = [f"/srv/rf/cache/torch_compile:{TORCH}", f"/srv/rf/cache/triton:{TRITON}"]


def tree_with(tmp_path: Path, compose: str) -> Path:
    """A copy of the 4a29ab57 tree whose vllm/dual compose is `compose`."""
    tree = tmp_path / "club-3090"
    shutil.copytree(REFERENCE, tree, symlinks=True)
    (tree / recipe_commits.DUAL).write_text(compose)
    return tree


def rendered(tree: Path, slug: str = "vllm/dual") -> tuple[list[str], list[str]]:
    """(the effective compose's volumes, the override's) of `slug` from `tree`, rigforge_root /srv/rf."""
    repo = recipes.parse_repo(tree)
    files = render_variant(recipes.of(repo, repo.recipe(slug), IMAGE), apply_overrides(Settings(), {"root": "/srv/rf"}))
    effective = next(iter(yaml.safe_load(files[recipes.EFFECTIVE_FILE])["services"].values()))
    override = next(iter(yaml.safe_load(files[recipes.OVERRIDE_FILE])["services"].values()))
    return effective["volumes"], override.get("volumes", [])


def test_the_later_composes_engine_cache_variable_still_mounts_rigforges_caches(tmp_path):
    """Before: with `${CLUB3090_ENGINE_CACHE_DIR:-../../../cache}` the override mounted nothing, and the caches
    were /srv/rf/src/recipes/models/qwen3.6-27b/vllm/cache/{torch_compile,triton}: inside the pinned checkout."""
    assert "${CLUB3090_ENGINE_CACHE_DIR:-../../../cache}/torch_compile:" + TORCH in LATER.read_text()
    effective, override = rendered(tree_with(tmp_path, LATER.read_text()))
    assert override == CACHES
    assert [v for v in effective if v.endswith((TORCH, TRITON))] == CACHES
    assert not [v for v in effective if v.startswith("/srv/rf/src/") and "/cache/" in v], effective


@pytest.mark.parametrize(
    "source",
    [
        "${CLUB3090_ENGINE_CACHE_DIR:-../../../cache}",  # unset: the recipe's default, inside the checkout
        "${SOME_OTHER_DIR:-/var/cache/vllm}",  # another variable, an absolute default
        "/mnt/fast/compile",  # no variable at all
        "../../../../../../cache",  # another relative depth
    ],
)
def test_any_source_of_a_cache_target_is_replaced_by_the_rigs_cache_dir(tmp_path, source):
    text = (REFERENCE / recipe_commits.DUAL).read_text()
    text = text.replace("../../../cache/torch_compile:", f"{source}/torch_compile_int8:")
    text = text.replace("../../../cache/triton:", f"{source}/triton-x:")
    effective, override = rendered(tree_with(tmp_path, text))
    assert override == CACHES and [v for v in effective if v.endswith((TORCH, TRITON))] == CACHES


def test_a_named_volume_on_a_cache_target_is_dockers_and_left_alone(tmp_path):
    text = (REFERENCE / recipe_commits.DUAL).read_text().replace("../../../cache/triton:", "triton-cache:")
    effective, override = rendered(tree_with(tmp_path, text))
    assert override == CACHES[:1] and f"triton-cache:{TRITON}" in effective


def test_the_caches_are_the_same_dirs_outside_the_checkout_before_and_after_a_bump(tmp_path):
    """A (4a29ab57's relative mounts) and B (the later variable, and the bump's other changes) mount the same
    <root>/cache dirs, which are not under src/: the compile caches survive the bump."""
    tree = tree_with(tmp_path, (REFERENCE / recipe_commits.DUAL).read_text())
    before, _ = rendered(tree)
    shutil.copyfile(LATER, tree / recipe_commits.DUAL)
    recipe_commits.to_b(tree)
    after, _ = rendered(tree)
    caches = [v for v in after if v.endswith((TORCH, TRITON))]
    assert caches == [v for v in before if v.endswith((TORCH, TRITON))] == CACHES
    src_root = HostLayout(root="/srv/rf").src_root
    assert not any(v.startswith(src_root) for v in caches)


def test_every_slug_of_the_reference_mounts_its_compile_caches_from_the_rigs_cache_dir():
    """4a29ab57's composes name their cache dirs torch_compile, torch_compile_int8, triton_qatawq, ...: each comes
    from <root>/cache/torch_compile or /triton (vLLM keys its entries by config hash, so variants share them)."""
    repo = recipes.parse_repo(REFERENCE)
    served = [s for s, r in repo.recipes.items() if not r.refused]
    checked = 0
    for slug in served:
        r = repo.recipe(slug, opt_in=True)
        files = render_variant(recipes.of(repo, r, IMAGE), apply_overrides(Settings(), {"root": "/srv/rf"}))
        service = next(iter(yaml.safe_load(files[recipes.EFFECTIVE_FILE])["services"].values()))
        for volume in service.get("volumes") or []:
            source, target = volume.split(":")[:2]
            if target in (TORCH, TRITON):
                assert source in ("/srv/rf/cache/torch_compile", "/srv/rf/cache/triton"), (slug, volume)
                checked += 1
    assert checked >= 2 * 20  # two caches in most of the 2-card slugs
