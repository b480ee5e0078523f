"""`rigforge rollout INVENTORY --to FILE | --rollback [--dry]` (docs/rollout.md): a canary with a speed gate, then
each other rig; the candidate replaces the lock in use (kept as `<lock>.previous`) only once every rig runs it. A
rollback keeps the lock it replaced as `<lock>.rolled-back` instead, so a second one refuses rather than move forward.
"""

import argparse
import json
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from types import SimpleNamespace
from typing import TYPE_CHECKING, TypeVar

import yaml

from rigforge.cli import verify
from rigforge.cli.lock import write_atomically
from rigforge.cli.status import ROLLOUT_MARKER
from rigforge.model import fleet, recipes
from rigforge.model.pins import LockError, load_lock
from rigforge.observe import inventory

if TYPE_CHECKING:  # pyinfra is imported where used (rigforge/observe/inventory.py)
    from pyinfra.api import Host

T = TypeVar("T")

REPO = Path(__file__).resolve().parents[2]
PYINFRA = str(Path(sys.executable).with_name("pyinfra"))
DEPLOY = REPO / "deploy" / "site.py"
BENCH_BODY = {"messages": [{"role": "user", "content": "Count to forty."}], "max_tokens": 40, "stream": False}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("inventory", metavar="INVENTORY", help="pyinfra inventory file, e.g. inventories/fleet.py")
    to = p.add_mutually_exclusive_group()
    to.add_argument("--to", type=Path, metavar="FILE", help="the candidate lock (`rigforge lock --recipes REF --out`)")
    to.add_argument("--rollback", action="store_true", help="roll back to the lock the last promotion replaced")
    p.add_argument("--dry", action="store_true", help="show what each rig would change, change nothing")
    p.add_argument("--canary", metavar="RIG", help="the canary rig (default: the first rig not held)")
    p.add_argument("--max-loss", type=float, default=0.30, help="the canary's allowed TPS loss (default 0.30)")
    p.add_argument("--bench-requests", type=int, default=5, help="chat completions per measurement (default 5)")
    p.add_argument("--promote-with-held", action="store_true", help="promote although held rigs stay behind")


class RolloutError(Exception):
    """The rollout stopped (one line, for the operator)."""


class CanaryFailed(RolloutError):
    """The canary did not hold and is back at the lock in use: the fleet is as it was."""


def say(text: str) -> None:
    print(f"rollout: {text}", flush=True)


PREVIOUS = ".previous"  # beside the lock in use: what the last promotion (not a rollback) replaced
ROLLED_BACK = ".rolled-back"  # beside the lock in use: what the last rollback replaced


def short_image(image: str) -> str:
    """An image reference with its digest cut to 12 hex digits, as `docker images` shows it."""
    name, at, digest = image.partition("@sha256:")
    return f"{name}{at}{digest[:12]}"


def named(lock: Path, images: list[str]) -> str:
    """`lock` and what the rigs run at it: `lock.yaml (recipes at 4a29ab57d42a, image vllm/...@sha256:7a7a7a7a7a7a)`."""
    pin = load_lock(lock).git.get(recipes.GIT_NAME)
    what = [f"recipes at {pin.commit[:12]}"] if pin and pin.commit else []
    what += [f"image {short_image(i)}" for i in dict.fromkeys(images)]
    return f"{lock} ({', '.join(what)})" if what else str(lock)


def target(old: Path, to: Path | None, rollback: bool) -> Path:
    """The lock to move the fleet at `old` to: `to`, or with `rollback` the lock the last promotion replaced
    (`<lock>.previous`). A rollback never moves forward: after one there is no `.previous`, and this refuses."""
    if not rollback:
        if to is None:
            raise RolloutError("no candidate lock: give --to FILE, or --rollback")
        if not to.is_file():
            raise RolloutError(f"no candidate lock: {to} is not a file")
        return to
    previous, undone = Path(f"{old}{PREVIOUS}"), Path(f"{old}{ROLLED_BACK}")
    if previous.is_file():
        return previous
    if undone.is_file():
        raise RolloutError(
            f"nothing to roll back to: the last promotion was a rollback, and --rollback never moves forward; {old} "
            f"holds what the rolled-back bump had replaced. To run the lock it rolled back from again (forward): "
            f"`rigforge rollout INVENTORY --to {undone}`"
        )
    raise RolloutError(f"nothing to roll back to: no {previous} (no bump was promoted yet)")


