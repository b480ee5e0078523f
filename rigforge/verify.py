"""`rigforge verify INVENTORY`: DeepOps-style health checks for every rig of a pyinfra inventory.

One line per check per rig (or --json), read in parallel over SSH, nothing changed on a rig:
  manifest present          /etc/rigforge/rig.json names a known variant
  driver module = package   /sys/module/nvidia/version equals the installed driver (the driver table's package
                            for the rig's OS, branch, flavour and source); with nvidia_driver_manage false:
                            the running driver is of nvidia_driver_branch
  GPUs visible              nvidia-smi lists at least the variant's GPU count
  VRAM fits variant         every card has the variant's VRAM (20 GB cards only with the documented override)
  power caps hold           every GPU's power limit equals its target (gpu_power_limit_w / gpu_power_limits)
  persistence mode on       on every GPU
  nvidia runtime            /etc/docker/daemon.json registers the nvidia runtime
  sources at locked SHAs    <root>/src/<name> HEAD is the lock's commit, no local changes
  weights stamp valid       <model dir>/<asset>/.rigforge-stamp.json matches the lock; files as stamped (size, mtime)
  unit enabled / active     rigforge-vllm@<variant>.service
  /v1/models answers        from the rig, as the recipes' verify.sh
  chat returns text         "capital of France", thinking off: the reply names Paris
  tool call returned        a get_weather tool, tool_choice auto: the reply carries tool_calls
With rigforge_manage_services False (the testbed: no systemd in a chroot) the service and API checks
are reported "skipped (services not managed on this host)", not failed.

Exit: 0 every check passed (skips allowed), 1 a check failed, 2 could not run (inventory unreadable, or a
rig unreachable while no check failed).
"""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict, dataclass

from rigforge import drift, status
from rigforge.hardware import small_override, vram_problems
from rigforge.status import (
    SKIPPED,
    RigContext,
    api_models,
    ctx_host,
    gpus_with_targets,
    http_on_rig,
    rig_context,
    sh,
    unit_state,
)
from roles.facts.managed import JsonFile

PASS, FAIL, SKIP = "pass", "fail", "skip"


@dataclass
class Check:
    name: str
    status: str
    detail: str = ""


def _variant_needed(ctx: RigContext) -> str:
    if ctx.variant_name and not ctx.variant:
        return f"unknown variant {ctx.variant_name!r}"
    return f"variant unknown: no {ctx.layout.rig_json} and no rigforge_variant in host data"


def check_host(host) -> list[Check]:
    ctx = rig_context(host)
    out: list[Check] = []

    def add(name: str, ok: bool | None, detail: str) -> None:
        out.append(Check(name, SKIP if ok is None else PASS if ok else FAIL, detail))

    for problem in ctx.problems:
        add("host data", False, problem)
    if ctx.manifest is None:
        missing = f"no readable {ctx.layout.rig_json}: not provisioned by rigforge (run the deploy)"
        add("manifest present", False, missing)
    else:
        add("manifest present", ctx.variant is not None, f"variant {ctx.variant_name}" if ctx.variant else
            _variant_needed(ctx))  # fmt: skip
    out.append(check_driver(host, ctx))
    out.extend(check_gpus(host, ctx))
    out.append(check_runtime(host, ctx))
    for name, check, hint in DRIFT:
        if ctx.lock is None:
            add(name, False, f"lock unreadable: {ctx.lock_error}")
        elif ctx.plan is None:
            add(name, False, _variant_needed(ctx))
        else:
            bad, good = check(host, ctx.plan)
            add(name, not bad, "; ".join(bad) + hint if bad else ", ".join(good) or "nothing for this variant")
    out.extend(check_service_and_api(host, ctx))
    return out


