"""`rigforge verify INVENTORY`: one line per check per rig, read in parallel (docs/operators.md lists each check):
rigforge/observe/drift.py's, the gateways' and monitors', and API probes from the rig as the recipes' verify.sh; nothing
on a rig is changed.

Exit: 0 every check passed (skips allowed), 1 a check failed, 2 inventory unreadable or a rig unreachable (none failed).
"""

import argparse
import json
from collections.abc import Mapping
from dataclasses import asdict

from pyinfra.api import Host

from rigforge.model import fleet, monitor
from rigforge.observe import drift, hosts, inventory
from rigforge.observe.drift import FAIL, PASS, SKIP, SKIPPED, Check, RigContext


def check_host(host: Host, fl: fleet.Fleet) -> tuple[list[Check], dict]:
    """(a rig's drift checks and API probes, a gateway's or monitor's checks; its serving_rest, rig or not, views)."""
    data = fleet.host_data(host.data)
    out = []
    seen = {"rest": data["serving_rest"], "rig": fl.is_rig(host.name)}
    if seen["rig"]:
        ctx, obs = hosts.observe(host, fl)
        seen["rest"] = ctx.data["serving_rest"]  # host data's, else the rig's own record (rig.json)
        seen["place"] = drift.gateway_place(ctx)
        out = drift.checks(obs, ctx) + api_checks(host, ctx)
    if fl.has(host.name, fleet.GATEWAY):
        seen["gateway"] = hosts.observe_gateway(host, data)
        seen["resting"] = resting_in(host)
        out += gateway_checks(host, data, seen["gateway"])
    if fl.has(host.name, fleet.MONITOR):
        seen["monitor"] = view = hosts.observe_monitor(host)
        up = view["targets"] is not None
        said = f": {len(view['targets'])} targets" if up else f"{monitor.TARGETS_PATH}: {drift.answer(view['http'])}"
        out.append(Check("prometheus answers", PASS if up else FAIL, view["url"] + said))
    return out, seen


def monitor_views(results: dict, monitors: tuple[str, ...]) -> dict[str, dict | None]:
    """{monitor host: what it read of the fleet, None when it could not be read}."""
    return {h: None if isinstance(r, Exception) else r[1].get("monitor") for h, r in results.items() if h in monitors}


def with_fleet_checks(results: dict, monitors: tuple[str, ...]) -> dict:
    """{host: (checks, seen) or Exception}: each rig's checks with the gateways' and monitors' (drift.fleet_checks);
    a gateway's "gateway rigs up" knows the rests the rigs' own records give (rig.json)."""
    seen = {h: r[1] for h, r in results.items() if not isinstance(r, Exception)}
    gateways, views = {h: s["gateway"] for h, s in seen.items() if "gateway" in s}, monitor_views(results, monitors)
    recorded = {h for h, s in seen.items() if s.get("rig") and s["rest"]}
    out = {}
    for h, r in results.items():
        if isinstance(r, Exception):
            out[h] = r
            continue
        found, s = r
        if "gateway" in s:
            found = [rigs_up(s["gateway"], s["resting"] | recorded) if c.name == RIGS_UP else c for c in found]
        if s["rig"]:
            found = drift.fleet_checks(found, h, s.get("place"), s["rest"], gateways, views)
        out[h] = (found, s)
    return out