def promote(old: Path, new: Path, rollback: bool) -> Path:
    """`new`'s content becomes the lock in use `old`; what `old` held is kept beside it, as `<lock>.previous` (what a
    --rollback goes to), or after a rollback as `<lock>.rolled-back` with `.previous` removed (it is now in use).
    Returns where the replaced lock is kept."""
    text = new.read_text()  # first: with --rollback, `new` is the `.previous` written below
    previous, undone = Path(f"{old}{PREVIOUS}"), Path(f"{old}{ROLLED_BACK}")
    kept = undone if rollback else previous
    write_atomically(kept, old.read_text())
    write_atomically(old, text)
    (previous if rollback else undone).unlink(missing_ok=True)
    return kept


def speed_change(before: float, after: float) -> str:
    """`after` tokens/s against `before`, with its direction: `50% slower than 12.1`, `8% faster than 12.1`."""
    change = after / before - 1 if before else 0.0
    if round(change * 100) == 0:
        return f"the same as {before:.1f}"
    return f"{abs(change):.0%} {'slower' if change < 0 else 'faster'} than {before:.1f}"


# --- the preview ---------------------------------------------------------------------------------------------


def _plan(h: "Host", lock: Path) -> fleet.Plan:
    """Rig `h`'s plan at `lock`: a one-host Fleet (rigforge/model/fleet.py), its host data as the deploy reads it."""
    at = SimpleNamespace(name=h.name, groups=h.groups, data={**fleet.host_data(h.data), "rigforge_lock": str(lock)})
    fl = fleet.build([at])
    if fl.plans.get(h.name) is None:
        raise RolloutError(f"{h.name}: no plan at {lock}: {'; '.join(fl.problems.get(h.name, ()))}")
    return fl.plans[h.name]


def flags(files: dict) -> dict[str, str]:
    """{--flag: its value} of the serving command in a plan's compose file (effective one when rendered)."""
    text = files.get("effective-compose.yml") or files.get("docker-compose.yml") or "{}"
    services = (yaml.safe_load(text) or {}).get("services") or {}
    cmd = [str(c) for c in (next(iter(services.values()), {}) or {}).get("command") or []]  # the first service's
    out, key = {}, None
    for word in cmd:
        if word.startswith("--"):
            key = word
            out[word] = ""
        elif key:
            out[key] = f"{out[key]} {word}".strip()
    return out


def preview(h: "Host", old: Path, new: Path) -> dict:
    """What moving rig `h` from lock `old` to `new` changes: image, compose flags, weights to fetch, units."""
    a, b = _plan(h, old), _plan(h, new)
    fa, fb = flags(a.files), flags(b.files)
    changed_flags = {k: (fa.get(k), fb.get(k)) for k in sorted({*fa, *fb}) if fa.get(k) != fb.get(k)}
    have = {(x.pin.repo, x.pin.revision) for x in a.assets}
    fetch = {x.name: x.bytes for x in b.assets if (x.pin.repo, x.pin.revision) not in have}
    units = a.layout.vllm_unit, b.layout.vllm_unit
    restarts = list(dict.fromkeys(units)) if a.files != b.files or a.image != b.image or units[0] != units[1] else []
    image = a.locked_image, b.locked_image  # the lock's names (a fleet rig runs another registry's by its copy's)
    return {"rig": h.name, "image": image, "flags": changed_flags, "fetch": fetch, "restart": restarts}


def show(p: dict) -> str:
    old, new = p["image"]
    lines = [f"{p['rig']}:", f"  image: {old} -> {new}" if old != new else f"  image: {old} (unchanged)"]
    for flag, (was, now) in p["flags"].items():
        lines.append(f"  flag {flag}: {'(absent)' if was is None else was} -> {'(removed)' if now is None else now}")
    lines += [f"  weights to fetch: {name} ({size / 1e9:.2f} GB)" for name, size in p["fetch"].items()]
    lines.append(f"  restarts: {', '.join(p['restart'])}" if p["restart"] else "  restarts: nothing")
    return "\n".join(lines)


# --- measuring and moving one rig --------------------------------------------------------------------------


