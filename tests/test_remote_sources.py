"""Preflight's pass over remote sources (roles/preflight.py): what an answer means, and the one curl per URL
the rig runs (rigforge/observe/facts/system.py UrlAnswers), run here against a local HTTP server and closed ports."""

from __future__ import annotations

import http.server
import subprocess
import threading

import pytest

from rigforge.observe.facts.system import UrlAnswers
from roles.preflight import Source, verdict

DOCKER = Source(
    "Docker's repository",
    "https://download.docker.com/linux/debian/dists/trixie/InRelease",
    "it has no 'trixie' suite: check docker_repo_url, or use docker_source: distro",
)


@pytest.mark.parametrize("code", [200, 301, 302])
def test_an_answer_is_neither_refusal_nor_warning(code):
    assert verdict(DOCKER, code, 0) == (None, None)


@pytest.mark.parametrize("code", [404, 410])
def test_a_definite_no_refuses_saying_what_to_fix_and_that_nothing_changed(code):
    refusal, warning = verdict(DOCKER, code, 22)
    assert warning is None
    assert refusal == (
        f"Docker's repository says HTTP {code} for {DOCKER.url}: it has no 'trixie' suite: check "
        "docker_repo_url, or use docker_source: distro (nothing was changed)."
    )


@pytest.mark.parametrize(
    ("code", "curl_exit", "said"),
    [
        (0, 6, "no such host name"),
        (0, 7, "connection refused"),
        (0, 28, "timed out"),
        (503, 0, "HTTP 503"),
        (401, 0, "HTTP 401"),
        (0, 56, "curl exit 56"),
    ],
)
def test_a_source_that_cannot_be_asked_is_a_warning(code, curl_exit, said):
    refusal, warning = verdict(DOCKER, code, curl_exit)
    assert refusal is None and warning.startswith(f"Docker's repository could not be asked ({said}: {DOCKER.url})")


def test_the_rigs_curl_tells_an_answer_a_404_a_closed_port_and_no_name_apart(tmp_path):
    (tmp_path / "InRelease").write_text("signed\n")
    handler = lambda *a: http.server.SimpleHTTPRequestHandler(*a, directory=str(tmp_path))  # noqa: E731
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    base = f"http://127.0.0.1:{server.server_address[1]}"
    urls = (f"{base}/InRelease", f"{base}/dists/nope/InRelease", "http://127.0.0.1:9/x", "http://no-such.invalid/")
    try:
        out = subprocess.run(["sh", "-c", UrlAnswers().command(urls)], capture_output=True, text=True, timeout=60)
    finally:
        server.shutdown()
    answers = UrlAnswers().process(out.stdout.splitlines())
    assert answers[urls[0]] == (200, 0) and answers[urls[1]][0] == 404
    assert answers[urls[2]] == (0, 7) and answers[urls[3]] == (0, 6)


def test_a_source_is_needed_for_exactly_the_packages_the_install_would_fetch():
    """One rule (verdict.missing_packages) for preflight's question and the install: a package not installed, or a
    pinned one at another version; the toolkit's four packages when a version is pinned, else the toolkit alone."""
    from rigforge.model.packages import TOOLKIT_PACKAGES, docker, toolkit
    from rigforge.observe.verdict import missing_packages as missing

    ce = docker("docker", "debian", "13")
    installed = {name: ["5:28.5.1-1~debian.13~trixie"] for name in ce.names}
    assert missing(ce, installed) == []
    assert missing(docker("docker", "debian", "13", {"docker-ce": "5:29.0.0-1~debian.13~trixie"}), installed) == [
        "docker-ce=5:29.0.0-1~debian.13~trixie"
    ]
    assert missing(ce, {**installed, "containerd.io": []}) == ["containerd.io"]
    have = {name: ["1.19.0-1"] for name in TOOLKIT_PACKAGES} | {"libnvidia-container1": ["1.18.0-1"]}
    assert missing(toolkit("1.19.0-1"), have) == ["libnvidia-container1=1.19.0-1"]
    assert missing(toolkit(None), have) == [] and missing(toolkit(None), None) == ["nvidia-container-toolkit"]
