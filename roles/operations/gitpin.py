"""A checkout at one pinned commit (shallow, blobless, maybe sparse), verified, made or repaired by one idempotent
shell step (`checkout_script`)."""

import shlex
from collections.abc import Mapping, Sequence

from pyinfra import host
from pyinfra.api import operation

from rigforge.model.pins import GitPin
from rigforge.observe import verdict
from rigforge.observe.facts.gitpin import GitCheckout
from roles.operations.checks import fail_command
from roles.operations.shown import Commands, ShownCommand, say

# Shown git output: git's \r progress as lines, only each 10% step and the ", done." summary of each phase.
SHOWN = (
    'shown() { rcf=$(mktemp); { "$@" 2>&1 && echo 0 >"$rcf" || echo $? >"$rcf"; } '
    "| stdbuf -oL tr '\\r' '\\n' | grep --line-buffered -E ', done\\.|[0-9]0% \\(|^[^%]*$' || true; "
    'rc=$(cat "$rcf"); rm -f "$rcf"; return "$rc"; }'
)


def checkout_script(
    name: str, url: str, commit: str, dest: str, sparse: Sequence[str], files: Mapping[str, str]
) -> str:
    """The shell step that brings `dest` to `commit`, repairing what an interrupted run or a dirty tree left."""
    q = shlex.quote
    c, who = q(commit), f"{name} ({url})"
    refuse = q(f"rigforge: pinned commit {commit} of {who} is not on the remote; fix the lock (rigforge lock)")
    lines = [
        "set -e",
        SHOWN,
        f"mkdir -p {q(dest)}",
        f"cd {q(dest)}",
        "if [ -d .git ] && ! git rev-parse -q --resolve-git-dir .git >/dev/null 2>&1; then"  # a killed `git init`
        ' echo "rigforge: removing a half-made .git left by an interrupted run"; rm -rf .git; fi',
        "[ -d .git ] || git init -q",
        "for lock in .git/index.lock .git/shallow.lock .git/config.lock .git/HEAD.lock; do"  # a killed git's
        ' [ ! -e "$lock" ] || { echo "rigforge: removing $lock left by an interrupted run"; rm -f "$lock"; }; done',
        f"git remote get-url origin >/dev/null 2>&1 && git remote set-url origin {q(url)}"
        f" || git remote add origin {q(url)}",
        f"if ! git cat-file -e {c}^{{commit}} 2>/dev/null; then",
        f"  echo {q(f'rigforge: fetching {who} at {commit}')}",
        f"  shown git fetch --progress --depth 1 --filter=blob:none origin {c} || {{",
        f"    echo {q(f'rigforge: {name}: fetch by SHA refused, fetching all branches and tags')} >&2",
        "    shown git fetch --progress --filter=blob:none origin"
        " '+refs/heads/*:refs/remotes/origin/*' '+refs/tags/*:refs/tags/*' || true; }",
        f"  git cat-file -e {c}^{{commit}} 2>/dev/null || {{ echo {refuse} >&2; exit 1; }}",
        "fi",
    ]
    if sparse:
        body = "".join(p + "\\n" for p in verdict.sparse_patterns(sparse))
        lines += [
            "git config core.sparseCheckout true",
            "git config core.sparseCheckoutCone false",
            f"printf {q(body)} > .git/info/sparse-checkout",
        ]
    else:
        lines += ["git config core.sparseCheckout false", "rm -f .git/info/sparse-checkout"]
    lines += [
        "if git rev-parse -q --verify HEAD >/dev/null &&"
        ' [ -n "$(git status --porcelain --untracked-files=all)" ]; then',
        f"  echo {q(f'rigforge: {name}: dirty tree at {dest}, repairing (git reset --hard, git clean -ffdx):')}",
        "  git status --porcelain --untracked-files=all | head -20",
        "  git reset -q --hard",
        "  git clean -ffdxq",
        "fi",
        f"shown git -c advice.detachedHead=false checkout --progress --force --detach {c}",
        "git sparse-checkout reapply 2>/dev/null || true" if sparse else "true",
    ]
    for path, sha in files.items():
        msg = q(f"rigforge: {name}: {path} does not match the lock's sha256 {sha}")
        lines.append(f'[ "$(sha256sum < {q(path)} | cut -c1-64)" = {sha} ] || {{ echo {msg} >&2; exit 1; }}')
    lines.append(f"echo {q(f'rigforge: {name} checked out at {commit}')}")
    return "\n".join(lines)


@operation()
def checkout(pin: GitPin, dest: str) -> Commands:
    """Check out the pin's commit at ``dest`` (detached, sparse when it says so); a wrong sha256 of its files fails.

    + pin: the locked source
    + dest: the checkout directory

    **Example:**

    .. code:: python

        from roles.operations import gitpin
        pin = lock.git["club-3090"]  # a rigforge.model.pins.GitPin
        gitpin.checkout(
            name=f"Check out {pin.name} at {pin.commit[:12]}",
            pin=pin,
            dest=f"/opt/rigforge/src/{pin.name}",
        )
    """
    name, url, commit, sparse, files = pin.name, pin.url, pin.commit, list(pin.sparse), dict(pin.files)
    state = host.get_fact(GitCheckout, path=dest, files=tuple(files))
    if problems := verdict.checkout(pin, dest, state):
        yield say("; ".join(problems))
        yield ShownCommand(checkout_script(name, url, commit, dest, sparse, files))
    elif bad := verdict.files_not_locked(state, files):
        yield fail_command(
            f"{host.name}: {name}: {bad[0]} at {commit} does not match the lock's sha256 "
            f"{files[bad[0]]}; the lock's files do not belong to this commit: fix the lock"
        )
    else:
        host.noop(f"{name} is at {commit[:12]}, clean, files verified")