def check_driver(host, ctx: RigContext) -> Check:
    from roles import driver_table, nvidia_driver
    from roles.facts.nvidia import NvidiaModuleVersion, NvidiaRunningDriver, upstream_version
    from roles.facts.system import OsRelease
    from roles.operations.nvidia import branch_problem

    name = "driver module = package"
    data = ctx.data
    if not data["nvidia_driver_manage"]:
        running = host.get_fact(NvidiaRunningDriver)
        problem = branch_problem(running, int(data["nvidia_driver_branch"]))
        return (
            Check(name, FAIL, problem)
            if problem
            else Check(
                name, PASS, f"running {running['version']} (nvidia_driver_manage false: not installed by rigforge)"
            )
        )
    try:
        pkg = nvidia_driver.packages_for(data, host.get_fact(OsRelease)["id"]).version_package
    except driver_table.DriverTableError as error:
        return Check(name, FAIL, f"{error} (host data)")
    module = host.get_fact(NvidiaModuleVersion)
    row = sh(host, f"dpkg-query -W -f '${{db:Status-Status}} ${{Version}}\\n' {pkg}").strip()
    version = row.split()[1] if row.startswith("installed ") and len(row.split()) > 1 else None
    if not version:
        return Check(name, FAIL, f"{pkg} is not installed (run the deploy: nvidia_driver role)")
    if not module:
        return Check(name, FAIL, f"{pkg} {version} installed but the nvidia module is not loaded: reboot the rig "
                     "(with Secure Boot on, the module must be signed/enrolled)")  # fmt: skip
    if upstream_version(version) != module:
        return Check(name, FAIL, f"module {module} loaded, package {pkg} {version} installed: driver/library "
                     "mismatch, reboot the rig to load the installed driver")  # fmt: skip
    return Check(name, PASS, f"module {module} = {pkg} {version}")


def check_gpus(host, ctx: RigContext) -> list[Check]:
    gpus = gpus_with_targets(host, ctx)
    need = ctx.variant.gpus if ctx.variant else None
    names = sorted({g.get("name") or "?" for g in gpus})
    seen = f"{len(gpus)} GPU(s){': ' + ', '.join(names) if gpus else ''}"
    if not gpus:
        visible = Check("GPUs visible", FAIL, "nvidia-smi lists no GPU (driver not installed or not loaded)")
    elif need and len(gpus) < need:
        visible = Check("GPUs visible", FAIL, f"{seen}; {ctx.variant_name} needs {need}")
    else:
        visible = Check("GPUs visible", PASS, seen)
    off = [g for g in gpus if g.get("power_limit") != g["target_w"]]
    caps = ", ".join(f"GPU{g['index']} {_w(g.get('power_limit'))} W" for g in gpus)
    if not gpus:
        cap = Check("power caps hold", FAIL, "no GPU to read")
    elif off:
        bad = "; ".join(f"GPU{g['index']} at {_w(g.get('power_limit'))} W, target {g['target_w']} W" for g in off)
        cap = Check("power caps hold", FAIL, f"{bad} (re-run the deploy or restart rigforge-gpu-power.service)")
    else:
        cap = Check(
            "power caps hold", PASS, f"{caps} (target {', '.join(sorted({str(g['target_w']) for g in gpus}))} W)"
        )
    not_persistent = [str(g["index"]) for g in gpus if g.get("persistence_mode") is not True]
    if not gpus:
        persist = Check("persistence mode on", FAIL, "no GPU to read")
    elif not_persistent:
        persist = Check("persistence mode on", FAIL, f"off on GPU {', '.join(not_persistent)}")
    else:
        persist = Check("persistence mode on", PASS, f"on for {len(gpus)} GPU(s)")
    return [visible, check_vram(gpus, ctx.variant, ctx.settings), cap, persist]


def check_vram(gpus: list[dict], v, s) -> Check:
    """Every card has the VRAM variant `v` needs with settings `s` (20 GB cards: only with the documented
    override)."""
    name = "VRAM fits variant"
    if not gpus or not v:
        return Check(name, FAIL, "no GPU to read" if not gpus else "variant unknown")
    override = small_override(s.kv_cache_dtype, s.gpu_memory_utilization)
    problems = vram_problems(gpus, v.name, v.min_card_mib, v.uses_dflash, override)
    if problems:
        return Check(name, FAIL, " ".join(problems))
    vram = "/".join(str(m) for m in sorted({g.get("memory_total") for g in gpus}))
    return Check(name, PASS, f"{vram} MiB per card, {v.name} needs {v.min_card_mib}" + (" (20 GB override)" * override))


