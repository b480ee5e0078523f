"""rigforge.model.pins: the lock file loads into frozen dataclasses, malformed entries fail naming file and key,
check() finds unresolved and inconsistent entries, require() is the deploy-time refusal."""

from __future__ import annotations

import copy
import dataclasses

import pytest
import yaml

from rigforge.model import pins
from rigforge.model.pins import LockError, load_lock, parse_lock

GOOD = {
    "version": 1,
    "image": {"ref": "vllm/vllm-openai:nightly-x", "digest": "sha256:" + "a" * 64},
    "git": {
        "genesis": {"url": "git://127.0.0.1/g.git", "ref": "2db18df", "commit": "2db18df" + "0" * 33},
        "vllm-src": {
            "url": "git://127.0.0.1/v.git",
            "ref": "marlin-pad-sub-tile-n",
            "short": "67f8c2b",
            "commit": "67f8c2b" + "1" * 33,
            "sparse": ["vllm/a/marlin.py"],
            "files": {"vllm/a/marlin.py": "b" * 64},
        },
    },
    "hf": {
        "autoround-int4": {
            "repo": "Lorbus/Qwen3.6-27B-int4-AutoRound",
            "revision": "c" * 40,
            "gated": False,
            "files": [
                {"path": "config.json", "size": 10, "sha256": "d" * 64},
                {"path": "model.safetensors", "size": 2**34, "sha256": "e" * 64},
            ],
        }
    },
}


def lock_with(**changes):
    data = copy.deepcopy(GOOD)
    for dotted, value in changes.items():
        *parents, key = dotted.split("__")
        node = data
        for p in parents:
            node = node[p]
        if value is KeyError:
            del node[key]
        else:
            node[key] = value
    return data


def test_repo_lock_loads_with_the_real_pins_and_its_unresolved_entries():
    lock = load_lock(pins.default_lock_path())
    assert lock.git["genesis"].commit == "2db18df4bc3abd4eb58a9b2e0342082fa7012c64"
    assert lock.git["club-3090"].commit == "fbd3531960894e4f1dac1c29e55fdd99224c4f6c"
    assert lock.git["vllm-src"].short == "67f8c2b" and lock.git["vllm-src"].commit is None
    marlin = "vllm/model_executor/kernels/linear/mixed_precision/marlin.py"
    assert lock.git["vllm-src"].files[marlin].startswith("2bd1c3a7") and marlin in lock.git["vllm-src"].sparse
    assert {h.repo for h in lock.hf.values()} == {
        "Lorbus/Qwen3.6-27B-int4-AutoRound",
        "z-lab/Qwen3.6-27B-DFlash",
        "wasifb/Carnice_V2_27B_INT4_BF16MTP",
        "Qwen/Qwen3.6-27B-FP8",  # vllm/qwen-27b-dual-max (recipe repo)
        "migtissera/Tess-4-27B-GGUF",  # llamacpp/tess-dual-mtp: two files of the repo
        "PiehSoft/Qwen3.6-40B-Deckard-MTP-Q6_K",  # llamacpp/deckard40B-dual-mtp
    }
    assert lock.hf["tess-4-27b-gguf-migtissera-q4km"].include == (
        "Tess-4-27B-Q4_K_M.gguf",
        "mtp-Tess-4-27B-Q4_K_M.gguf",
    )
    assert lock.images["llama-cpp-local"].ref == "ghcr.io/ggml-org/llama.cpp:server-cuda-b10236"
    assert lock.git["recipes"].commit == "4a29ab57d42a1d587de1042fa5dfd9535f94a063"
    assert lock.images["vllm-stable"].ref == "vllm/vllm-openai:v0.27.1"
    assert lock.image.ref.startswith("vllm/vllm-openai:nightly-7a1eb8ac") and lock.image.digest is None
    assert lock.unresolved() == [
        "image (digest: null)",
        "images.vllm-stable (digest: null)",
        "images.llama-cpp-local (digest: null)",
        "git.vllm-src (commit: null)",
        "hf.autoround-int4 (revision: null)",
        "hf.dflash-draft (revision: null)",
        "hf.carnice (revision: null)",
        "hf.qwen3.6-27b-fp8 (revision: null)",
        "hf.tess-4-27b-gguf-migtissera-q4km (revision: null)",
        "hf.qwen3.6-40b-deckard-gguf-piehsoft-q6k (revision: null)",
    ]
    # the check lists every unresolved entry, and nothing else is wrong with it
    assert len(lock.check()) == 10


def test_dump_and_load_round_trip(tmp_path):
    lock = load_lock(pins.default_lock_path())
    path = tmp_path / "lock.yaml"
    path.write_text(pins.dump_lock(lock))
    assert dataclasses.replace(load_lock(path), path=lock.path) == lock


def test_a_lock_is_parsed_once_per_content(tmp_path):
    """Every rig of a run reads the same lock: parsed once; a changed file (even within one mtime tick, same
    size) is parsed again."""
    lock = load_lock(pins.default_lock_path())
    path = tmp_path / "lock.yaml"
    text = pins.dump_lock(lock)
    path.write_text(text)
    first = load_lock(path)
    assert load_lock(path) is first
    commit = next(iter(lock.git.values())).commit
    path.write_text(text.replace(commit, commit[::-1], 1))  # same size
    assert load_lock(path) is not first and load_lock(path) != first


