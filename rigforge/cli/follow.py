"""`rigforge lock --recipes REF`: the lock follows the recipe repo to REF (a tag, branch or commit of `git.recipes`).
Each engine the lock has an image entry for, or a used slug runs, gets the image its profile's `install.spec` runs at
REF (rigforge/model/recipes.py): unresolved again when its ref moved, else keeping its digest. A used slug's second
compose image gets an entry named after its service, and each weights repo it needs that the lock lacks an unresolved hf
entry; the caller resolves them all (rigforge/cli/lock.py `resolve`), prints the diff and writes the lock. The recipe
pin records REF's content digest, by which a copy of the recipe repo without .git (RIGFORGE_RECIPES) is told apart from
other commits.
"""

import dataclasses
import difflib
from collections.abc import Callable, Iterable
from pathlib import Path

from rigforge.model import recipes
from rigforge.model.pins import GitPin, ImagePin, Lock, LockError, dump_lock


def follow(
    lock: Lock, ref: str, slugs: Iterable[str], fetch: Callable[[GitPin], tuple[GitPin, Path]]
) -> tuple[Lock, recipes.RecipeRepo]:
    """(`lock` with its recipe pin at `ref` and the entries the used `slugs` need, the repo at `ref`). `fetch(pin)`
    resolves the pin's ref to a commit and returns the directory of that commit's checkout (rigforge/cli/lock.py)."""
    pin = lock.git.get(recipes.GIT_NAME)
    if pin is None:
        raise LockError(f"lock {lock.path}: no git.{recipes.GIT_NAME} entry (the recipe repo) to move to {ref}")
    moved, root = fetch(dataclasses.replace(pin, ref=ref, short=None, commit=None, content=None))
    repo = recipes.parse_repo(root)  # this commit, whatever RIGFORGE_RECIPES names
    moved = dataclasses.replace(moved, content=recipes.content_digest(Path(root)))  # a copy without .git is told by it
    used = [repo.recipe(slug, opt_in=True) for slug in dict.fromkeys(slugs)]
    engines = {r.engine: r.image for r in repo.recipes.values() if not r.refused and "@" not in r.image}
    images = dict(lock.images)
    for engine in sorted({*images, *(r.engine for r in used)} & set(engines)):
        old = images.get(engine)
        if old is None or old.ref != engines[engine]:
            images[engine] = ImagePin(ref=engines[engine], cuda=old.cuda if old else None)
    for r in used:
        for service, image in second_images(repo.compose(r)).items():
            name, _, digest = image.partition("@")
            if images.get(service, ImagePin(ref="")).ref != name:
                images[service] = ImagePin(ref=name, digest=digest or None)
    hf = dict(lock.hf)
    for w in (w for r in used for w in r.weights):
        if recipes.lock_entry(hf, w) is None:
            pin = recipes.weights_pin(w)
            hf[pin.name] = pin
    return dataclasses.replace(lock, git={**lock.git, recipes.GIT_NAME: moved}, images=images, hf=hf), repo


def second_images(compose: dict) -> dict[str, str]:
    """{service: image} of a compose file's services after the first (the serving one), e.g. a kernel image."""
    services = list((compose.get("services") or {}).items())[1:]
    return {name: str(svc["image"]) for name, svc in services if isinstance(svc, dict) and svc.get("image")}


def diff(old: Lock, new: Lock, path: str) -> str:
    """The change from `old` to `new`, as `diff -u` shows it ('' when none)."""
    before, after = dump_lock(old).splitlines(keepends=True), dump_lock(new).splitlines(keepends=True)
    return "".join(difflib.unified_diff(before, after, f"{path} (in use)", f"{path} (new)"))