def tps(h: "Host", lock: Path, requests: int) -> float:
    """Median completion tokens/s of `requests` chat completions asked on the rig itself (curl's time_total: no SSH)."""
    plan = _plan(h, lock)
    url = f"http://{fleet.host_data(h.data)['serving_health_host'] or '127.0.0.1'}:{plan.port}/v1/chat/completions"
    rates = []
    for i in range(requests):
        body = {**BENCH_BODY, "model": plan.variant.served_model, "user": f"rigforge-rollout-{time.time_ns()}-{i}"}
        out = inventory.sh(h, inventory.curl_command(url, plan.settings.api_key, 300, body, last="time_total"))
        text, _, seconds = out.rpartition("\n")
        try:
            rates.append(json.loads(text)["usage"]["completion_tokens"] / float(seconds))
        except (ValueError, KeyError, TypeError, ZeroDivisionError):
            raise RolloutError(f"{h.name}: the bench request got no completion ({out[-200:]!r})") from None
    return statistics.median(rates)


def deploy(inventory_path: str, rig: str, lock: Path, rest: str | None = None) -> None:
    """One deploy of `rig` at `lock` (drained and kept so with `rest`), as the user runs it."""
    cmd = [PYINFRA, "-y", inventory_path, str(DEPLOY), "--limit", rig, "--data", f"rigforge_lock={lock}"]
    if rest:
        cmd += ["--data", f"serving_rest={rest}"]
    say(f"{rig}: deploy at {lock}" + (f" (kept {rest})" if rest else ""))
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    if proc.returncode:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-15:])
        raise RolloutError(f"{rig}: the deploy at {lock} failed (exit {proc.returncode}):\n{tail}")
    say(f"{rig}: at {lock.name} in {time.monotonic() - t0:.0f}s")


def on_rig(inventory_path: str, rig: str, lock: Path, fn: Callable[["Host", fleet.Fleet], T]) -> T:
    """fn(host, fleet) on `rig` connected over SSH, its host data (and the fleet's) read with `lock` as the lock."""
    state = inventory.open_inventory(inventory_path, override={"rigforge_lock": str(lock)})
    fl = fleet.build(state.inventory, deployable=False, opt_in=True)
    h = state.inventory.get_host(rig)
    h.connect(show_errors=False, raise_exceptions=True)
    state.activate_host(h)
    try:
        return fn(h, fl)
    finally:
        h.disconnect()


def measured(args: argparse.Namespace, rig: str, lock: Path) -> float:
    """`rig`'s median tokens/s at `lock`: `tps` of `--bench-requests` chat completions, on the rig connected with
    `lock` as its lock (`on_rig`)."""
    return on_rig(args.inventory, rig, lock, lambda h, _: tps(h, lock, args.bench_requests))


# --- the rollout ---------------------------------------------------------------------------------------------


def canary(args: argparse.Namespace, h: "Host", old: Path, new: Path) -> None:
    """Rig `h` drained, measured at `old`, deployed at `new`, verified and measured again; back at `old` (CanaryFailed,
    naming the lock, image and recipe commit it is back at) when a check fails or it lost more than `--max-loss`."""
    back = named(old, [_plan(h, old).locked_image])
    deploy(args.inventory, h.name, old, rest="drained")  # out of the gateway: its own speed, not the fleet's load
    before = measured(args, h.name, old)
    say(f"{h.name}: canary baseline {before:.1f} tokens/s at {old.name}")
    try:
        deploy(args.inventory, h.name, new, rest="drained")
    except RolloutError as exc:  # its health gate failed: switched back like a failed check
        failed = str(exc)  # its first line names the deploy; the rest is the end of its output
    else:
        checks, _ = on_rig(args.inventory, h.name, new, verify.check_host)  # drained on purpose: no gateway check
        bad = [f"{c.name}: {c.detail}" for c in checks if c.status == "fail"]
        failed = f"verify failed ({'; '.join(bad)})" if bad else ""
    if failed:
        say(f"{h.name}: canary at {new.name}: {failed.splitlines()[0]}")
    else:
        after = measured(args, h.name, new)
        loss = 1 - after / before if before else 0.0
        change = speed_change(before, after)
        say(f"{h.name}: canary {after:.1f} tokens/s at {new.name}: {change} (allowed: {args.max_loss:.0%} slower)")
        if loss > args.max_loss:
            failed = f"measured loss {loss:.0%} > allowed {args.max_loss:.0%} ({before:.1f} -> {after:.1f} tokens/s)"
    if failed:
        say(f"{h.name}: canary did not hold: rolling it back to {back}")
        deploy(args.inventory, h.name, old)  # back at the lock in use, and back in the gateway
        why, _, tail = failed.partition("\n")
        done = f"the canary {h.name} did not hold: {why.rstrip(':')}; it is back at {back}, nothing promoted"
        raise CanaryFailed(f"{done}\n{tail}" if tail else done)
    deploy(args.inventory, h.name, new)  # rejoins


