"""What the result files record about the models and the machine."""

from __future__ import annotations

import json
import os
import platform
from pathlib import Path


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

    from rsd_runtime import row_attention, small_gemm

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
        "torch": torch.__version__,
        "torch_threads": torch.get_num_threads(),
        "cpu_flags": _cpu_flags(),
        # the small-row linear kernel per weight dtype on this machine (None: torch's F.linear)
        "small_gemm_kernels": {
            str(dtype).removeprefix("torch."): small_gemm.kernel_name(dtype)
            for dtype in (torch.float32, torch.bfloat16, torch.int8)
        },
        "row_attention": row_attention.available(),  # each query row reduced alone (batch-invariant attention)
        "transformers": transformers.__version__,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "loadavg_start": [round(x, 2) for x in os.getloadavg()],
    }


# The CPU features that decide what is fast here (bf16 and int8 dot products, vector width).
_NOTABLE_FLAGS = ("avx2", "fma", "avx512f", "avx512_vnni", "avx512_bf16", "avx_vnni", "amx_bf16", "amx_int8")


def _cpu_flags() -> list[str]:
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return []
    flags = {f for line in info.splitlines() if line.startswith(("flags", "Features")) for f in line.split()}
    return [f for f in _NOTABLE_FLAGS if f in flags]


def write_result(out_dir: Path, name: str, result: dict, markdown: str) -> None:
    """<out_dir>/<name>.json and .md, and the markdown on stdout: how the single-file benchmarks end."""
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / f"{name}.json").write_text(json.dumps(result, indent=1) + "\n")
    (out_dir / f"{name}.md").write_text(markdown)
    print(markdown)
