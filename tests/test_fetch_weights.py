"""rigforge/remote/fetch_weights.py without the hub: the stamp it reads, and a run with every file already in place
(no download, so no huggingface_hub). Its downloads against the HF stand-in: tests/test_sources_weights_ops.py."""

import hashlib
import importlib.util
from pathlib import Path

import pytest

from rigforge.layout import STAMP

SCRIPT = Path(__file__).resolve().parents[1] / "rigforge/remote/fetch_weights.py"
_spec = importlib.util.spec_from_file_location("fetch_weights", SCRIPT)
fetch_weights = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(fetch_weights)

REVISION = "c" * 40
DATA = b"weights\n" * 1000


def manifest(tmp_path: Path, **changes) -> dict:
    dest = tmp_path / "models" / "asset"
    (dest / "sub").mkdir(parents=True)
    (dest / "sub" / "model.bin").write_bytes(DATA)
    files = [{"path": "sub/model.bin", "size": len(DATA), "sha256": hashlib.sha256(DATA).hexdigest()}]
    m = dict(
        name="asset",
        repo="org/model",
        revision=REVISION,
        dest=str(dest),
        staging=str(tmp_path / "models" / ".staging" / "asset"),
        stamp=str(dest / STAMP),
        files=files,
    )
    return m | changes


@pytest.mark.parametrize("text", [None, "not json", "[]", '{"files": []}'])
def test_a_missing_unreadable_or_foreign_stamp_is_an_empty_one(tmp_path, text):
    path = tmp_path / STAMP
    if text is not None:
        path.write_text(text)
    assert fetch_weights.load_stamp(str(path)) == {"files": {}}


def test_nothing_missing_is_verified_without_the_hub_and_the_staging_dir_is_tidied(tmp_path, capsys):
    m = manifest(tmp_path, gated=True)  # gated, no token: a stamped asset needs none
    part = Path(fetch_weights.part_path(m, {"path": "old.bin", "sha256": "d" * 64}))
    part.parent.mkdir(parents=True)
    part.write_bytes(b"left over")
    assert fetch_weights.run(m, None, deep=False, staged_only=False) == 0
    out = capsys.readouterr().out
    assert "sub/model.bin: hashing" in out and "asset: all 1 files verified (stamp)\n" in out
    stamp = fetch_weights.load_stamp(m["stamp"])
    assert stamp["revision"] == REVISION and stamp["files"]["sub/model.bin"]["sha256"] == m["files"][0]["sha256"]
    assert not Path(m["staging"]).exists()
    assert fetch_weights.run(m, None, deep=False, staged_only=False) == 0
    assert capsys.readouterr().out == "rigforge-weights: asset: all 1 files verified (stamp)\n"  # the stamp, unread
    assert fetch_weights.run(m, None, deep=True, staged_only=False) == 0
    assert "all 1 files verified (deep)" in capsys.readouterr().out


def test_another_revisions_stamp_is_not_trusted(tmp_path, capsys):
    m = manifest(tmp_path)
    fetch_weights.run(m, None, deep=False, staged_only=False)
    capsys.readouterr()
    fetch_weights.run(m | {"revision": "e" * 40}, None, deep=False, staged_only=False)
    assert "sub/model.bin: hashing" in capsys.readouterr().out
