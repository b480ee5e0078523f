"""A recipe bump rolled out safely (`rigforge rollout`), on a booted fleet of 3 rigs and the gateway serving
vllm/dual from the testbed's recipe commit A, under a steady load through the gateway (4 openai clients, no retries):
- the preview (--dry) names each rig's image, flags and restarts, and the rollout then does exactly that;
- a slow bump (B-slow, half the speed) fails the canary's bench gate: the loss is printed, the canary goes back to
  A, exit 1, the lock and the held rig untouched;
- a good bump (B) moves every rig, passes verify, promotes the lock; a plain deploy then changes nothing;
- `--rollback` takes the fleet back to A;
and no request through the gateway fails in any of them.

Marked `booted` and `testbed`; skipped with the reason when this machine cannot boot rigs.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time

import pytest
from support import REPO, changed, errored, inventory_with, pyinfra_run
from test_booted import sh
from test_recipes import REFERENCE

pytestmark = [pytest.mark.testbed, pytest.mark.booted]
CONTAINER = "vllm-qwen36-27b-dual"


@pytest.fixture(scope="module")
def bump_fleet(testbed_factory, tmp_path_factory):
    from rigforge.testbed import RigSpec

    missing = [tool for tool in ("systemd-nspawn", "nsenter", "ip") if not shutil.which(tool)]
    if missing:
        pytest.skip(f"cannot boot rigs: {', '.join(missing)} not found (apt-get install systemd-container iproute2)")
    saved = os.environ.get("RIGFORGE_RECIPES")
    os.environ["RIGFORGE_RECIPES"] = str(REFERENCE)  # testbed up builds its recipes remote (A, B, B-slow)
    try:
        tb = testbed_factory([RigSpec()] * 3, name="bump", booted=True, gateway=True)
    finally:
        if saved is None:
            os.environ.pop("RIGFORGE_RECIPES", None)
        else:
            os.environ["RIGFORGE_RECIPES"] = saved
    tmp = tmp_path_factory.mktemp("bump")
    ENV["XDG_CACHE_HOME"] = str(tmp / "cache")  # the controller's recipe checkouts, per lock commit
    cached = rigforge(
        "lock", "--lock", str(tb.lock), env={**os.environ, **ENV, "RIGFORGE_TOOLKIT_REPO": "http://127.0.0.1:9/"}
    )
    assert cached.returncode == 0 and "git.recipes: cached" in cached.stdout, cached.stdout + cached.stderr
    inv = inventory_with(tb, tmp / "inventory.py", {r.name: {"rigforge_variant": "vllm/dual"} for r in tb.rigs})
    results, stderr = pyinfra_run(inv, REPO / "deploy" / "site.py", env=ENV)
    assert results["failed_hosts"] == [] and results["totals"]["error"] == 0, stderr[-6000:]
    env = {
        **os.environ,
        **ENV,
        "RIGFORGE_REGISTRY": tb.upstream_url,
        "REQUESTS_CA_BUNDLE": str(tb.upstream_ca),
        "HF_ENDPOINT": tb.hf_endpoint,
    }
    for tag in ("B", "B-slow"):
        res = rigforge(
            "lock", "--lock", str(tb.lock), "--recipes", tag, "--out", str(tmp / f"lock-{tag}.yaml"), env=env
        )
        assert res.returncode == 0, res.stderr
    yield tb, inv, tmp
    testbed_factory.release(tb)


ENV = {"RIGFORGE_RECIPES": ""}  # the controller reads the recipe repo at each lock's commit, from its cache


def rigforge(*args: str, env: dict | None = None, timeout: float = 1200) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "rigforge.cli", *args],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env or {**os.environ, **ENV},
    )


class Clients:
    """`n` openai clients (max_retries=0: a failed request is never retried) asking the gateway for chat
    completions back to back, every other one streamed, each its own prompt (its own conversation, so that under
    the gateway's prefix affinity the clients spread over the rigs); each request's (start, ok, why it failed)."""

    def __init__(self, url: str, n: int = 4):
        from openai import OpenAI

        self.client = OpenAI(base_url=f"{url}/v1", api_key="unused", max_retries=0, timeout=120)
        self.results: list[tuple[float, bool, str]] = []
        self.stop = threading.Event()
        self.threads = [threading.Thread(target=self._run, args=(i % 2 == 0, i), daemon=True) for i in range(n)]

    def _run(self, stream: bool, client: int) -> None:
        messages = [{"role": "user", "content": f"Count. (client {client})"}]
        while not self.stop.is_set():
            t0 = time.monotonic()
            try:
                answer = self.client.chat.completions.create(
                    model="qwen3.6-27b", messages=messages, max_tokens=20, stream=stream
                )
                text = (
                    "".join((c.choices[0].delta.content or "") for c in answer if c.choices)
                    if stream
                    else (answer.choices[0].message.content)
                )
                self.results.append((t0, bool(text), "" if text else "empty"))
            except Exception as exc:  # any failure is counted, by its kind
                self.results.append((t0, False, type(exc).__name__))

    def __enter__(self):
        for t in self.threads:
            t.start()
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join()

    def seen(self, start: float) -> dict:
        mine = [r for r in self.results if r[0] >= start]
        failed = [r for r in mine if not r[1]]
        return {"sent": len(mine), "failed": len(failed), "why": sorted({r[2] for r in failed})}


def image_of(rig) -> str:
    return sh(rig, f"docker inspect -f '{{{{.Config.Image}}}}' {CONTAINER}")


def under_load(tb, *args: str, report=None) -> tuple[subprocess.CompletedProcess, dict]:
    """`rigforge rollout ARGS` while 4 openai clients send chat completions through the gateway; (the run, the
    load: requests sent and failed)."""
    start = time.monotonic()
    with Clients(tb.gateway_url) as clients:
        time.sleep(3)
        t0 = time.monotonic()
        res = rigforge("rollout", *args)
        t1 = time.monotonic()
        time.sleep(2)
    seen = clients.seen(start)
    if report is not None:
        report.append(f"rollout {' '.join(args[1:])}: rc {res.returncode} in {t1 - t0:.0f}s; load {seen}")
    return res, seen


def test_a_slow_bump_fails_the_canary_and_leaves_the_fleet_and_the_lock_at_a(bump_fleet, testbed_report):
    tb, inv, tmp = bump_fleet
    rig1, rig2, rig3 = tb.rigs
    dual = {"rigforge_variant": "vllm/dual"}
    held = inventory_with(tb, tmp / "held.py", {"rig1": dual, "rig2": {**dual, "rollout_hold": True}, "rig3": dual})
    at_a, lock_a = image_of(rig1), tb.lock.read_text()
    res, load = under_load(tb, str(held), "--to", str(tmp / "lock-B-slow.yaml"), report=testbed_report)
    assert res.returncode == 1, res.stdout + res.stderr
    loss = re.search(r"the canary rig1 did not hold: measured loss (\d+)% > allowed 30%", res.stderr)
    assert loss and int(loss.group(1)) > 30, res.stderr
    testbed_report.append(f"rollout B-slow: {res.stderr.strip().splitlines()[-1]}")
    assert "rig2: held (host data rollout_hold)" in res.stdout, res.stdout
    assert image_of(rig1) == at_a == image_of(rig2) == image_of(rig3) and tb.lock.read_text() == lock_a
    assert load["failed"] == 0, load
    results, stderr = pyinfra_run(inv, REPO / "deploy" / "site.py", env=ENV)  # a plain deploy: nothing to put back
    assert results["failed_hosts"] == [] and changed(results) == [], (changed(results), stderr[-3000:])


def test_a_good_bump_does_what_the_preview_said_passes_verify_and_promotes_the_lock(bump_fleet, testbed_report):
    tb, inv, tmp = bump_fleet
    candidate = tmp / "lock-B.yaml"
    dry = rigforge("rollout", str(inv), "--to", str(candidate), "--dry")
    assert dry.returncode == 0, dry.stderr
    preview = dry.stdout
    res, load = under_load(tb, str(inv), "--to", str(candidate), report=testbed_report)
    assert res.returncode == 0, res.stdout + res.stderr
    assert load["failed"] == 0, load
    for rig in tb.rigs:
        running = image_of(rig)
        assert f"{rig.name}:\n  image: " in preview and f"-> {running}\n" in preview, (running, preview)
        args = json.loads(sh(rig, f"docker inspect -f '{{{{json .Args}}}}' {CONTAINER}"))  # what the server runs
        assert args[args.index("--max-num-batched-tokens") + 1] == "16384", args
        assert "flag --max-num-batched-tokens: 8192 -> 16384" in preview
        assert "restarts: rigforge-vllm@vllm-dual.service" in preview
    assert tb.lock.read_text() == candidate.read_text()  # promoted
    checks = json.loads(rigforge("verify", str(inv), "--json").stdout)
    failed = {h: [c for c in v["checks"] if c["status"] == "fail"] for h, v in checks["hosts"].items()}
    assert not any(failed.values()), failed
    results, stderr = pyinfra_run(inv, REPO / "deploy" / "site.py", env=ENV)
    assert results["failed_hosts"] == [] and changed(results) == [], (changed(results), stderr[-3000:])


def test_rollback_brings_the_fleet_back_to_a(bump_fleet, testbed_report):
    tb, inv, tmp = bump_fleet
    previous = tb.lock.with_name(tb.lock.name + ".previous")
    a = previous.read_text()
    res, load = under_load(tb, str(inv), "--rollback", report=testbed_report)
    assert res.returncode == 0, res.stdout + res.stderr
    assert load["failed"] == 0, load
    assert tb.lock.read_text() == a
    for rig in tb.rigs:
        assert "v0.27.1@sha256:" in image_of(rig), rig.name
    results, stderr = pyinfra_run(inv, REPO / "deploy" / "site.py", env=ENV)
    assert not errored(results, "rig1") and changed(results) == [], (changed(results), stderr[-3000:])