def test_good_lock_parses_into_frozen_dataclasses():
    lock = parse_lock(GOOD, "t.yaml")
    assert lock.check() == [] and lock.unresolved() == []
    assert lock.hf["autoround-int4"].total_size == 2**34 + 10
    assert lock.git["vllm-src"].sparse == ("vllm/a/marlin.py",)
    with pytest.raises(dataclasses.FrozenInstanceError):
        lock.git["genesis"].commit = "x"  # type: ignore[misc]
    with pytest.raises(TypeError):
        lock.git["new"] = lock.git["genesis"]  # type: ignore[index]


@pytest.mark.parametrize(
    "changes, message",
    [
        ({"version": 2}, "top level.version: unsupported version 2"),
        ({"git__genesis__commit": "2db18df"}, "git.genesis.commit: expected a 40-hex commit SHA or null"),
        ({"git__genesis__url": KeyError}, "git.genesis.url: missing"),
        ({"git__genesis__colour": "red"}, "git.genesis: unknown key(s) ['colour']"),
        ({"git__vllm-src__files": {"x.py": "nothex"}}, "git.vllm-src.files: x.py: expected a 64-hex sha256"),
        ({"git__vllm-src__sparse": ["../etc/passwd"]}, "git.vllm-src.sparse: expected a relative path"),
        ({"git__vllm-src__short": "zz"}, "git.vllm-src.short: expected 4-39 hex digits"),
        ({"hf__autoround-int4__repo": "no-slash"}, "hf.autoround-int4.repo: expected an 'owner/name' repo id"),
        ({"hf__autoround-int4__gated": "yes"}, "hf.autoround-int4.gated: expected bool"),
        ({"hf__autoround-int4__files": [{"path": "a", "size": "1", "sha256": "d" * 64}]}, "files[0].size"),
        ({"hf__autoround-int4__files": [{"path": "a", "size": True, "sha256": "d" * 64}]}, "files[0].size"),
        (
            {"hf__autoround-int4__files": [{"path": "a", "size": 1, "sha256": "d" * 64}] * 2},
            "files[1]: duplicate path a",
        ),
        ({"image__digest": "sha256:abc"}, "image.digest: expected 'sha256:<64 hex>' or null"),
        ({"git": ["genesis"]}, "top level.git: expected dict"),
    ],
)
def test_malformed_entries_fail_naming_file_and_key(changes, message):
    with pytest.raises(LockError) as err:
        parse_lock(lock_with(**changes), "bad.yaml")
    assert str(err.value).startswith("lock bad.yaml: ") and message in str(err.value)


def test_missing_and_invalid_files_are_clear_errors(tmp_path):
    with pytest.raises(LockError, match="file not found"):
        load_lock(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("version: [1\n")
    with pytest.raises(LockError, match="not valid YAML"):
        load_lock(bad)


def test_check_finds_inconsistent_entries():
    data = lock_with(**{"git__vllm-src__files": {"vllm/other.py": "b" * 64}})
    problems = parse_lock(data, "t").check()
    assert problems == ["git.vllm-src: file vllm/other.py is outside the sparse paths ['vllm/a/marlin.py']"]
    data = lock_with(**{"git__genesis__commit": "1234567" + "0" * 33})
    assert parse_lock(data, "t").check() == [
        "git.genesis: commit 1234567000000000000000000000000000000000 does not start with ref 2db18df"
    ]
    # a directory in sparse (trailing slash) covers the files below it
    data = lock_with(**{"git__vllm-src__sparse": ["vllm/a/"]})
    assert parse_lock(data, "t").check() == []


def test_unresolved_entries_and_require():
    data = lock_with(**{"git__vllm-src__commit": None, "hf__autoround-int4__files": []})
    lock = parse_lock(data, "t.yaml")
    assert lock.unresolved() == ["git.vllm-src (commit: null)", "hf.autoround-int4 (files: [])"]
    lock.require(git=["genesis"])  # resolved entries pass
    with pytest.raises(LockError) as err:
        lock.require(git=["genesis", "vllm-src"], hf=["autoround-int4"])
    msg = str(err.value)
    assert "git.vllm-src, hf.autoround-int4" in msg and "run `rigforge lock` on a networked controller" in msg
    with pytest.raises(LockError, match="no hf entry 'carnice'"):
        lock.require(hf=["carnice"])


def test_yaml_of_the_repo_lock_keeps_the_contract_keys():
    raw = yaml.safe_load(pins.default_lock_path().read_text())
    assert set(raw) == {"version", "image", "images", "toolkit", "git", "hf"}
    assert set(raw["toolkit"]) == {"version", "note"} and "#1967" in raw["toolkit"]["note"]
    for entry in raw["images"].values():
        assert {"ref", "digest"} <= set(entry)
    for entry in raw["git"].values():
        assert {"url", "ref", "commit", "sparse", "files"} <= set(entry)
    for entry in raw["hf"].values():
        assert {"repo", "revision", "gated", "files"} <= set(entry)


def test_toolkit_entry_is_optional_validated_and_kept_on_rewrite():
    raw = yaml.safe_load(pins.default_lock_path().read_text())
    lock = pins.parse_lock(raw)
    assert lock.toolkit == pins.ToolkitPin("1.19.0-1", raw["toolkit"]["note"])
    assert pins.parse_lock(yaml.safe_load(pins.dump_lock(lock))).toolkit == lock.toolkit
    assert pins.parse_lock({k: v for k, v in raw.items() if k != "toolkit"}).toolkit is None
    with pytest.raises(pins.LockError, match="toolkit.version: expected a Debian package version"):
        pins.parse_lock({**raw, "toolkit": {"version": "1.19 .0"}})