def _w(v) -> str:
    return "?" if v is None else f"{v:g}"


def check_runtime(host, ctx: RigContext) -> Check:
    """daemon.json is merged, not rendered: only the key rigforge owns (the nvidia runtime) is compared."""
    from roles.operations.docker_daemon import NVIDIA_RUNTIME

    name, path = "nvidia runtime", ctx.layout.daemon_json
    daemon = host.get_fact(JsonFile, path=path)
    if daemon is None:
        return Check(name, FAIL, f"no readable {path} (run the deploy: docker_engine role)")
    runtime = (daemon.get("runtimes") or {}).get("nvidia")
    if runtime != NVIDIA_RUNTIME["runtimes"]["nvidia"]:
        return Check(name, FAIL, f"{path} registers {'no' if runtime is None else 'another'} nvidia runtime "
                     f"({runtime!r}; run the deploy)")  # fmt: skip
    return Check(name, PASS, f"nvidia -> {runtime.get('path', '?')} in {path}")


DRIFT = (  # (check, drift function of (host, plan), what to do when it fails)
    ("sources at locked SHAs", lambda host, plan: drift.sources(host, plan, {p.name: p.commit for p in plan.sources}),
     " (re-run the deploy: sources role)"),
    ("weights stamp valid", drift.weights, " (re-run the deploy: weights role)"),
    ("files as rendered", drift.files, ""),
)  # fmt: skip


