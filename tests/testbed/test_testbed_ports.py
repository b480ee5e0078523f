"""Testbeds on one machine never share a port: ports are claimed under a machine-wide lock until the listener is
up, and a listener counts only when it is the rig's own sshd (or the service's own process)."""

from __future__ import annotations

import socket
import subprocess
import sys
import textwrap
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from rigforge.testbed import RigSpec, TestbedError, core, down, rootfs, up
from rigforge.testbed._util import owns_port, pid_alive, ports_claimed

pytestmark = pytest.mark.testbed
REPO = Path(__file__).resolve().parents[2]


def _listen(port: int) -> socket.socket:
    s = socket.socket()
    s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # a closed connection's TIME_WAIT does not hold it
    s.bind(("127.0.0.1", port))
    s.listen()
    return s


def _ours(tb) -> dict[str, int]:
    """{what: port} of a testbed's rigs and services, after checking each is held by its own process."""
    ports = {}
    for rig in tb.rigs:
        pid = pid_alive(rig.dir / "sshd.pid")
        assert pid and owns_port(pid, rig.ssh_port), f"{tb.dir} {rig.name}: port {rig.ssh_port} is not its sshd's"
        ports[f"{tb.dir.name}/{rig.name}"] = rig.ssh_port
    for name in ("apt", "hf", "git"):
        pid = pid_alive(tb.shared / "run" / f"{name}.pid")
        port = tb.services[f"{name}_port"]
        assert pid and owns_port(pid, port), f"{tb.dir}: the {name} service does not hold its port {port}"
        ports[f"{tb.dir.name}/{name}"] = port
    return ports


