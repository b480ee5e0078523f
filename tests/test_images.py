"""`rigforge images save` against a real Distribution registry on 127.0.0.1 (Debian's docker-registry, plain HTTP,
its access log counted), and the load role's operations on pyinfra's @fake connector."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import requests
from registry_support import push_image, running_registry

from rigforge.cli import images
from rigforge.cli.main import main
from rigforge.model import saved_images
from rigforge.model.pins import ImagePin, parse_lock

REF = "vllm/vllm-openai:v0.27.1"


@pytest.fixture(scope="module")
def registry(tmp_path_factory):
    with running_registry(tmp_path_factory.mktemp("registry")) as reg:
        reg.image = push_image(reg, "vllm/vllm-openai", "v0.27.1")
        reg.multi = push_image(reg, "vllm/vllm-openai", "nightly-multi", index=True, seed="multi ")
        reg.oci = push_image(reg, "vllm/vllm-openai", "nightly-oci", index=True, oci=True, seed="oci ")
        yield reg


def lock_file(tmp_path: Path, **digests) -> Path:
    data = {"version": 1, "image": {"ref": REF, "digest": digests.get("image")}, "images": {}}
    for name, (ref, digest) in digests.get("images", {}).items():
        data["images"][name] = {"ref": ref, "digest": digest}
    path = tmp_path / "lock.yaml"
    path.write_text(json.dumps(data))
    parse_lock(data, str(path))  # a lock of the real shape
    return path


def blob_names_hash_to_their_content(directory: Path) -> int:
    blobs = list((directory / saved_images.BLOBS).iterdir())
    for blob in blobs:
        assert hashlib.sha256(blob.read_bytes()).hexdigest() == blob.name, blob
    return len(blobs)


def test_save_writes_an_oci_layout_naming_the_ref_with_the_registrys_digest(registry, tmp_path, capsys):
    lock = lock_file(tmp_path, image=registry.image["digest"])
    assert main(["images", "save", str(tmp_path / "out"), "--lock", str(lock), "--registry", registry.url]) == 0
    out = tmp_path / "out"
    assert json.loads((out / "oci-layout").read_text()) == {"imageLayoutVersion": "1.0.0"}
    index = json.loads((out / "index.json").read_text())
    [entry] = index["manifests"]
    head = requests.head(
        f"{registry.url}/v2/vllm/vllm-openai/manifests/v0.27.1", headers={"Accept": images.MANIFEST_TYPES}, timeout=5
    )
    assert entry["digest"] == head.headers["Docker-Content-Digest"] == registry.image["digest"]
    assert entry["annotations"] == {saved_images.REF_NAME: REF, saved_images.IMAGE_NAME: f"docker.io/{REF}"}
    assert saved_images.blob_path(out, entry["digest"]).read_bytes() == registry.image["manifest"]  # byte for byte
    assert blob_names_hash_to_their_content(out) == 5  # manifest, config, 3 layers
    assert saved_images.saved(out, REF, registry.image["digest"])
    assert not saved_images.saved(out, REF, "sha256:" + "0" * 64) and not saved_images.saved(
        out, "other:tag", entry["digest"]
    )
    said = capsys.readouterr().out
    assert "saving from http://127.0.0.1:" in said and "(100%), verified" in said


def test_a_multi_platform_index_keeps_the_index_and_its_child_manifests(registry, tmp_path):
    pin = ImagePin("vllm/vllm-openai:nightly-multi", registry.multi["digest"])
    assert images.save_image(tmp_path, pin, registry.url) == 4  # config + 3 layers
    assert saved_images.blob_path(tmp_path, pin.digest).read_bytes() == registry.multi["manifest"]
    child = json.loads(registry.multi["manifest"])["manifests"][0]["digest"]
    assert saved_images.blob_path(tmp_path, child).read_bytes() == registry.multi["child"]
    assert blob_names_hash_to_their_content(tmp_path) == 6 and saved_images.saved(tmp_path, pin.ref, pin.digest)


def test_an_oci_index_with_an_attestation_is_saved_whole_and_pushed_children_first(registry, tmp_path):
    pin = ImagePin("vllm/vllm-openai:nightly-oci", registry.oci["digest"])
    assert images.save_image(tmp_path, pin, registry.url) == 6  # config + 3 layers, the attestation's 2 blobs
    assert blob_names_hash_to_their_content(tmp_path) == 9 and saved_images.saved(tmp_path, pin.ref, pin.digest)
    plan, needed = saved_images.push_plan(tmp_path, saved_images.index_entries(tmp_path))
    children = [c["digest"] for c in json.loads(registry.oci["manifest"])["manifests"]]
    assert [line.split()[0] for line in plan] == ["blob"] * 6 + ["manifest"] * 3 + ["pull"]
    assert [line.split()[2] for line in plan[6:9]] == [*children, pin.digest]
    assert plan[8].endswith("application/vnd.oci.image.index.v1+json") and len(needed) == 9


def test_a_second_save_fetches_nothing(registry, tmp_path, capsys):
    lock = lock_file(tmp_path, image=registry.image["digest"])
    args = ["images", "save", str(tmp_path / "out"), "--lock", str(lock), "--registry", registry.url]
    assert main(args) == 0
    before = registry.requests_for("/v2/vllm/")
    assert main(args) == 0
    assert registry.requests_for("/v2/vllm/") == before  # not one request
    assert "already saved" in capsys.readouterr().out


def test_a_cut_save_fetches_only_the_missing_blobs(registry, tmp_path):
    pin = ImagePin(REF, registry.image["digest"])
    images.save_image(tmp_path, pin, registry.url)
    manifest = json.loads(registry.image["manifest"])
    gone = manifest["layers"][1]["digest"]
    saved_images.blob_path(tmp_path, gone).unlink()
    before = registry.requests_for("/blobs/")
    assert not saved_images.saved(tmp_path, REF, pin.digest)
    assert images.save_image(tmp_path, pin, registry.url) == 1
    assert registry.requests_for("/blobs/") == before + 1 and saved_images.saved(tmp_path, REF, pin.digest)


def test_a_corrupt_blob_is_refused_and_not_renamed_into_place(registry, tmp_path, monkeypatch):
    pin = ImagePin(REF, registry.image["digest"])
    layer = json.loads(registry.image["manifest"])["layers"][0]
    real = images._Source.get

    def corrupting(self, kind, digest, *args, **kwargs):
        resp = real(self, kind, digest, *args, **kwargs)
        if digest == layer["digest"]:
            body = bytearray(resp.content)
            body[100] ^= 0xFF
            resp.iter_content = lambda size: iter([bytes(body)])
        return resp

    monkeypatch.setattr(images._Source, "get", corrupting)
    with pytest.raises(
        saved_images.ImagesError, match=f"{layer['digest']}: refused, got {layer['size']} bytes with sha256:"
    ):
        images.save_image(tmp_path, pin, registry.url)
    final = saved_images.blob_path(tmp_path, layer["digest"])
    assert not final.exists() and not final.with_name(f".{final.name}.part").exists()
    assert not saved_images.saved(tmp_path, REF, pin.digest)


def test_a_missing_image_is_one_clear_line_and_exit_1(registry, tmp_path, capsys):
    missing = "sha256:" + "ab" * 32
    lock = lock_file(tmp_path, image=missing)
    assert main(["images", "save", str(tmp_path / "out"), "--lock", str(lock), "--registry", registry.url]) == 1
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        f"rigforge images save: {REF}@{missing}: not obtainable: {registry.url} answered HTTP 404 for manifest "
        f"{missing} (the registry does not have it)"
    ]


def test_a_resumed_blob_download_asks_for_the_rest_only(registry, tmp_path):
    pin = ImagePin(REF, registry.image["digest"])
    layer = json.loads(registry.image["manifest"])["layers"][2]
    images.save_image(tmp_path, pin, registry.url)
    final = saved_images.blob_path(tmp_path, layer["digest"])
    data = final.read_bytes()
    final.unlink()
    final.with_name(f".{final.name}.part").write_bytes(data[: len(data) // 2])  # a cut download
    assert images.save_image(tmp_path, pin, registry.url) == 1
    assert final.read_bytes() == data


def test_save_from_a_tls_registry_trusting_only_the_given_ca(tmp_path, capsys):
    """A move between fleets: save from a fleet registry over TLS with its CA (rigforge's own, as roles/registry.py
    makes it); without --ca-cert the system's CAs refuse it."""
    from rigforge.model import registry as fleet

    ca_dir = tmp_path / "ca"
    crt, key = fleet.server_certificate(ca_dir, "127.0.0.1")
    (tmp_path / "s.crt").write_text(crt)
    (tmp_path / "s.key").write_text(key)
    with running_registry(tmp_path / "reg", tls=(tmp_path / "s.crt", tmp_path / "s.key", ca_dir / "ca.crt")) as reg:
        import registry_support

        registry_support.requests = _Verified(str(ca_dir / "ca.crt"))  # the fixture's pushes trust the CA too
        try:
            image = push_image(reg, "vllm/vllm-openai", "v0.27.1", seed="tls ")
        finally:
            registry_support.requests = requests
        lock = lock_file(tmp_path, image=image["digest"])
        base = ["images", "save", str(tmp_path / "out"), "--lock", str(lock), "--registry", reg.url]
        assert main(base) == 1
        assert "CERTIFICATE_VERIFY_FAILED" in capsys.readouterr().err
        assert main([*base, "--ca-cert", str(ca_dir / "ca.crt")]) == 0
    assert saved_images.saved(tmp_path / "out", REF, image["digest"])


