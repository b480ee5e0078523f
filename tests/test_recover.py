"""Tier 2: repairs of what an interrupted run leaves behind, against faked facts (pyinfra's @fake connector).

The kill tests on real testbed rigs are in tests/test_converge_recover.py.
"""

from __future__ import annotations

import hashlib
import re

from test_sources_weights_ops import commands

from rigforge.observe.facts.apt import DpkgInterrupted
from roles.operations import recover
from roles.operations.staged import staged_files

AUDIT = """The following packages are only half configured, probably due to problems
configuring them the first time.  The configuration should be retried using
dpkg --configure <package> or the configure menu option in dselect:
 docker.io            Linux container runtime
 nvidia-driver-580-open stub driver
"""
FILES = {"docker-compose.yml": ("services: {}\n", "644"), ".env": ("HF_TOKEN=\n", "600")}
STAGED = dict(dest="/opt/rigforge/serve/dual", files=FILES, validate="docker compose config -q")


def stat(path: str, mode: str = "-rw-r--r--", kind: str = "") -> dict:
    line = f"user=root group=root mode={kind or mode} atime=0 mtime=0 ctime=0 size=1 '{path}'"
    return {re.compile(rf"stat -c .* {re.escape(path)}( |$)"): line}


def sha(path: str, text: str) -> dict:
    return {re.compile(rf"sha256sum {re.escape(path)}\b"): f"{hashlib.sha256(text.encode()).hexdigest()}  {path}"}


def test_dpkg_state_fact():
    fact = DpkgInterrupted()
    assert fact.process([]) is None
    lines = [" " + line if line.startswith(" ") else line for line in AUDIT.splitlines()]
    audit = [f"audit: {line.strip()}" for line in lines if line.startswith(" ")]
    assert fact.process(audit) == "not fully installed: docker.io, nvidia-driver-580-open"
    assert fact.process(["journal: dpkg was interrupted"]) == "dpkg was interrupted"
    assert "audit: " not in fact.command or "dpkg --audit" in fact.command


def test_dpkg_repair_only_when_needed():
    assert commands({}, recover.packages) == []
    cmds = commands({"/var/lib/dpkg/updates": "journal: dpkg was interrupted"}, recover.packages)
    assert cmds == [
        "DEBIAN_FRONTEND=noninteractive NEEDRESTART_MODE=a dpkg --configure -a --force-confdef --force-confold",
        "DEBIAN_FRONTEND=noninteractive NEEDRESTART_MODE=a apt-get -y -f install "
        "-o Dpkg::Options::=--force-confdef -o Dpkg::Options::=--force-confold",
    ]


def test_leftover_uploads_are_removed():
    assert commands({}, recover.uploads_cleared) == []
    left = {"-mindepth 1 -maxdepth 1": ["/tmp/.rigforge-upload-user/0a1b2c3d4e5f"]}
    assert commands(left, recover.uploads_cleared) == ["rm -rf /tmp/.rigforge-upload-user/0a1b2c3d4e5f"]


def current(swapping=False, staging=False, compose_new=False) -> dict:
    """Facts of a serve dir: both files installed (old content unless compose_new), maybe a leftover staging."""
    dest = STAGED["dest"]
    facts = {**stat(f"{dest}/docker-compose.yml"), **stat(f"{dest}/.env", "-rw-------")}
    facts.update(sha(f"{dest}/docker-compose.yml", FILES["docker-compose.yml"][0] if compose_new else "old"))
    facts.update(sha(f"{dest}/.env", "old"))
    if staging:
        facts.update(stat(f"{dest}/.staging", kind="drwx------"))
    if swapping:
        facts.update(stat(f"{dest}/.staging/.swapping"))
    return facts


def test_staged_files_swap_keeps_prev_then_cleans_up():
    cmds = commands(current(), staged_files, **STAGED)
    assert "touch /opt/rigforge/serve/dual/.staging/.swapping" in cmds
    assert "cp -p /opt/rigforge/serve/dual/docker-compose.yml /opt/rigforge/serve/dual/docker-compose.yml.prev" in cmds
    assert cmds[-1] == "rm -rf /opt/rigforge/serve/dual/.staging"


def test_half_moved_compose_is_finished_without_overwriting_prev():
    """Killed between the two moves: the compose is new, the .env old, the .prev copies hold the old pair."""
    cmds = commands(current(swapping=True, staging=True, compose_new=True), staged_files, **STAGED)
    assert not [c for c in cmds if c.startswith("cp -p")], cmds
    assert "mv -f /opt/rigforge/serve/dual/.staging/.env /opt/rigforge/serve/dual/.env" in cmds


def test_leftover_staging_dir_of_an_up_to_date_unit_is_removed():
    dest = STAGED["dest"]
    facts = {**stat(f"{dest}/docker-compose.yml"), **stat(f"{dest}/.env", "-rw-------")}
    for name, (text, _) in FILES.items():
        facts.update(sha(f"{dest}/{name}", text))
    assert commands(facts, staged_files, **STAGED) == []
    facts.update(stat(f"{dest}/.staging", kind="drwx------"))
    assert commands(facts, staged_files, **STAGED) == ["rm -rf /opt/rigforge/serve/dual/.staging"]