def _ssh_ok(tb, rig: str) -> None:
    res = subprocess.run(
        ["ssh", "-F", str(tb.ssh_config), "-o", "BatchMode=yes", rig, "cat /etc/rigforge-sim/gpus.json"],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert res.returncode == 0, res.stderr  # the host key in the testbed's known_hosts: the rig's own sshd


@pytest.fixture
def own_dirs(testbed_dir, request):
    """Testbed dirs with their own services (not the shared ones), reusing the cached rootfs tarball."""
    made: list[Path] = []

    def make(name: str) -> Path:
        d = testbed_dir / "fleets" / f"ports-{name}-{request.node.name[:20]}"
        made.append(d)
        (d / "cache").mkdir(parents=True, exist_ok=True, mode=0o755)
        tarball = rootfs.build_tarball(testbed_dir)
        link = d / "cache" / tarball.name
        if not link.exists():
            link.symlink_to(tarball)
        return d

    yield make
    for d in made:
        down(d, purge=True)
        subprocess.run(["rm", "-rf", "--one-file-system", str(d)], check=False)


def test_two_testbeds_brought_up_at_once_get_distinct_ports(own_dirs):
    a, b = own_dirs("a"), own_dirs("b")
    script = textwrap.dedent(
        """
        import sys
        from pathlib import Path
        from rigforge.testbed import RigSpec, up
        up(Path(sys.argv[1]), [RigSpec(), RigSpec()])
        """
    )

    def bring_up(d: Path) -> subprocess.CompletedProcess:  # separate processes, like two users' `testbed up`
        return subprocess.run([sys.executable, "-c", script, str(d)], capture_output=True, text=True, cwd=REPO)

    with ThreadPoolExecutor(2) as pool:
        results = list(pool.map(bring_up, [a, b]))
    for res in results:
        assert res.returncode == 0, res.stderr
    tb_a, tb_b = core.load(a), core.load(b)
    ports = {**_ours(tb_a), **_ours(tb_b)}
    assert len(set(ports.values())) == len(ports) == 10, ports
    for tb in (tb_a, tb_b):
        for rig in tb.rigs:
            _ssh_ok(tb, rig.name)


def test_a_rig_whose_port_was_taken_moves_to_a_free_one(testbed_factory):
    tb = testbed_factory(name="moved")
    rig = tb.rig("rig1")
    old = rig.ssh_port
    with ports_claimed():  # no other testbed (another worker's) picks the freed port before this one takes it
        core.stop_pidfile(rig.dir / "sshd.pid")  # the rig's sshd is gone, and something else took its port
        squatter = _listen(old)
    with squatter:
        again = up(tb.dir, [rig.spec], shared=tb.shared)
        new = again.rig("rig1").ssh_port
        assert new != old
        _ours(again)
        assert f"ssh_port': {new}" in again.inventory.read_text()
        _ssh_ok(again, "rig1")


def test_lost_port_race_is_an_error_naming_the_rig(testbed_factory, monkeypatch):
    """Another process (not honouring the lock) listens on the port chosen for the rig between the choice and
    sshd's start: `up` fails naming the rig, instead of taking the other listener for the rig's sshd."""
    tb = testbed_factory(name="race")
    with _listen(0) as foreign:
        port = foreign.getsockname()[1]
        monkeypatch.setattr(core, "free_port", lambda *a, **k: port)
        with pytest.raises(
            TestbedError,
            match=rf"sshd of testbed rig rig1 \(.*\) did not start on 127.0.0.1:{port}: .*Address already in use",
        ):
            up(tb.dir, [RigSpec(gpus=1)], shared=tb.shared)


def test_a_service_port_held_by_another_process_is_not_taken_for_the_service(tmp_path, monkeypatch):
    run = tmp_path / "run"
    run.mkdir()
    with _listen(0) as foreign:
        port = foreign.getsockname()[1]
        monkeypatch.setattr(core, "free_port", lambda *a, **k: port)
        with pytest.raises(TestbedError, match=f"the apt service of testbed .* did not start on 127.0.0.1:{port}"):
            core._service(
                run, "apt", "x", port, lambda p: [sys.executable, "-m", "http.server", str(p), "--bind", "127.0.0.1"]
            )
    core.stop_pidfile(run / "apt.pid")


def test_down_purge_leaves_nothing_behind(tmp_path):
    """Issue 32 point 10: `down --purge` removes what `up` made (the cache, run/, upstream/, registry-ca/), and the
    directory itself once empty; a plain `down` keeps the cache and the upstream stand-in's storage."""
    made = tmp_path / "tb"
    for name in core.PURGED:
        (made / name).mkdir(parents=True)
        if name != "fleets":  # fleets/ holds testbeds of their own, each taken down with the rest
            (made / name / "something").write_text("x")
    down(made)
    assert sorted(p.name for p in made.iterdir()) == sorted(core.PURGED)
    down(made, purge=True)
    assert not made.exists()


def test_up_does_not_push_back_an_image_upstream_delete_removed(tmp_path):
    """Issue 32 point 10: `upstream-delete` is remembered (upstream/deleted.json) so that `up --rigs N` does not
    silently undo it; pushing the image again on purpose (Testbed.upstream_push) forgets it."""
    from rigforge.testbed import upstream

    class Registry:  # the stand-in's API as push_images uses it: what it holds, what was pushed
        def __init__(self):
            self.manifests, self.pushed = {}, []

        def manifest_digest(self, ref):
            return self.manifests.get(ref)

        def push_blob(self, name, digest, data):
            return True

        def push_manifest(self, ref, manifest):
            self.pushed.append(ref)
            self.manifests[ref] = upstream.sha256(manifest)
            return self.manifests[ref]

    layer = tmp_path / ("0" * 64)
    layer.write_bytes(b"layer")
    layers = [{"digest": "sha256:" + "0" * 64, "size": 5, "diff_id": "sha256:" + "1" * 64, "name": "l"}]
    images = {"vllm/vllm-openai:a": {}, "vllm/vllm-openai:b": {}}
    first = upstream.push_images(Registry(), layers, tmp_path, images)
    upstream.mark_deleted(tmp_path, "vllm/vllm-openai:a", first["vllm/vllm-openai:a"])
    registry = Registry()
    again = upstream.push_images(registry, layers, tmp_path, images, upstream.deleted(tmp_path))
    assert registry.pushed == ["vllm/vllm-openai:b"] and again == first  # the lock keeps its digest
    upstream.mark_deleted(tmp_path, "vllm/vllm-openai:a", first["vllm/vllm-openai:a"], undo=True)
    assert upstream.deleted(tmp_path) == set()
