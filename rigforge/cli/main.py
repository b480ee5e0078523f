"""The `rigforge` command. Each subcommand lives in its own module exposing add_arguments() and run()."""

import argparse
import importlib
import sys
from pathlib import Path
from types import SimpleNamespace

from rigforge.cli.lock import write_atomically
from rigforge.layout import HOLD_SCRIPT, SETTLE_SCRIPT
from rigforge.model import fleet, recipes
from rigforge.model.catalog import Catalog, CatalogError, load_catalog
from rigforge.model.pins import LockError, default_lock_path, load_lock
from rigforge.model.schema import HOST_KEYS, SettingsError, parse_set

# subcommand -> (module, help). Modules expose add_arguments(parser) and run(args) -> int.
SUBCOMMANDS = {
    "testbed": ("rigforge.testbed.cli", "simulated rigs over real SSH (no GPU needed)"),
    "lock": ("rigforge.cli.lock", "resolve or check the pins in rigforge.lock.yaml"),
    "status": ("rigforge.cli.status", "what each rig of an inventory runs"),
    "verify": ("rigforge.cli.verify", "health checks for each rig of an inventory"),
    "bench": ("rigforge.cli.bench", "the recipes' TPS benchmark against a running server"),
    "rollout": ("rigforge.cli.rollout", "move a fleet to a candidate lock: preview, canary with a bench gate, rollout"),
    "images": (
        "rigforge.cli.images",
        "keep the locked images in a directory, and load them onto a rig at their digests",
    ),
}


def _list(catalog: Catalog) -> None:
    """`rigforge render --list`: the seed variants, then the recipe repo's slugs at the lock's recipe pin (those
    rigforge runs, then the opt-in ones, then the refused ones, with why); without a readable lock or recipe repo,
    a line saying why the slugs are not listed."""
    print(f"{'VARIANT':<44} {'PORT':>5}  {'STATUS':<12} {'RIGFORGE':<8} WEIGHTS")
    for v in catalog.variants.values():
        weights = ", ".join(catalog.assets[a].hf_repo for a in v.assets)
        print(f"{v.name:<44} {v.port:>5}  {'seed':<12} {'yes':<8} {weights}  ({v.pick_when})")
    try:
        pin = load_lock(default_lock_path()).git.get(recipes.GIT_NAME)
        repo = recipes.load_repo(pin.commit if pin else None, pin.content if pin else None)
    except (recipes.RecipeError, LockError) as exc:
        print(f"(recipe-repo slugs not listed: {exc})")
        return
    rows = [(r, "refused" if r.refused else "opt-in" if r.needs_opt_in else "yes") for r in repo.recipes.values()]
    for r, how in sorted(rows, key=lambda x: ("yes", "opt-in", "refused").index(x[1])):
        detail = f"refused: {r.refused}" if r.refused else r.weights_label
        print(f"{r.slug:<44} {r.port:>5}  {r.status:<12} {how:<8} {detail}")


def _render(args: argparse.Namespace) -> int:
    catalog = load_catalog()
    if args.list:
        _list(catalog)
        return 0
    if not args.variant or not args.out:
        raise SettingsError("render needs VARIANT and --out DIR (variants: `rigforge render --list`)")

    data = {HOST_KEYS.get(key, key): value for key, value in parse_set(args.sets).items()}
    if unknown := sorted(set(data) - set(fleet.host_data({}))):
        raise SettingsError(f"unknown setting {unknown[0]!r}; allowed: {', '.join(sorted(HOST_KEYS.values()))}")
    data |= {"rigforge_recipe_opt_in": args.opt_in}
    one = fleet.build(
        [SimpleNamespace(name="render", groups=(), data=data)], args.variant, gpus=args.gpus, deployable=False
    )
    if (plan := one.plans["render"]) is None:
        raise SettingsError("; ".join(one.problems["render"]))
    args.out.mkdir(parents=True, exist_ok=True)
    for name, text in plan.files.items():
        mode = 0o600 if name == ".env" else 0o755 if name in (SETTLE_SCRIPT, HOLD_SCRIPT) else 0o644
        write_atomically(args.out / name, text, mode)
    print("\n".join(f"wrote {args.out / name}" for name in plan.files))
    unresolved = [] if "@" in plan.image else [f"image {plan.image} (digest: null)"]
    unresolved += [f"hf.{a.name} {a.pin.repo} (revision: null)" for a in plan.assets if not a.pin.resolved]
    unresolved += [f"git.{p.name} (commit: null)" for p in plan.sources if not p.resolved]
    if unresolved:
        print(
            f"unresolved pins (rendered as tags and names; a deploy refuses them until `rigforge lock` resolves "
            f"them): {', '.join(unresolved)}"
        )
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="rigforge",
        description="Provision dual RTX 3090 vLLM rigs. Converge rigs with `pyinfra INVENTORY deploy/<variant>.py`; "
        "these commands render, pin, simulate, inspect and benchmark.",
    )
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("render", help="render a variant's files locally, no host needed")
    p.set_defaults(run=_render)
    p.add_argument("variant", help="variant name (see `rigforge render --list`)", nargs="?")
    p.add_argument("--out", type=Path, help="directory to write the files into")
    p.add_argument(
        "--set",
        dest="sets",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a setting, by its host-data key or its short name (repeatable), e.g. --set serving_port=8111",
    )
    p.add_argument("--gpus", type=int, default=None, help="GPU count for the power unit (default: variant's)")
    p.add_argument("--list", action="store_true", help="list the variants and exit")
    p.add_argument(
        "--opt-in",
        action="store_true",
        help="allow a recipe-repo slug whose status is experimental, incubating or deprecated",
    )
    for name, (module, help_text) in SUBCOMMANDS.items():
        mod = importlib.import_module(module)
        mod.add_arguments(sp := sub.add_parser(name, help=help_text))
        sp.set_defaults(run=mod.run)
    return parser


def _patch_for_gevent(argv: list[str]) -> None:
    """For status and verify (SSH in greenlets, rigforge/observe/inventory.py): gevent patches ssl before requests
    imports it; a late patch makes each HTTPS request from a greenlet recurse endlessly (both ask registries:
    obtain.py)."""
    if argv and argv[0] in ("status", "verify") and "ssl" not in sys.modules:
        from gevent import monkey

        monkey.patch_all()


def main(argv: list[str] | None = None) -> int:
    _patch_for_gevent(sys.argv[1:] if argv is None else argv)
    args = build_parser().parse_args(argv)
    try:
        return args.run(args)
    except (CatalogError, SettingsError, LockError, recipes.RecipeError) as exc:
        print(f"rigforge {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