def stopped(failure: str, moved: list[str], new: Path, old: Path, inventory_path: str) -> str:
    """The rollout stopped at a rig's failed deploy (`failure`: its first line, then the end of its output): who runs
    the candidate, that the lock in use did not move, and how to put every rig back at it."""
    why, _, tail = failure.partition("\n")
    done = (
        f"{why.rstrip(':')}; the rollout stopped: {', '.join(moved)} run {new}, the lock in use is still {old}. "
        f"`rigforge status {inventory_path}` shows which rigs run the candidate; a deploy of the inventory "
        f"(`pyinfra {inventory_path} deploy/site.py`) puts every rig back at {old.name}"
    )
    return f"{done}\n{tail}" if tail else done


def run(args: argparse.Namespace) -> int:
    try:
        rigs = [h for h in inventory.open_inventory(args.inventory).inventory if fleet.is_rig(h)]
        held = [h.name for h in rigs if fleet.host_data(h.data)["rollout_hold"]]
        if not (rigs := [h for h in rigs if h.name not in held]):
            raise RolloutError("no rig to roll out (every rig is held)")
        if len(paths := {str(fleet.host_data(h.data)["rigforge_lock"]) for h in rigs}) != 1:
            raise RolloutError(f"the rigs use {len(paths)} locks ({', '.join(sorted(paths))}): give them one lock")
        old = Path(paths.pop())
        new = target(old, args.to, args.rollback)
        if problems := load_lock(new).check():
            raise RolloutError(f"{new}: {'; '.join(problems)} (run `rigforge lock --lock {new}`)")
        if (first := next((h for h in rigs if h.name == args.canary), None) if args.canary else rigs[0]) is None:
            raise RolloutError(f"--canary {args.canary}: not a rig of {args.inventory} that is not held")
        previews = [preview(h, old, new) for h in rigs]  # every preview made before any is shown
        if args.rollback:
            was, back = named(old, [p["image"][0] for p in previews]), named(new, [p["image"][1] for p in previews])
            say(f"rollback: from {was} back to {back}")
        print("\n".join(show(p) for p in previews))
        for name in held:
            print(f"{name}: held (host data rollout_hold): stays at {old}")
        if args.dry:
            return 0
        marker = Path(f"{old}{ROLLOUT_MARKER}")  # `status` shows which rigs run the candidate meanwhile
        write_atomically(marker, json.dumps({"candidate": str(new.resolve())}) + "\n")
        try:
            canary(args, first, old, new)
        except CanaryFailed:
            marker.unlink(missing_ok=True)  # the canary is back: the fleet is at the lock in use
            raise  # any other failure leaves the marker: the canary may run the candidate
        moved = [first.name]
        for h in (h for h in rigs if h is not first):
            try:
                deploy(args.inventory, h.name, new)
            except RolloutError as exc:  # the marker stays: the fleet is mixed
                raise RolloutError(stopped(str(exc), moved, new, old, args.inventory)) from None
            moved.append(h.name)
        if held and not args.promote_with_held:
            say(f"every rig but the held {', '.join(held)} runs {new}; not promoted (--promote-with-held)")
            return 1
        kept = promote(old, new, args.rollback)
        marker.unlink(missing_ok=True)
        now = named(old, [p["image"][1] for p in previews])
        if args.rollback:
            say(
                f"rolled back: {now} holds again what the last bump replaced; the lock rolled back from is kept as "
                f"{kept} (a second --rollback refuses; `--to {kept}` moves forward again)"
            )
        else:
            say(f"promoted {new} to {now}; the lock it replaced is kept as {kept} (for --rollback)")
    except (RolloutError, LockError, inventory.InventoryError) as exc:
        print(f"rigforge rollout: {exc}", file=sys.stderr)
        return 1
    return 0
