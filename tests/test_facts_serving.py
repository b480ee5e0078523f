"""Facts of what runs (rigforge/observe/facts/serving.py): parsed from what systemctl, curl and docker print."""

from __future__ import annotations

from rigforge.observe.facts.serving import (
    ApiAnswers,
    ComposeImages,
    ServiceState,
    parse_service_state,
    runs_digest,
    serving,
)

SHOW_FAILED = ["ActiveState=failed", "SubState=failed", "Result=exit-code", "NRestarts=5", "UnitFileState=enabled"]


def test_systemctl_show_is_read_into_what_it_means_for_serving():
    state = parse_service_state(SHOW_FAILED)
    assert state == {"active": "failed", "sub": "failed", "result": "exit-code", "restarts": 5, "enabled": "enabled"}
    assert serving(state) == "failed"
    assert serving(parse_service_state(["ActiveState=activating", "SubState=auto-restart"])) == "crashing"
    assert serving(parse_service_state(["ActiveState=activating", "SubState=start"])) == "starting"
    assert serving(parse_service_state(["ActiveState=active", "SubState=running"])) == "running"
    assert serving(parse_service_state(["ActiveState=inactive", "SubState=dead"])) == "stopped"
    assert serving(ServiceState().process([])) == "unknown"  # no systemd (a chroot)


def test_the_api_fact_reads_only_the_http_code_and_never_puts_the_key_on_a_command_line():
    assert ApiAnswers().process(["200"]) == 200 and ApiAnswers().process(["000"]) == 0
    command = ApiAnswers().command("http://127.0.0.1:8010", "/opt/rigforge/serve/dual/.env")
    assert "-H @-" in command and "RIGFORGE_API_KEY" in command and "Bearer $k" not in command


def test_compose_images_and_the_locked_digest():
    digest = "sha256:" + "a" * 64
    images = ComposeImages().process([f'["vllm/vllm-openai@{digest}"]', "", "[]"])
    assert images == [[f"vllm/vllm-openai@{digest}"], []]
    assert runs_digest(images, digest) is True
    assert runs_digest([["vllm/vllm-openai@sha256:" + "b" * 64]], digest) is False
    assert runs_digest([], digest) is None and runs_digest(images, None) is None