class _Verified:
    """`requests` with every call verifying against one CA file."""

    def __init__(self, ca: str):
        self.ca = ca

    def __getattr__(self, name):
        real = getattr(requests, name)
        if name in ("get", "post", "put", "head"):
            return lambda *a, **k: real(*a, **{"verify": self.ca, **k})
        return real


def test_locked_images_are_those_with_a_digest_each_once():
    lock = parse_lock(
        {
            "version": 1,
            "image": {"ref": REF, "digest": "sha256:" + "1" * 64},
            "images": {
                "a": {"ref": REF, "digest": "sha256:" + "1" * 64},
                "b": {"ref": "vllm/vllm-openai:v2", "digest": None},
            },
        }
    )
    pins, unresolved = images.locked_images(lock)
    assert [p.ref for p in pins] == [REF] and unresolved == ["images.b (vllm/vllm-openai:v2)"]


def test_hub_names():
    assert saved_images.hub_name("vllm/vllm-openai:v1") == ("vllm/vllm-openai", "v1")
    assert saved_images.hub_name("ubuntu") == ("library/ubuntu", "latest")
    assert saved_images.hub_name("docker.io/library/ubuntu:24.04") == ("library/ubuntu", "24.04")
    assert saved_images.hub_name("ghcr.io/o/i:1") is None and saved_images.hub_name("localhost:5000/i:1") is None
    assert saved_images.qualified("ubuntu:24.04") == "docker.io/library/ubuntu:24.04"


