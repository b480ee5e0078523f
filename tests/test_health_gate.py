"""The serving role's health gate script, run for real (bash + curl) against a local OpenAI-compatible server.

No systemd runs here, so `systemctl` and `journalctl` are small recording stand-ins on PATH: the test checks
what the gate asks systemd to do (nothing on success; disable the new instance and re-enable the previous
one on failure), and that it fails with the reason.
"""

import subprocess
import threading

import pytest

from rigforge.openai_stub import Schedule, make_server
from roles.operations.serving import health_gate_script


@pytest.fixture
def server():
    srv = make_server(Schedule(ttft_ms=1, dt_ms=1, tokens=3))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_address[1]}"
    srv.shutdown()


@pytest.fixture
def fake_systemd(tmp_path):
    calls = tmp_path / "calls"
    for tool in ("systemctl", "journalctl"):
        exe = tmp_path / tool
        exe.write_text(f'#!/bin/sh\necho "{tool} $*" >> {calls}\n[ "$1" = is-failed ] && exit 1\nexit 0\n')
        exe.chmod(0o755)
    return tmp_path, calls


def run_gate(fake_systemd, url, timeout=2, rollback="rigforge-vllm@dual.service"):
    path, calls = fake_systemd
    script = health_gate_script(url, "qwen3.6-27b-autoround", timeout, "rigforge-vllm@dual-turbo.service", rollback)
    r = subprocess.run(
        ["bash", "-c", script], capture_output=True, text=True, env={"PATH": f"{path}:/usr/bin:/bin"}, timeout=60
    )
    return r, (calls.read_text().splitlines() if calls.exists() else [])


def test_gate_passes_when_models_and_chat_answer(server, fake_systemd):
    r, calls = run_gate(fake_systemd, server)
    assert r.returncode == 0, r.stderr
    assert "serves qwen3.6-27b-autoround" in r.stdout
    assert not [c for c in calls if "disable" in c or "enable" in c]


def test_gate_rolls_back_when_nothing_answers(fake_systemd):
    r, calls = run_gate(fake_systemd, "http://127.0.0.1:9", timeout=1)  # port 9 (discard): refused
    assert r.returncode == 1
    assert "no answer from http://127.0.0.1:9/v1/models within 1 s" in r.stderr
    assert "systemctl disable --now rigforge-vllm@dual-turbo.service" in calls
    assert "systemctl enable --now rigforge-vllm@dual.service" in calls
    assert any(c.startswith("journalctl -u rigforge-vllm@dual-turbo.service") for c in calls)


def test_gate_without_previous_variant_only_stops_the_new_one(fake_systemd):
    r, calls = run_gate(fake_systemd, "http://127.0.0.1:9", timeout=1, rollback=None)
    assert r.returncode == 1
    assert [c for c in calls if "able --now" in c] == ["systemctl disable --now rigforge-vllm@dual-turbo.service"]
