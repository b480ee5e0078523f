"""The recipe tree follows the lock (issue 47): once the lock pins a recipe commit, RIGFORGE_RECIPES naming another
commit is refused, naming both; a tree without .git is told by its content (the digest the lock records); the
vendored fixture and the testbed's commit A are accepted; a lock that moved never yields advice to move it back."""

from __future__ import annotations

import dataclasses
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from rigforge.cli import follow
from rigforge.model import fleet, recipes
from rigforge.model.pins import LockError, default_lock_path, dump_lock, load_lock, parse_lock
from rigforge.model.recipes import RecipeError
from rigforge.testbed import content, recipe_commits

REPO = Path(__file__).resolve().parents[1]
REFERENCE = REPO / "tests/fixtures/club-3090-4a29ab57"


@pytest.fixture(scope="module")
def remote(tmp_path_factory) -> dict:
    """The testbed's recipe remote (commits A, B, B-slow from the fixture), a git checkout of each of A and B, and
    a copy of B without .git: {"tags", "A", "B", "B-copy"}."""
    base = tmp_path_factory.mktemp("recipes")
    env = content._git_env()
    tags = content._build_recipes(REFERENCE, base / "work-a", base, env)["tags"]  # work-a is left at A
    subprocess.run(["git", "clone", "-q", str(base / "recipes.git"), str(base / "work-b")], check=True, env=env)
    subprocess.run(["git", "-C", str(base / "work-b"), "checkout", "-q", "B"], check=True, env=env)
    shutil.copytree(base / "work-b", base / "copy-b", symlinks=True, ignore=shutil.ignore_patterns(".git"))
    return {"tags": tags, "A": base / "work-a", "B": base / "work-b", "B-copy": base / "copy-b"}


def lock_at(remote: dict, tag: str):
    """The shipped lock with its recipe pin at the testbed's commit `tag` (and its content digest), the engine image
    that commit runs pinned by digest."""
    lock = load_lock(default_lock_path())
    pin = dataclasses.replace(
        lock.git["recipes"],
        ref=tag,
        commit=remote["tags"][tag],
        content=recipes.content_digest(remote[f"{tag}-copy"] if f"{tag}-copy" in remote else REFERENCE),
    )
    image = recipe_commits.B_IMAGE if tag == "B" else recipe_commits.A_IMAGE
    engine = dataclasses.replace(lock.images["vllm-stable"], ref=image, digest="sha256:" + "b0" * 32)
    return dataclasses.replace(lock, git={**lock.git, "recipes": pin}, images={**lock.images, "vllm-stable": engine})


@pytest.fixture
def no_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "empty-cache"))


def test_the_vendored_fixture_is_accepted_against_the_shipped_lock_by_its_content(monkeypatch, no_cache):
    pin = load_lock(default_lock_path()).git["recipes"]
    assert pin.content == recipes.content_digest(REFERENCE)  # the digest recorded for 4a29ab57
    assert not (REFERENCE / ".git").exists()
    monkeypatch.setenv("RIGFORGE_RECIPES", str(REFERENCE))
    assert recipes.locate(pin.commit, pin.content) == REFERENCE


def test_the_testbeds_commit_a_is_accepted_as_a_checkout_and_as_the_fixture(remote, monkeypatch, no_cache):
    lock = lock_at(remote, "A")
    pin = lock.git["recipes"]
    for tree in (remote["A"], REFERENCE):  # a git checkout at A (its HEAD), the tree A was made of (its content)
        monkeypatch.setenv("RIGFORGE_RECIPES", str(tree))
        assert recipes.locate(pin.commit, pin.content) == tree
        assert recipes.find("vllm/dual", lock, opt_in=False).image.startswith(recipe_commits.A_IMAGE + "@")


def test_a_checkout_of_another_commit_is_refused_naming_both_commits(remote, monkeypatch, no_cache):
    a, b = remote["tags"]["A"], remote["tags"]["B"]
    monkeypatch.setenv("RIGFORGE_RECIPES", str(remote["A"]))
    with pytest.raises(RecipeError) as refused:
        recipes.find("vllm/dual", lock_at(remote, "B"), opt_in=False)
    assert str(refused.value) == (
        f"RIGFORGE_RECIPES={remote['A']} is the recipe repo at {a[:12]}, the lock pins git.recipes at {b[:12]}: "
        "unset RIGFORGE_RECIPES (the controller then reads the locked commit from the cache `rigforge lock` fills), "
        f"or point it at a checkout of {b[:12]}"
    )


