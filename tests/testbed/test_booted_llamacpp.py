"""A llama.cpp recipe on a booted rig beside a vLLM one, behind the fleet gateway (issue 50): rig1 runs
`llamacpp/tess-dual-mtp` from the club-3090 reference (RIGFORGE_RECIPES), rig2 `vllm/dual`, and a gateway host
`gw` fronts both and serves the fleet registry; the smallest fleet that shows the two engines side by side.

rig1's image is llama.cpp's (ghcr.io/ggml-org/llama.cpp:server-cuda-b10236: the booted tier's stand-in pushed to
the upstream stand-in, which plays ghcr.io too). Docker asks mirrors for Docker Hub images only, so the fleet
registry holds ghcr.io's image under `ghcr.io/...` and rig1 pulls that copy by the digest the testbed lock pins, as
status says. Its weights are the
two GGUF files the recipe names of a repo holding more quants, fetched and verified; the recipe's own compose file
and drafter wrapper exec /app/llama-server (the stand-in: 503 "Loading model" on /health while it loads), and the
health gate waits on that /health. Both models answer a chat through the gateway, `rigforge verify` passes its
chat and tool-call checks on both rigs, and a second run changes nothing.

Marked `booted` and `testbed`; skipped with the reason when this machine cannot boot rigs.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time

import pytest
import requests
import yaml
from support import REPO, changed, errored, inventory_with, pyinfra_run
from test_booted import sh, started_at, unit
from test_recipes import REFERENCE

from rigforge.observe.obtain import MANIFEST_TYPES
from rigforge.testbed.booted import REGISTRY_PORT

pytestmark = [pytest.mark.testbed, pytest.mark.booted]
SLUG, UNIT, CONTAINER, PORT, MODEL = (
    "llamacpp/tess-dual-mtp",
    "rigforge-vllm@llamacpp-tess-dual-mtp.service",
    "llama-cpp-tess-4-27b",
    8115,
    "tess-4-27b",
)
IMAGE = "ghcr.io/ggml-org/llama.cpp:server-cuda-b10236"
GGUF_DIR = "/opt/rigforge/models/tess-4-27b-gguf/migtissera-q4km"


@pytest.fixture(scope="module")
def two_engines(testbed_factory):
    from rigforge.testbed import RigSpec

    missing = [tool for tool in ("systemd-nspawn", "nsenter", "ip") if not shutil.which(tool)]
    if missing:
        pytest.skip(f"cannot boot rigs: {', '.join(missing)} not found (apt-get install systemd-container iproute2)")
    saved = os.environ.get("RIGFORGE_RECIPES")
    os.environ["RIGFORGE_RECIPES"] = str(REFERENCE)  # testbed up builds its recipes remote and images from it
    try:
        tb = testbed_factory([RigSpec()] * 2, name="booted-llamacpp", booted=True, gateway=True, registry=True)
        yield tb
        testbed_factory.release(tb)
    finally:
        if saved is None:
            os.environ.pop("RIGFORGE_RECIPES", None)
        else:
            os.environ["RIGFORGE_RECIPES"] = saved


def chat(url: str, model: str) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": "What is the capital of France?"}]}
    return requests.post(f"{url}/v1/chat/completions", json=body, timeout=60).json()


def test_tess_converges_beside_vllm_serves_through_the_gateway_and_a_second_run_changes_nothing(
    two_engines, tmp_path, testbed_report
):
    tb, rig1, rig2 = two_engines, two_engines.rig("rig1"), two_engines.rig("rig2")
    variants = {"rig1": {"rigforge_variant": SLUG}, "rig2": {"rigforge_variant": "vllm/dual"}}
    inv = inventory_with(tb, tmp_path / "inventory.py", variants)
    t0 = time.monotonic()
    results, stderr = pyinfra_run(inv, REPO / "deploy" / "site.py")
    testbed_report.append(
        f"booted: first converge of {SLUG} beside vllm/dual and a gateway {time.monotonic() - t0:.0f}s"
    )
    for host in ("rig1", "rig2", "gw"):
        assert not errored(results, host), stderr[-8000:]
    done = changed(results, "rig1")
    # pyinfra names an operation once for all hosts (the name the first host gave it): rig1's start and gate may
    # carry rig2's unit and endpoint; what rig1 runs is read from the rig below
    assert any(" | Run rigforge-vllm@" in op for op in done), done
    assert any(" | Health gate: " in op for op in done), done
    assert f"{UNIT}: its compose file, .env or unit changed: starting it" in stderr, stderr[-6000:]

    # the lock's llama.cpp image from "ghcr.io" at its digest, copied into the fleet registry under ghcr.io's host
    # and pulled from there (the only name Docker records it by), run by the rig's systemd
    assert unit(rig1, UNIT) == ("enabled", "active")
    digest = tb.upstream_digests[IMAGE]
    copy = f"{tb.registry_address}:{REGISTRY_PORT}/{IMAGE}@{digest}"
    assert sh(rig1, f"docker inspect -f '{{{{.Config.Image}}}} {{{{.State.Status}}}}' {CONTAINER}") == f"{copy} running"
    fleet_ca = str(tb.dir / "registry-ca" / "ca.crt")
    manifest = f"https://{tb.registry_address}:{REGISTRY_PORT}/v2/{IMAGE.split(':')[0]}/manifests/{digest}"
    assert requests.head(manifest, verify=fleet_ca, headers={"Accept": MANIFEST_TYPES}, timeout=30).ok
    # only the recipe's two GGUF files of the repo's three quants, verified against the lock's sha256
    assert sorted(sh(rig1, f"ls {GGUF_DIR}").split()) == ["Tess-4-27B-Q4_K_M.gguf", "mtp-Tess-4-27B-Q4_K_M.gguf"]
    lock = yaml.safe_load(tb.lock.read_text())
    for f in lock["hf"]["tess-4-27b-gguf-migtissera-q4km"]["files"]:
        assert sh(rig1, f"sha256sum {GGUF_DIR}/{f['path']}").split()[0] == f["sha256"]
    # the recipe's own wrapper ran llama-server with the recipe's flags; its own /health answers after loading
    log = sh(rig1, f"docker logs {CONTAINER} 2>&1")
    assert "[spec] drafter ON (SPEC_N=1)" in log and "llama-server stand-in: loading" in log, log
    assert '"draft": "/models/tess-4-27b-gguf/migtissera-q4km/mtp-Tess-4-27B-Q4_K_M.gguf"' in log, log
    assert sh(rig1, f"curl -s http://127.0.0.1:{PORT}/health") == '{"status": "ok"}'

    # both engines through the gateway, by model name
    for model in (MODEL, "qwen3.6-27b"):
        answer = chat(tb.gateway_url, model)
        assert "Paris" in answer["choices"][0]["message"]["content"], answer
    listed = requests.get(f"{tb.gateway_url}/v1/models", timeout=10).json()["data"]
    assert sorted(m["id"] for m in listed) == sorted([MODEL, "qwen3.6-27b"])

    # verify: its chat and tool-call checks on both rigs, and the gateway's
    proc = subprocess.run(
        [sys.executable, "-m", "rigforge.cli", "verify", str(inv)], capture_output=True, text=True, timeout=600
    )
    testbed_report.append(f"booted: verify of a llama.cpp rig beside a vLLM rig: exit {proc.returncode}")
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-3000:]
    for line in ("tool call returned", "chat returns text"):
        assert sum(line in out for out in proc.stdout.splitlines()) >= 2, proc.stdout

    # status names the fleet's copy as where rig1's image comes from (ghcr.io itself is not reachable from here)
    status = subprocess.run(
        [sys.executable, "-m", "rigforge.cli", "status", str(inv)], capture_output=True, text=True, timeout=600
    ).stdout
    assert f"rig1: image {copy}: on the rig; from the fleet registry" in status, status

    before = (started_at(rig1, CONTAINER), started_at(rig2, "vllm-qwen36-27b-dual"))
    t0 = time.monotonic()
    results, stderr = pyinfra_run(inv, REPO / "deploy" / "site.py")
    testbed_report.append(f"booted: second run of {SLUG} beside vllm/dual {time.monotonic() - t0:.0f}s")
    for host in ("rig1", "rig2", "gw"):
        assert not errored(results, host), stderr[-6000:]
    assert changed(results) == [], changed(results)
    assert (started_at(rig1, CONTAINER), started_at(rig2, "vllm-qwen36-27b-dual")) == before