CHAT = {
    "messages": [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
    "max_tokens": 30,
    "temperature": 0.6,
    "chat_template_kwargs": {"enable_thinking": False},
}
TOOL = {
    "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
    "tools": [
        {
            "type": "function",
            "function": {
                "name": "get_weather",
                "description": "Get the current weather for a city",
                "parameters": {
                    "type": "object",
                    "properties": {
                        "city": {"type": "string"},
                        "units": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                    },
                    "required": ["city"],
                },
            },
        }
    ],
    "tool_choice": "auto",
    "max_tokens": 200,
    "temperature": 0.3,
    "chat_template_kwargs": {"enable_thinking": False},
}


def check_service_and_api(host, ctx: RigContext) -> list[Check]:
    unit = unit_state(host, ctx)
    if not unit["unit"]:
        reason = _variant_needed(ctx)
        return [Check("unit enabled", FAIL, reason)] + [
            Check(n, FAIL if ctx.manage else SKIP, reason if ctx.manage else SKIPPED)
            for n in ("unit active", "/v1/models answers", "chat returns text", "tool call returned")
        ]
    out = [
        Check("unit enabled", PASS if unit["enabled"] else FAIL,
              f"{unit['unit']} {'enabled' if unit['enabled'] else 'not enabled (run the deploy)'}"),
    ]  # fmt: skip
    if not ctx.manage:
        return out + [
            Check(n, SKIP, SKIPPED)
            for n in ("unit active", "/v1/models answers", "chat returns text", "tool call returned")
        ]
    active = unit["active"] == "active"
    out.append(Check("unit active", PASS if active else FAIL, f"{unit['unit']} is {unit['active']}"
                     + ("" if active else f" (journalctl -u {unit['unit']})")))  # fmt: skip
    api = api_models(host, ctx)
    model = (ctx.variant.arg("--served-model-name") if ctx.variant else None) or (api["models"] or [None])[0]
    if api["http_code"] != 200:
        why = f"HTTP {api['http_code']}" if api["http_code"] else "no answer"
        out.append(Check("/v1/models answers", FAIL, f"{api['url']}: {why}"))
        return out + [Check(n, FAIL, "the API does not answer") for n in ("chat returns text", "tool call returned")]
    listed = model in (api["models"] or [])
    out.append(Check("/v1/models answers", PASS if listed else FAIL,
                     f"{api['url']} lists {', '.join(api['models'] or []) or 'nothing'}"
                     + ("" if listed else f"; expected {model}")))  # fmt: skip
    base = f"http://{ctx_host(ctx)}:{ctx.port}/v1/chat/completions"
    out.append(_chat_check(host, ctx, base, model))
    out.append(_tool_check(host, ctx, base, model))
    return out


def _post(host, ctx, url, body) -> tuple[int, dict | None, str]:
    code, text = http_on_rig(host, ctx, url, timeout=120, body=body)
    try:
        return code, json.loads(text), text
    except ValueError:
        return code, None, text


def _message(reply: dict | None) -> dict:
    try:
        return reply["choices"][0]["message"] or {}
    except (KeyError, IndexError, TypeError):
        return {}


def _chat_check(host, ctx, url, model) -> Check:
    code, reply, text = _post(host, ctx, url, {"model": model, **CHAT})
    if code != 200:
        return Check("chat returns text", FAIL, f"HTTP {code or 'no answer'}: {text[:120]}")
    content = (_message(reply).get("content") or "").strip()
    if "paris" not in content.lower():
        return Check("chat returns text", FAIL, f"reply does not name Paris: {content[:80]!r}")
    return Check("chat returns text", PASS, f"{content[:60]!r}")


def _tool_check(host, ctx, url, model) -> Check:
    code, reply, text = _post(host, ctx, url, {"model": model, **TOOL})
    if code != 200:
        return Check("tool call returned", FAIL, f"HTTP {code or 'no answer'}: {text[:120]}")
    msg = _message(reply)
    names = [(c.get("function") or {}).get("name") for c in msg.get("tool_calls") or []]
    if "get_weather" in names:
        return Check("tool call returned", PASS, f"tool_calls: {', '.join(n for n in names if n)}")
    if "<tool_call>" in (msg.get("content") or ""):
        return Check("tool call returned", FAIL, "the tool call came back as text (tool-call parser not active)")
    return Check("tool call returned", FAIL, f"no get_weather tool call in the reply: {str(msg)[:100]}")


# ---------------------------------------------------------------- the command


def add_arguments(p: argparse.ArgumentParser) -> None:
    status.add_arguments(p, shown="one line per check")


def run(args) -> int:
    results = status.read_rigs(args, "verify", check_host)
    if results is None:
        return 2
    failed = {h: [c.name for c in r if c.status == FAIL] for h, r in results.items() if not isinstance(r, Exception)}
    unreachable = {h: str(r) for h, r in results.items() if isinstance(r, Exception)}
    code = 1 if any(failed.values()) else 2 if unreachable else 0
    if args.json:
        hosts = {
            h: {"error": str(r), "checks": []} if isinstance(r, Exception) else
            {"error": None, "checks": [asdict(c) for c in r]}
            for h, r in results.items()
        }  # fmt: skip
        print(json.dumps({"exit_code": code, "hosts": hosts}, indent=2))
        return code
    width = max(len(h) for h in results)
    name_w = max([len(c.name) for r in results.values() if not isinstance(r, Exception) for c in r] or [10])
    for h, r in results.items():
        if isinstance(r, Exception):
            print(f"{h.ljust(width)}  ERROR  {r}")
            continue
        for c in r:
            print(f"{h.ljust(width)}  {c.status.upper():<5}  {c.name.ljust(name_w)}  {c.detail}")
    bad = [f"{h}: {', '.join(names)}" for h, names in failed.items() if names]
    ok = "no check failed on the rigs checked" if unreachable else "all checks passed"
    summary = f"{len(results)} rig(s): " + (f"FAILED {'; '.join(bad)}" if bad else ok)
    if unreachable:
        summary += f"; could not check {', '.join(unreachable)}"
    if any(c.status == SKIP for r in results.values() if not isinstance(r, Exception) for c in r):
        summary += f"; service/API checks {SKIPPED} where noted"
    print(summary)
    return code