CHAT = {
    "messages": [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
    "max_tokens": 30,
    "temperature": 0.6,
    "chat_template_kwargs": {"enable_thinking": False},
}
WEATHER = {
    "name": "get_weather",
    "description": "Get the current weather for a city",
    "parameters": {
        "type": "object",
        "properties": {"city": {"type": "string"}, "units": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
        "required": ["city"],
    },
}
TOOL = {
    "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
    "tools": [{"type": "function", "function": WEATHER}],
    "tool_choice": "auto",
    "max_tokens": 200,
    "temperature": 0.3,
    "chat_template_kwargs": {"enable_thinking": False},
}


MODELS_ANSWER, CHAT_TEXT, TOOL_CALL = "/v1/models answers", "chat returns text", "tool call returned"
API_CHECKS = (MODELS_ANSWER, CHAT_TEXT, TOOL_CALL)


def api_checks(host: Host, ctx: RigContext) -> list[Check]:
    """/v1/models lists the model, a chat names Paris, a tool call comes back (asked on the rig, as the recipes'
    verify.sh does); all three skipped when services are not managed or the rig rests stopped, failed when the rig
    has no unit; the chat and the tool call fail unasked when /v1/models does not answer."""
    if not ctx.manage:
        return [Check(name, SKIP, SKIPPED) for name in API_CHECKS]
    if ctx.data.get("serving_rest") == "stopped":
        return [Check(name, SKIP, "resting stopped (serving_rest: stopped)") for name in API_CHECKS]
    if not ctx.unit:  # as "unit enabled" fails
        return [Check(name, FAIL, drift.variant_needed(ctx)) for name in API_CHECKS]
    api = inventory.api_models(host, ctx)
    models = api["models"] or []
    model = (ctx.variant.served_model if ctx.variant else None) or (models or [None])[0]
    if api["http_code"] != 200:
        listed = Check(MODELS_ANSWER, FAIL, f"{api['url']}: {drift.answer(api['http_code'])}")
        return [
            listed,
            Check(CHAT_TEXT, FAIL, "the API does not answer"),
            Check(TOOL_CALL, FAIL, "the API does not answer"),
        ]
    chat_url = f"http://{inventory.ctx_host(ctx)}:{ctx.port}/v1/chat/completions"
    return [models_check(api, model), chat_check(host, ctx, chat_url, model), tool_check(host, ctx, chat_url, model)]


def models_check(api: dict, model: str | None) -> Check:
    """/v1/models (as inventory.api_models read it) lists `model`, the name the plan serves it under."""
    models = api["models"] or []
    detail = f"{api['url']} lists {', '.join(models) or 'nothing'}"
    if model in models:
        return Check(MODELS_ANSWER, PASS, detail)
    return Check(MODELS_ANSWER, FAIL, f"{detail}; expected {model}")


def chat_check(host: Host, ctx: RigContext, chat_url: str, model: str | None) -> Check:
    """A chat completion asking for the capital of France comes back naming Paris."""
    failed, message = _ask(host, ctx, chat_url, {"model": model, **CHAT})
    content = (message.get("content") or "").strip()
    if failed:
        return Check(CHAT_TEXT, FAIL, failed)
    if "paris" not in content.lower():
        return Check(CHAT_TEXT, FAIL, f"reply does not name Paris: {content[:80]!r}")
    return Check(CHAT_TEXT, PASS, repr(content[:60]))


def tool_check(host: Host, ctx: RigContext, chat_url: str, model: str | None) -> Check:
    """A request offering get_weather comes back with a get_weather tool call; a call left in the text as
    <tool_call> means the server's tool-call parser is not active."""
    failed, message = _ask(host, ctx, chat_url, {"model": model, **TOOL})
    called = [(call.get("function") or {}).get("name") for call in message.get("tool_calls") or []]
    if not failed and "get_weather" in called:
        return Check(TOOL_CALL, PASS, f"tool_calls: {', '.join(name for name in called if name)}")
    if failed:
        return Check(TOOL_CALL, FAIL, failed)
    if "<tool_call>" not in (message.get("content") or ""):
        return Check(TOOL_CALL, FAIL, f"no get_weather tool call in the reply: {str(message)[:100]}")
    return Check(TOOL_CALL, FAIL, "the tool call came back as text (tool-call parser not active)")


def _ask(host: Host, ctx: RigContext, url: str, body: dict) -> tuple[str | None, dict]:
    """(why the completion failed, None when it answered HTTP 200; the reply's message, {} when it has none)."""
    code, text = inventory.http_on_rig(host, url, 120, body, ctx.settings.api_key)
    if code != 200:
        return f"HTTP {code or 'no answer'}: {text[:120]}", {}
    try:
        return None, json.loads(text)["choices"][0]["message"] or {}
    except (ValueError, KeyError, IndexError, TypeError):
        return None, {}


# ---------------------------------------------------------------- the command


def add_arguments(p: argparse.ArgumentParser) -> None:
    """verify's arguments: INVENTORY and --json."""
    inventory.add_arguments(p, shown="one line per check")


def run(args: argparse.Namespace) -> int:
    if (read := inventory.read_fleet(args, "verify", check_host)) is None:
        return 2
    results, fl = read
    views = monitor_views(results, fl.monitors)
    checked = {h: r[0] for h, r in with_fleet_checks(results, fl.monitors).items() if not isinstance(r, Exception)}
    failed = {h: [c.name for c in r if c.status == FAIL] for h, r in checked.items()}
    unreachable = {h: str(r) for h, r in results.items() if h not in checked}
    code = 1 if any(failed.values()) else 2 if unreachable else 0
    if args.json:
        hosts = {h: {"error": unreachable.get(h), "checks": [asdict(c) for c in checked.get(h, [])]} for h in results}
        monitor = {h: v and v["url"] for h, v in views.items()}  # where the monitor is (None: not read)
        print(json.dumps({"exit_code": code, "hosts": hosts, "monitor": monitor}, indent=2))
        return code
    width = max(len(h) for h in results)
    name_w = max([len(c.name) for r in checked.values() for c in r] or [10])
    for h in results:
        if h in unreachable:
            print(f"{h.ljust(width)}  ERROR  {unreachable[h]}")
        for c in checked.get(h, []):
            print(f"{h.ljust(width)}  {c.status.upper():<5}  {c.name.ljust(name_w)}  {c.detail}")
    print(drift.monitor_line(views))
    bad = [f"{h}: {', '.join(names)}" for h, names in failed.items() if names]
    ok = "no check failed on the rigs checked" if unreachable else "all checks passed"
    summary = f"{hosts_counted(results, fl)}: " + (f"FAILED {'; '.join(bad)}" if bad else ok)
    if unreachable:
        summary += f"; could not check {', '.join(unreachable)}"
    summary += "".join(f"; skipped on {', '.join(hosts)}: {why}" for why, hosts in skip_reasons(checked).items())
    print(summary)
    return code


def hosts_counted(results: Mapping, fl: fleet.Fleet) -> str:
    """How many of the hosts are rigs, gateways, registries and monitors: '3 rig(s), 1 gateway and 1 monitor'."""
    rigs = sum(fl.is_rig(h) for h in results)
    roles = [(role, sum(fl.has(h, role) for h in results)) for role in (fleet.GATEWAY, fleet.REGISTRY, fleet.MONITOR)]
    said = [f"{rigs} rig(s)", *(f"{n} {role}{'s' * (n > 1)}" for role, n in roles if n)]
    return ", ".join(said[:-1]) + " and " + said[-1] if len(said) > 1 else said[0]


def skip_reasons(checked: Mapping[str, list[Check]]) -> dict[str, list[str]]:
    """{why checks were skipped: the hosts}, each skip's own detail ('services not managed on this host')."""
    out: dict[str, list[str]] = {}
    for h, found in checked.items():
        for c in found:
            if c.status != SKIP:
                continue
            why = c.detail.removeprefix("skipped (").removesuffix(")") if c.detail == SKIPPED else c.detail
            if h not in out.setdefault(why, []):
                out[why].append(h)
    return out


# ---------------------------------------------------------------- the fleet gateway, asked live

GATEWAY_FINE = ("UP", "DRAIN", "MAINT")  # drained or in maintenance: out on purpose (a model it no longer serves)


RIGS_UP = "gateway rigs up"


def resting_in(host: Host) -> set[str]:
    """The hosts of `host`'s inventory whose host data sets serving_rest (out of the gateway on purpose)."""
    return {h.name for h in getattr(host, "inventory", ()) if h.data.get("serving_rest")}


def rigs_up(view: dict, resting: set[str]) -> Check:
    """Every rig in the gateway serving, but those `resting` on purpose."""
    bad = {name: state for name, state in view["rigs"].items() if state not in GATEWAY_FINE and name not in resting}
    states = "; ".join(f"{n} {s}" for n, s in sorted((bad or view["rigs"]).items())) or "no rig"
    return Check(RIGS_UP, FAIL if bad or not view["rigs"] else PASS, states)


GATEWAY_CHAT = {k: v for k, v in CHAT.items() if k != "temperature"}  # at the servers' own temperature


def gateway_checks(host: Host, data: Mapping, view: dict) -> list[Check]:
    """A gateway's checks: every rig in it serving, /v1/models answers through it, a chat completion per model."""
    out = [rigs_up(view, resting_in(host))]
    if view["models_http"] != 200 or not view["models"]:
        why = f"{drift.answer(view['models_http'])}, {view['models']}"
        return out + [Check("gateway /v1/models answers", FAIL, f"{view['url']}/v1/models: {why}")]
    out.append(Check("gateway /v1/models answers", PASS, f"{view['url']} lists {', '.join(view['models'])}"))
    for model in view["models"]:
        code, text = inventory.http_on_rig(
            host,
            f"{view['url']}/v1/chat/completions",
            120,
            {"model": model, **GATEWAY_CHAT},
            data.get("gateway_api_key"),
        )
        ok = code == 200 and "paris" in text.lower()
        out.append(Check(f"gateway chat: {model}", PASS if ok else FAIL, f"HTTP {code or 'no answer'}: {text[:80]}"))
    return out