# --- the load role on pyinfra's @fake connector ----------------------------------------------------------------

DAEMON = "/etc/docker/daemon.json"


@pytest.fixture(scope="module")
def saved_dir(registry, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("saved")
    images.save_image(out, ImagePin(REF, registry.image["digest"]), registry.url)
    return out


def fake_rig(present: bool, blobs: dict | None = None, daemon: dict | None = None, work: bool = False, **data):
    """Host data for a @fake rig: docker holds the image (or not), the rig's layout holds `blobs`."""
    extra = {
        "docker image inspect": "yes" if present else "no",
        "blobs/sha256": [f"{d[7:]} {size}" for d, size in (blobs or {}).items()],
        "/proc/net/tcp": ["  sl  local_address rem_address   st", "   0: 0100007F:16A8 00000000:0000 0A"],  # 5800
        "cat /etc/docker/daemon.json": json.dumps(daemon or {"storage-driver": "vfs"}).splitlines(),
    }
    if work:
        extra[".work"] = "user=root group=root mode=drwx------ atime=0 mtime=0 ctime=0 size=4096 '/x'"
        extra["sha256sum /opt/rigforge/images/load_images.sh"] = f"{'0' * 64}  /opt/rigforge/images/load_images.sh"
    return {"fake_responses": extra, "fake_delay": 0, "fake_delay_jitter": 0, **data}


def run_load(hosts, saved_dir, execute=True):
    from test_roles_host_ops import converge

    from rigforge.layout import HostLayout
    from roles import images as role

    return converge(
        hosts, role.load, str(saved_dir), saved_images.index_entries(saved_dir), HostLayout(), execute=execute
    )


def commands_of(state, name="r"):
    from pyinfra.api import FileUploadCommand
    from pyinfra.context import ctx_host, ctx_state
    from test_roles_host_ops import host_of

    host = host_of(state, name)
    out = []
    with ctx_state.use(state), ctx_host.use(host):
        for op_hash in state.get_op_order():
            op_data = state.ops[host].get(op_hash)
            for command in op_data.command_generator() if op_data else ():
                if isinstance(command, FileUploadCommand):
                    src = command.src if isinstance(command.src, str) else command.src.getvalue()
                    src = src.decode() if isinstance(src, bytes) else src
                    out.append(("upload", command.dest, src))
                else:
                    out.append(
                        (
                            "run",
                            str(getattr(command, "args", [""])[0]) if hasattr(command, "function") else str(command),
                            None,
                        )
                    )
    return out


def test_load_is_a_no_op_when_docker_holds_the_locked_digest(saved_dir):
    from test_roles_host_ops import executed

    state = run_load({"r": fake_rig(present=True)}, saved_dir)
    changes = ("apt-get", "systemctl stop", "systemctl disable", "load_images.sh", "mkdir", "mv ", "rm ", "install ")
    assert [c for c in executed(state, "r") if any(word in c for word in changes)] == []
    assert any("docker image inspect vllm/vllm-openai@sha256:" in c for c in executed(state, "r"))


def test_load_uploads_only_the_blobs_the_rig_lacks_then_runs_the_script(registry, saved_dir):
    manifest = json.loads(registry.image["manifest"])
    have = {
        manifest["layers"][0]["digest"]: manifest["layers"][0]["size"],
        manifest["layers"][1]["digest"]: 1,
    }  # one in place, one at the wrong size
    state = run_load({"r": fake_rig(present=False, blobs=have)}, saved_dir, execute=False)
    commands = commands_of(state)
    sent = [dest for kind, dest, _ in commands if kind == "upload" and dest.endswith(".part")]
    assert len(sent) == 4  # manifest, config and 2 of the 3 layers
    assert not any(manifest["layers"][0]["digest"][7:] in dest for dest in sent)
    checks = [c for kind, c, _ in commands if kind == "run" and "sha256sum -c" in c]
    assert len(checks) == 4 and all("mv -f" in c and "/opt/rigforge/images/oci/blobs/sha256/" in c for c in checks)
    uploads = {dest: src for kind, dest, src in commands if kind == "upload"}
    plan = uploads["/opt/rigforge/images/.work/plan"].splitlines()
    assert plan[:3] == [f"blob vllm/vllm-openai {d['digest']}" for d in [manifest["config"], *manifest["layers"]][:3]]
    assert plan[-2:] == [
        f"manifest vllm/vllm-openai {registry.image['digest']} {manifest['mediaType']}",
        f"pull vllm/vllm-openai@{registry.image['digest']}",
    ]
    script = next(c for kind, c, _ in commands if kind == "run" and "load_images.sh load" in c)
    root = "/opt/rigforge/images"
    assert script == f"sh {root}/load_images.sh load {root}/.work {root}/oci 5801 {DAEMON} {root}/.work/plan"
    assert commands[-1] == ("run", "rm -rf /opt/rigforge/images/oci /opt/rigforge/images/.upload", None)


def test_a_rig_without_room_for_the_blobs_and_the_registrys_copy_is_refused_before_any_upload(saved_dir):
    from test_roles_host_ops import describe

    data = fake_rig(present=False)
    data["fake_responses"]["stat -f"] = "0 4096"  # 0 blocks free
    state = run_load({"r": data}, saved_dir, execute=False)
    commands = commands_of(state)
    assert not [dest for kind, dest, _ in commands if kind == "upload" and dest.endswith(".part")]
    from pyinfra.context import ctx_host, ctx_state
    from test_roles_host_ops import host_of

    from rigforge.layout import HostLayout
    from roles.operations import images as image_ops

    host = host_of(state, "r")
    with ctx_state.use(state), ctx_host.use(host):
        [failure] = [
            describe(c)
            for c in image_ops.blobs_uploaded._inner(
                str(saved_dir), saved_images.index_entries(saved_dir), HostLayout()
            )
        ]
    assert failure.startswith("FAIL: @fake/r: not enough disk space to load 1 image(s) at /opt/rigforge/images/oci")


def test_the_mirror_goes_first_into_the_users_daemon_json_and_their_mirrors_are_put_back(saved_dir):
    daemon = {"storage-driver": "vfs", "registry-mirrors": ["https://mirror.example.lan"]}
    state = run_load({"r": fake_rig(present=False, daemon=daemon)}, saved_dir, execute=False)
    uploads = {dest: src for kind, dest, src in commands_of(state) if kind == "upload"}
    mirrored = json.loads(uploads["/opt/rigforge/images/.work/daemon.json.mirrored"])
    assert mirrored == {
        "storage-driver": "vfs",
        "registry-mirrors": ["http://127.0.0.1:5801", "https://mirror.example.lan"],
    }
    assert json.loads(uploads["/opt/rigforge/images/.work/daemon.json.cleared"]) == daemon
    state = run_load({"r": fake_rig(present=False, daemon={"storage-driver": "vfs"})}, saved_dir, execute=False)
    uploads = {dest: src for kind, dest, src in commands_of(state) if kind == "upload"}
    # a reload keeps an option the file no longer sets: the clean-up reloads with the user's (no) mirrors set
    assert json.loads(uploads["/opt/rigforge/images/.work/daemon.json.cleared"])["registry-mirrors"] == []


def test_an_interrupted_load_is_repaired_first(saved_dir):
    state = run_load({"r": fake_rig(present=True, work=True)}, saved_dir, execute=False)
    commands = [c for kind, c, _ in commands_of(state) if kind == "run" and "load_images" in c]
    assert commands == [
        "sh /opt/rigforge/images/load_images.sh repair /opt/rigforge/images/.work /etc/docker/daemon.json"
    ]


def test_load_refuses_an_incomplete_directory_or_another_registrys_image(registry, saved_dir, tmp_path):
    with pytest.raises(saved_images.ImagesError, match="no saved image"):
        saved_images.check_loadable(tmp_path)
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(saved_dir, broken)
    layer = json.loads(registry.image["manifest"])["layers"][0]["digest"]
    saved_images.blob_path(broken, layer).unlink()
    with pytest.raises(saved_images.ImagesError, match="is incomplete: run `rigforge images save` again"):
        saved_images.check_loadable(broken)
    assert main(["images", "load", str(broken), "inventory.py"]) == 1


def test_the_port_facts_parse_proc_net_tcp():
    from rigforge.observe.facts.images import ListeningPorts, OciBlobs

    lines = [
        "  sl  local_address rem_address   st tx_queue",
        "   0: 0100007F:1388 00000000:0000 0A 0",
        "   1: 0100007F:1389 0100007F:D2F0 01 0",
    ]
    assert ListeningPorts().process(lines) == [5000]
    assert OciBlobs().process([f"{'a' * 64} 12", ".part 3", f"{'b' * 64} x"]) == {f"sha256:{'a' * 64}": 12}


def test_only_docker_hub_images_can_be_loaded(saved_dir, tmp_path):
    import shutil

    other = tmp_path / "ghcr"
    shutil.copytree(saved_dir, other)
    index = json.loads((other / "index.json").read_text())
    index["manifests"][0]["annotations"][saved_images.REF_NAME] = "ghcr.io/owner/image:v1"
    (other / "index.json").write_text(json.dumps(index))
    with pytest.raises(saved_images.ImagesError, match="ghcr.io/owner/image:v1: only Docker Hub images can be loaded"):
        saved_images.check_loadable(other)


def test_the_fleet_registry_host_keeps_its_registry_service(saved_dir):
    from test_roles_host_ops import converge

    from rigforge.layout import HostLayout
    from roles import images as role

    saved = saved_images.index_entries(saved_dir)
    for registry_host, stopped in ((False, True), (True, False)):
        data = fake_rig(present=False)
        data["fake_responses"]["systemctl show"] = ["Id=docker-registry.service", "SubState=running"]
        state = converge(
            {"r": data}, role.load, str(saved_dir), saved, HostLayout(), registry_host=registry_host, execute=False
        )
        commands = [c for kind, c, _ in commands_of(state) if kind == "run"]
        assert any("systemctl stop docker-registry.service" in c for c in commands) == stopped, commands


def test_knobs_are_checked():
    from rigforge.model.knobs import images as role

    assert role.validate({"rigforge_images_dir": "/srv/saved", "images_port": None}) == []
    assert role.validate({"rigforge_images_dir": None, "images_port": 0}) == [
        "rigforge_images_dir must be a directory `rigforge images save` wrote, got None",
        "images_port must be a whole number in 1..65535 or unset, got 0",
    ]
