"""Tier 1: the facts that replaced ad-hoc `Command` reads (image present, enabled instances, the manifest, a file's
hash without its secret line, leftover uploads). Parsers on canned output; shell commands run for real here."""

from __future__ import annotations

import json
import subprocess

from rigforge.observe.facts.docker import DockerImagePresent
from rigforge.observe.facts.files import JsonFile
from rigforge.observe.facts.system import EnabledInstances, LeftoverUploads

TEMPLATE = "svc@.service"


def run(command) -> list[str]:
    text = command if isinstance(command, str) else command.get_raw_value()
    out = subprocess.run(["sh", "-c", text], capture_output=True, text=True, check=True).stdout
    return out.splitlines()


def read(fact, **kwargs):
    """What pyinfra would return: default() for no output, else process()."""
    lines = run(fact.command(**kwargs))
    return fact.process(lines) if lines else fact.default()


def test_docker_image_present_parses_yes_and_no():
    fact = DockerImagePresent()
    assert fact.process(["yes"]) is True
    assert fact.process(["no"]) is False
    assert fact.default() is False
    assert fact.command(image="repo/x:tag it").get_raw_value() == (
        "docker image inspect 'repo/x:tag it' >/dev/null 2>&1 && echo yes || echo no"
    )


def test_docker_image_present_is_false_without_an_engine():
    assert read(DockerImagePresent(), image="rigforge-test/none:0") is False  # no engine, or no such image


def test_enabled_instances_parse_sorted_and_deduplicated():
    fact = EnabledInstances()
    assert fact.process(["svc@b.service", "", "svc@a.service ", "svc@b.service"]) == ["svc@a.service", "svc@b.service"]
    assert fact.default() == []


def test_enabled_instances_lists_only_instances_of_the_template(tmp_path):
    wants = tmp_path / "multi-user.target.wants"
    wants.mkdir()
    for name in ("svc@b.service", "svc@a.service", "svc@.service", "other@a.service", "svcXa.service", "svc@a.timer"):
        (wants / name).symlink_to("/nonexistent")  # a dangling link is still enabled
    assert read(EnabledInstances(), unit_dir=str(tmp_path), template=TEMPLATE) == ["svc@a.service", "svc@b.service"]
    assert read(EnabledInstances(), unit_dir=str(tmp_path / "none"), template=TEMPLATE) == []


def test_json_file_parses_an_object_and_nothing_else():
    fact = JsonFile()
    assert fact.process(['{"a": 1,', ' "b": [2]}']) == {"a": 1, "b": [2]}
    assert fact.process(["[1, 2]"]) is None
    assert fact.process(["{not json"]) is None
    assert fact.default() is None


def test_json_file_reads_the_file(tmp_path):
    path = tmp_path / "rig json"
    assert read(JsonFile(), path=str(path)) is None
    path.write_text(json.dumps({"variant": "dual"}, indent=2))
    assert read(JsonFile(), path=str(path)) == {"variant": "dual"}


def test_leftover_uploads_lists_the_dir(tmp_path):
    fact = LeftoverUploads()
    assert fact.process(["/u/a ", "", "/u/b"]) == ["/u/a", "/u/b"]
    assert read(fact, path=str(tmp_path / "none")) == []
    (tmp_path / "0a1b").write_text("secret")
    assert read(fact, path=str(tmp_path)) == [str(tmp_path / "0a1b")]
