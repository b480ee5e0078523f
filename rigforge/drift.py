"""Drift: what a rig holds against its plan. The one place each check lives; `status` shows these as a table,
`verify` as pass/fail checks beside its live API probes.

Each function takes the connected host (pyinfra's, as `status`/`verify` open it) and the rig's plan, reads the
rig through facts (read-only) and returns (problems, fine): lines naming what differs, and what matched.
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping

from rigforge.layout import SERVE_FILES
from rigforge.plan import Plan
from rigforge.render import POWER_UNIT, VLLM_UNIT
from roles.facts.gitpin import GitCheckout
from roles.facts.hfweights import WeightsState
from roles.facts.managed import ContentHash

TOKEN_LINE = "HF_TOKEN="  # .env's token line: compared only when the controller has the token (the plan's)


def sources(host, plan: Plan, want: Mapping[str, str | None], label: str = "lock") -> tuple[list[str], list[str]]:
    """Each checkout at `want`'s commit ({source: commit}: the lock's, or the manifest's with `label`
    "provisioned"), with no local changes."""
    bad, good = [], []
    for name in plan.variant.sources:
        commit, path = want.get(name), plan.layout.src(name)
        state = host.get_fact(GitCheckout, path=path)
        if state is None:
            bad.append(f"git {name}: no checkout at {path}")
        elif not commit:
            bad.append(f"git {name}: no resolved commit to compare with")
        elif state["head"] != commit:
            bad.append(f"git {name}: HEAD {str(state['head'])[:12] or '?'}, {label} {commit[:12]}")
        elif state["dirty"]:
            n, first = len(state["dirty"]), state["dirty"][0].strip()
            bad.append(f"git {name}: dirty checkout at {path} ({n} file(s), e.g. {first})")
        else:
            good.append(f"{name}@{commit[:12]}")
    return bad, good


def weights(host, plan: Plan) -> tuple[list[str], list[str]]:
    """Each asset's stamp is the lock's revision and sha256s, and every file is as stamped (size, mtime)."""
    bad, good = [], []
    for asset in plan.assets:
        pin, dest = asset.pin, plan.layout.asset_dir(asset.dir)
        state = host.get_fact(WeightsState, dest=dest, staging=plan.layout.weights_staging(asset.name))
        stamp = state["stamp"]
        if not stamp:
            bad.append(f"hf {asset.name}: no stamp in {dest}")
            continue
        if stamp.get("revision") != pin.revision:
            bad.append(
                f"hf {asset.name}: stamp revision {str(stamp.get('revision'))[:12]}, lock {str(pin.revision)[:12]}"
            )
            continue
        entries, problems = stamp.get("files") or {}, []
        for f in pin.files:
            entry, on_disk = entries.get(f.path), state["files"].get(f.path)
            if not entry or entry.get("sha256") != f.sha256:
                problems.append(f"{f.path} not stamped with the lock's sha256")
            elif on_disk is None:
                problems.append(f"{f.path} missing")
            elif on_disk[0] != f.size:
                problems.append(f"{f.path} is {on_disk[0]} bytes, lock {f.size}")
            elif on_disk[1] != entry.get("mtime_ns"):
                problems.append(f"{f.path} modified since it was verified (mtime differs from the stamp)")
        if problems:
            bad.append(f"hf {asset.name}: {'; '.join(problems[:3])}{' ...' if len(problems) > 3 else ''}")
        else:
            good.append(f"{asset.name} ({len(pin.files)} files @ {str(pin.revision)[:12]})")
    return bad, good


def managed_files(plan: Plan) -> dict[str, tuple[str, str | None]]:
    """{path on the rig: (the plan's text, prefix of lines not compared)} of every file rigforge renders whole."""
    layout, files = plan.layout, plan.files
    out = {f"{layout.serve_dir}/{name}": (files[name], None) for name in SERVE_FILES if name in files}
    env = f"{layout.serve_dir}/.env"
    if env in out and not plan.token:
        out[env] = (out[env][0], TOKEN_LINE)  # a run without the token keeps the rig's token line
    out[layout.unit_path(VLLM_UNIT)] = (files[VLLM_UNIT], None)
    out[layout.unit_path(POWER_UNIT)] = (files[POWER_UNIT], None)
    return out


def _sha256(text: str, drop: str | None) -> str:
    kept = text if not drop else "".join(line for line in text.splitlines(True) if not line.startswith(drop))
    return hashlib.sha256(kept.encode()).hexdigest()


def files(host, plan: Plan) -> tuple[list[str], list[str]]:
    """Every file rigforge renders whole is on the rig as the plan renders it (compared by sha256: no secret is
    read or shown). A hand edit shows here, naming the file."""
    bad, good = [], []
    for path, (text, drop) in managed_files(plan).items():
        on_rig = host.get_fact(ContentHash, path=path, drop=drop)
        if on_rig is None:
            bad.append(f"{path} is missing")
        elif on_rig != _sha256(text, drop):
            bad.append(f"{path} differs from what rigforge renders (edited by hand? re-run the deploy)")
        else:
            good.append(path)
    return bad, good