def test_a_tree_without_git_of_another_commit_is_refused_by_its_content(remote, monkeypatch, tmp_path):
    """RIGFORGE_RECIPES still at the fixture (commit A's tree) once the lock moved to B: refused, naming B; and
    naming A too when the controller's cache holds A (what `rigforge lock` cached before the bump)."""
    lock = lock_at(remote, "B")
    b = remote["tags"]["B"]
    monkeypatch.setenv("RIGFORGE_RECIPES", str(REFERENCE))
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "cache"))
    with pytest.raises(RecipeError) as refused:
        recipes.find("vllm/dual", lock, opt_in=False)
    message = str(refused.value)
    assert message.startswith(f"RIGFORGE_RECIPES={REFERENCE} is not the recipe repo at {b[:12]}, the commit the lock")
    assert "it has no .git, and the files rigforge reads there" in message and "unset RIGFORGE_RECIPES" in message
    a = remote["tags"]["A"]
    shutil.copytree(remote["A"], recipes.cache_dir(a), symlinks=True)
    with pytest.raises(RecipeError) as refused:
        recipes.find("vllm/dual", lock, opt_in=False)
    assert f"RIGFORGE_RECIPES={REFERENCE} holds the recipe repo at {a[:12]} (told by its content" in str(refused.value)
    assert f"the lock pins git.recipes at {b[:12]}" in str(refused.value)
    monkeypatch.setenv("RIGFORGE_RECIPES", str(remote["B-copy"]))  # a copy of B without .git: B's content
    assert recipes.find("vllm/dual", lock, opt_in=False).image.startswith(recipe_commits.B_IMAGE + "@")


def test_a_moved_lock_never_advises_moving_back(remote, monkeypatch, no_cache, tmp_path):
    """What happened before: the deploy and verify with RIGFORGE_RECIPES at A and the lock at B advised adding A's
    image (v0.27.1) to the lock, a downgrade. Now the plan is refused for the tree, and names no image."""
    path = tmp_path / "bumped.yaml"
    path.write_text(dump_lock(lock_at(remote, "B")))
    data = fleet.host_data({"rigforge_lock": str(path)})
    for tree in (REFERENCE, remote["A"]):
        monkeypatch.setenv("RIGFORGE_RECIPES", str(tree))
        for deployable in (True, False):  # the deploy's plan, and the one status and verify render
            plan, problems = fleet.build_plan("rig", data, "vllm/dual", deployable=deployable)
            assert plan is None and len(problems) == 1, problems
            assert "RIGFORGE_RECIPES" in problems[0] and remote["tags"]["B"][:12] in problems[0]
            assert recipe_commits.A_IMAGE not in problems[0] and "add images" not in problems[0]
    monkeypatch.setenv("RIGFORGE_RECIPES", str(remote["B"]))  # the tree that follows the lock
    plan, problems = fleet.build_plan("rig", data, "vllm/dual", deployable=False)
    assert problems == [] and plan.variant.image.startswith(recipe_commits.B_IMAGE + "@")


def test_a_tree_without_git_is_refused_when_nothing_says_what_the_locked_commit_holds(monkeypatch, no_cache):
    monkeypatch.setenv("RIGFORGE_RECIPES", str(REFERENCE))
    with pytest.raises(RecipeError, match="has no .git and the lock records no content digest for git.recipes at "):
        recipes.locate("c" * 40, None)
    assert recipes.locate(None, None) == REFERENCE  # a lock without a recipe pin: nothing to follow


def test_lock_recipes_records_the_content_digest_of_the_commit_it_moves_to(remote):
    lock = lock_at(remote, "A")

    def fetch(pin):
        return dataclasses.replace(pin, commit=remote["tags"]["B"]), remote["B"]

    new, _ = follow.follow(lock, "B", [], fetch)
    assert new.git["recipes"].content == recipes.content_digest(remote["B-copy"]) != lock.git["recipes"].content
    assert f"content: {new.git['recipes'].content}" in dump_lock(new)


def test_the_content_digest_covers_what_rigforge_reads_and_nothing_else(tmp_path):
    tree = tmp_path / "tree"
    shutil.copytree(REFERENCE, tree, symlinks=True)
    before = recipes.content_digest(tree)
    (tree / "PROVENANCE.md").write_text("changed\n")  # not upstream's, not read
    (tree / "models/qwen3.6-27b/vllm/compose/_archive").mkdir(parents=True)
    (tree / "models/qwen3.6-27b/vllm/compose/_archive/old.yml").write_text("services: {}\n")
    recipes.content_digest.cache_clear()
    assert recipes.content_digest(tree) == before
    (tree / recipe_commits.DUAL).write_text((tree / recipe_commits.DUAL).read_text() + "# edited\n")
    recipes.content_digest.cache_clear()
    assert recipes.content_digest(tree) != before


def test_the_lock_reads_and_writes_the_recipe_pins_content_and_refuses_a_malformed_one():
    lock = load_lock(default_lock_path())
    again = parse_lock(yaml.safe_load(dump_lock(lock)), "again")
    assert again.git["recipes"].content == lock.git["recipes"].content
    data = yaml.safe_load(dump_lock(lock))
    data["git"]["recipes"]["content"] = "8c6dad9a"
    with pytest.raises(LockError, match=r"git.recipes.content: expected 'sha256:<64 hex>' or null, got '8c6dad9a'"):
        parse_lock(data, "bad")
