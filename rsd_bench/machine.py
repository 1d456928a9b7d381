"""What the result files record: which benchmark ran, when, on what code (run_record); the machine; the models."""

from __future__ import annotations

import datetime
import json
import os
import platform
import subprocess
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent


def run_record(benchmark: str) -> dict:
    """The keys every result starts with; rsd_bench.index reads them (benchmark, UTC date, commit of the code)."""
    return {
        "benchmark": benchmark,
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "commit": git_commit(),
    }


def git_commit() -> str:
    """HEAD of the checkout, "+dirty" when tracked code differs from it (results aside); RSD_GIT_COMMIT where
    the checkout has no .git."""
    if os.environ.get("RSD_GIT_COMMIT"):
        return os.environ["RSD_GIT_COMMIT"]
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=REPO, capture_output=True, text=True, timeout=10)
        status = ["git", "status", "--porcelain", "--untracked-files=no", "--", ".", ":!benchmarks/results"]
        changed = subprocess.run(status, cwd=REPO, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return "unknown"
    if head.returncode != 0 or not head.stdout.strip():
        return "unknown"
    return head.stdout.strip() + ("+dirty" if changed.returncode == 0 and changed.stdout.strip() else "")


def model_info(path: Path, model, dtype: str, device: str, params: int | None = None) -> dict:
    from rsd_runtime.models import batch_variance

    info = {
        "path": str(path),
        "name": path.name,
        "model_type": model.config.model_type,
        "params": params or sum(p.numel() for p in model.parameters()),  # int8 layers hold no parameters
        "dtype": str(model.dtype).removeprefix("torch."),  # "auto" resolved
        "dtype_asked": dtype,
        "device": device,
        "attention": model.config._attn_implementation,
        "numeric": getattr(model, "rsd_numeric", "exact"),  # a GGUF model's numeric mode (load_model)
        # why a row's logits may depend on its batch-mates ("" = never: rsd_runtime.models.batch_variance)
        "batch_variance": batch_variance(model),
    }
    marker = path / "rsd_provision.json"
    if marker.is_file():
        info["gguf_sha256"] = json.loads(marker.read_text()).get("gguf_sha256")
    return info


def machine_info() -> dict:
    import torch
    import transformers

    from rsd_runtime import quant, row_attention, small_gemm

    return {
        **cpu_info(),
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        # the small-row linear kernel per weight dtype on this machine (None: torch's F.linear)
        "small_gemm_kernels": {
            str(dtype).removeprefix("torch."): small_gemm.kernel_name(dtype)
            for dtype in (torch.float32, torch.bfloat16, torch.int8)
        },
        "row_attention": row_attention.available(),  # each query row reduced alone (batch-invariant attention)
        "quant_kernel": quant.kernel_name(),  # GGUF blocks: "avx512", "avx2" (None: dequantised on load)
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
    }


def cpu_info() -> dict:
    """The CPU alone, without torch: its model, cores, and the flags that decide its machine class."""
    cpu = platform.processor() or "unknown"
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {
        "cpu_model": cpu,
        "cores": os.cpu_count(),
        "cores_available": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else None,
        "cpu_flags": _cpu_flags(),
    }


# The CPU features that decide what is fast here (bf16 and int8 dot products, vector width).
_NOTABLE_FLAGS = (
    "avx2",
    "fma",
    "f16c",
    "avx512f",
    "avx512bw",
    "avx512_vnni",
    "avx512_bf16",
    "avx_vnni",
    "amx_bf16",
    "amx_int8",
)


def _cpu_flags() -> list[str]:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = {f for line in info.splitlines() if line.startswith(("flags", "Features")) for f in line.split()}
    return [f for f in _NOTABLE_FLAGS if f in flags]


def write_result(out_dir: Path, name: str, result: dict, markdown: str, echo: bool = True) -> None:
    """<out_dir>/<name>.json and .md, and the markdown on stdout (echo): how the single-file benchmarks end."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out_dir / f"{name}.md").write_text(markdown)
    if echo:
        print(markdown)
