"""CPU kernels for linear layers over a handful of rows: `y[R, N] = x[R, K] @ w[N, K]^T` with R <= 64.

A draft tree or a tree verification feeds each linear layer 2-16 rows. BLAS (MKL/oneDNN through F.linear)
is tuned for large matrices: a few rows cost several times one row's time, while the product is still
bound by reading the weight once. These kernels stream each weight once for all rows: they walk the weight
a few output rows at a time (a block held in L1) and multiply that block with every group of up to 6 input
rows (groups of near-equal size), while they prefetch the weight rows ahead, spread over all the groups:
the next weights stream in from memory while this block's rows are multiplied.

    y = small_gemm(x, weight)         # x [R, K], weight [N, K], both float32 or both bfloat16
    kernel_name(torch.bfloat16)       # which kernel a dtype runs on here: "amx-bf16", "avx512-bf16", ...

- float32 (AVX2 + FMA, csrc/small_gemm_f32.c): pairs of weight rows, 12 accumulators.
- bfloat16 (AVX512-BF16, `vdpbf16ps`: 32 products a lane-wide instruction, summed in float32 and rounded
  to bfloat16 to nearest even, as torch does; csrc/small_gemm_avx512_bf16.c): four weight rows at a time,
  24 accumulators. oneDNN's bf16 F.linear reads the weights well below the memory's pace; this kernel
  streams them close to it.
- bfloat16 on AMX (preferred where the CPU has it; csrc/small_gemm_amx_bf16.c): the tile unit multiplies 16
  weight rows by up to 16 input rows in one instruction, so every row count streams the weight at the
  memory's pace.
- int8 (AVX512-VNNI, csrc/small_gemm_int8.c): uint8 rows times int8 weights in exact int32 sums, and
  int8_linear, a whole rsd_runtime.linear.Int8Linear layer in one call.
The AVX-512 ones share one tiling (csrc/small_gemm_tiles.h) and every entry point splits the columns the same
way (csrc/small_gemm_threads.h).

Exactness: a row's result is the same whatever rows share its call (each row has its own accumulators or
tile lanes, summed over K in the same order), so a tree's node gets bit-for-bit the value it would get
alone; against F.linear it differs by float rounding only (tests/rsd_runtime/test_small_gemm.py).

Each kernel is a C file of csrc/ (package data) compiled at first use with the system compiler ($CC, else
`cc`) into kernel_dir() ($RSD_KERNEL_DIR, else ~/.cache/rsd/kernels), keyed by its source text (headers
included) and flags, and called through ctypes (which releases the GIL); threads of torch's own OpenMP team
split the output columns. `available(dtype)` says whether one can run here: an
x86-64 CPU with its instructions, and a compiler that knows them and a writable kernel dir (or the kernel
built there before: a read-only dir of built kernels serves). Where it cannot (no compiler, a read-only
cache, another CPU), callers keep their torch path (F.linear; fbgemm for int8): speed only, the law is
unchanged; one log line per dtype says which kernel runs or why none does (a warning when one could have).
RSD_SMALL_GEMM picks among them (SETTINGS); "avx2" makes any x86 CPU choose as an AVX2-only one does.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
import threading
from pathlib import Path

import torch
from torch import Tensor

log = logging.getLogger(__name__)

CSRC = Path(__file__).parent / "csrc"  # the kernels' C sources, package data (pyproject.toml)

MAX_ROWS = 64  # above this, BLAS is the faster path


@dataclasses.dataclass(frozen=True)
class _Kernel:
    name: str
    source: str  # its file in CSRC
    cflags: tuple[str, ...]  # what the compiler needs to emit its instructions
    cpu_flags: tuple[str, ...]  # what /proc/cpuinfo must list
    k_multiple: int  # K must be a multiple of this (one vector of the dtype)
    x_dtype: torch.dtype  # the input rows' dtype
    y_dtype: torch.dtype  # the output's


_AVX512 = ("-mavx512f", "-mavx512bw")
_AVX512_BF16 = _Kernel(
    "avx512-bf16",
    "small_gemm_avx512_bf16.c",
    (*_AVX512, "-mavx512bf16"),
    ("avx512f", "avx512bw", "avx512_bf16"),
    32,
    torch.bfloat16,
    torch.bfloat16,
)
# The AMX kernel is the AVX-512 one (its code computes the columns past the tiles) with the tile entry point.
_AMX_BF16 = dataclasses.replace(
    _AVX512_BF16,
    name="amx-bf16",
    source="small_gemm_amx_bf16.c",
    cflags=(*_AVX512_BF16.cflags, "-mamx-tile", "-mamx-bf16"),
    cpu_flags=(*_AVX512_BF16.cpu_flags, "amx_tile", "amx_bf16"),
)
# Keyed by the weight's dtype: the kernels for it, preferred first; the first this machine runs is used.
_KERNELS: dict[torch.dtype, tuple[_Kernel, ...]] = {
    torch.float32: (
        _Kernel(
            "avx2",
            "small_gemm_f32.c",
            ("-mavx2", "-mfma"),
            ("avx2", "fma"),
            8,
            torch.float32,
            torch.float32,
        ),
    ),
    torch.bfloat16: (_AMX_BF16, _AVX512_BF16),
    torch.int8: (
        _Kernel(
            "avx512-vnni",
            "small_gemm_int8.c",
            (*_AVX512, "-mavx512vnni"),
            ("avx512f", "avx512bw", "avx512_vnni"),
            64,
            torch.uint8,
            torch.int32,
        ),
    ),
}

_lock = threading.Lock()
_libs: dict[torch.dtype, ctypes.CDLL] = {}
_names: dict[torch.dtype, str] = {}  # the kernel each dtype runs on
_failed: dict[torch.dtype, str] = {}


@functools.cache
def _cpu_flags() -> frozenset[str]:
    if platform.machine().lower() not in ("x86_64", "amd64"):
        return frozenset()
    try:
        return frozenset(Path("/proc/cpuinfo").read_text().split())
    except OSError:
        return frozenset({"avx2", "fma"} if torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512") else ())


def compile_library(source: Path, cflags: tuple[str, ...]) -> ctypes.CDLL:
    """The C file `source` built with `cflags` (and OpenMP) into kernel_dir() once and loaded; OSError,
    RuntimeError or subprocess.SubprocessError where it cannot be (also used by rsd_runtime.row_attention).
    The build is keyed by the text of the file and of every header beside it (what its quoted #includes can
    read) and by the flags: a changed source builds anew."""
    texts = [source.read_text(), *(h.read_text() for h in sorted(source.parent.glob("*.h"))), " ".join(cflags)]
    digest = hashlib.sha256("\0".join(texts).encode()).hexdigest()[:16]
    so = kernel_dir() / f"{source.stem}-{digest}.so"
    cache = so.parent
    if not so.exists():
        cache.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(dir=cache) as tmp:
            out = Path(tmp) / so.name
            cc = os.environ.get("CC", "cc")
            cmd = [cc, "-O3", *cflags, "-fopenmp", "-shared", "-fPIC", str(source), "-o", str(out)]
            subprocess.run(cmd, check=True, capture_output=True, text=True, timeout=120)
            os.replace(out, so)  # atomic: another process may be building the same file
    return ctypes.CDLL(str(so))


def _build(kernel: _Kernel) -> ctypes.CDLL:
    lib = compile_library(CSRC / kernel.source, kernel.cflags)
    lib.small_gemm_threads.argtypes = [ctypes.c_void_p] * 3 + [ctypes.c_int64] * 4
    lib.small_gemm_threads.restype = ctypes.c_int
    if hasattr(lib, "amx_init") and lib.amx_init() != 0:
        raise OSError("Linux refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM)")
    if hasattr(lib, "int8_linear"):
        lib.int8_linear.argtypes = [ctypes.c_void_p] * 6 + [ctypes.c_int64] * 4
        lib.int8_linear.restype = ctypes.c_int
    return lib


def kernel_dir() -> Path:
    """Where the built kernels are kept: $RSD_KERNEL_DIR, else ~/.cache/rsd/kernels (the home directory is
    looked up only without RSD_KERNEL_DIR: a service user may have none)."""
    configured = os.environ.get("RSD_KERNEL_DIR")
    if configured:
        return Path(configured)
    try:
        return Path.home() / ".cache" / "rsd" / "kernels"
    except RuntimeError as e:  # no HOME and no passwd entry
        raise RuntimeError("no home directory for ~/.cache/rsd/kernels: set RSD_KERNEL_DIR") from e


# RSD_SMALL_GEMM, the kernels a process may run (each also needs its CPU flags and a compiler):
SETTINGS = {
    "1": "every kernel the CPU runs (the default)",
    "0": "none: every caller keeps torch's path (an A/B of the kernels through the services)",
    "no-amx": "all but the AMX one (an A/B of the two bf16 kernels)",
    "avx2": "those an AVX2-only CPU runs (float32): that machine's kernel choice, to test it on any CPU",
}
AVX2_FLAGS = frozenset({"avx2", "fma"})  # what an AVX2-only x86-64 CPU lists of the kernels' flags
_BUILD_HINT = " (a kernel is built by a C compiler, $CC or cc, in a writable $RSD_KERNEL_DIR or ~/.cache/rsd/kernels)"


def available(dtype: torch.dtype = torch.float32) -> bool:
    """Whether a kernel for weights of `dtype` runs on this machine (built on first call; the choice and the
    reasons for it are logged once). float32 needs AVX2+FMA, bfloat16 AMX-BF16 or else AVX512-BF16, int8
    AVX512-VNNI; all a C compiler and a writable kernel_dir() (or the kernel built there already). Where
    none can run, callers keep torch's path (F.linear, fbgemm's int8): the same law, slower. RSD_SMALL_GEMM
    in the environment narrows the choice (SETTINGS)."""
    with _lock:
        if dtype not in _libs and dtype not in _failed:
            setting = os.environ.get("RSD_SMALL_GEMM", "1")
            reasons = [] if setting in SETTINGS else [f"RSD_SMALL_GEMM={setting!r} unknown, taken as 1"]
            flags = _cpu_flags() & AVX2_FLAGS if setting == "avx2" else _cpu_flags()
            unbuilt = False  # a kernel the CPU runs could not be built or loaded: worth a warning
            for kernel in _KERNELS.get(dtype, ()):
                missing = [f for f in kernel.cpu_flags if f not in flags]
                if setting == "0":
                    reasons.append("RSD_SMALL_GEMM=0")
                    break
                if setting == "no-amx" and kernel.name.startswith("amx"):
                    reasons.append(f"{kernel.name}: RSD_SMALL_GEMM=no-amx")
                elif missing and setting == "avx2":
                    reasons.append(f"{kernel.name}: RSD_SMALL_GEMM=avx2 (needs {', '.join(missing)})")
                elif missing:
                    reasons.append(f"{kernel.name}: the CPU lacks {', '.join(missing)}")
                else:
                    try:
                        _libs[dtype], _names[dtype] = _build(kernel), kernel.name
                        break
                    except (OSError, RuntimeError, subprocess.SubprocessError) as e:  # RuntimeError: kernel_dir()
                        unbuilt = True
                        detail = (getattr(e, "stderr", "") or str(e)).strip()
                        reasons.append(f"{kernel.name}: cannot build or load it: {detail}")
            if dtype in _libs:
                skipped = f" ({'; '.join(reasons)})" if reasons else ""
                log.info("small_gemm kernel for %s: %s%s", dtype, _names[dtype], skipped)
            else:
                _failed[dtype] = "; ".join(reasons) or f"no kernel for {dtype}"
                level, hint = (logging.WARNING, _BUILD_HINT) if unbuilt else (logging.INFO, "")
                log.log(level, "small_gemm kernel for %s off, torch's path instead: %s%s", dtype, _failed[dtype], hint)
        return dtype in _libs


def kernel_name(dtype: torch.dtype) -> str | None:
    """The kernel weights of `dtype` run on here ("amx-bf16", "avx512-bf16", "avx2", "avx512-vnni"), or None."""
    return _names.get(dtype) if available(dtype) else None


def preferred_rows(dtype: torch.dtype) -> int:
    """Up to how many rows models of this dtype should compute their linear layers here by default
    (load_model): 0 where no kernel runs; wherever one does, any number (ANY_ROWS), in calls of MAX_ROWS, so a
    row's bits never depend on how many rows share its forward (F.linear's do: MKL's float32 rows change with
    the row count). Up to MAX_ROWS rows each kernel beat F.linear where measured; above, AMX still does, while
    the AVX2 and AVX512-BF16 ones pay for the invariance on a prompt (a long prompt's linear layers take
    longer than F.linear's)."""
    return ANY_ROWS if available(dtype) else 0


ANY_ROWS = 1 << 30


def supports(x: Tensor, weight: Tensor) -> bool:
    """Whether small_gemm takes these operands: CPU tensors with a kernel here (float32 or bfloat16 rows and
    weights of that dtype; uint8 rows and int8 weights), K a multiple of its vector (8, 32, 64),
    1..MAX_ROWS rows."""
    kernel = _KERNELS.get(weight.dtype, (None,))[0]  # a dtype's kernels share their operand rules
    return (
        kernel is not None
        and x.dtype == kernel.x_dtype
        and x.device.type == weight.device.type == "cpu"
        and x.shape[-1] == weight.shape[1]
        and weight.shape[1] % kernel.k_multiple == 0
        and 0 < x.numel() // x.shape[-1] <= MAX_ROWS
        and available(weight.dtype)
    )


def small_gemm(x: Tensor, weight: Tensor, threads: int | None = None) -> Tensor:
    """x [R, K] @ weight[N, K]^T -> [R, N] (CPU; check `supports` first): float32 and bfloat16 in their
    dtype, uint8 rows times int8 weights as exact int32 sums. `threads` (default torch's thread count)
    split the N output columns; each thread streams its own part of the weight."""
    x, weight = x.contiguous(), weight.contiguous()
    (rows, k), n = x.shape, weight.shape[0]
    y = torch.empty(rows, n, dtype=_KERNELS[weight.dtype][0].y_dtype)
    threads = _threads(threads, n)
    if _libs[weight.dtype].small_gemm_threads(x.data_ptr(), weight.data_ptr(), y.data_ptr(), rows, k, n, threads):
        raise MemoryError(f"small_gemm: no memory to pack {rows} x {k} input rows")
    return y


def int8_linear(x: Tensor, weight: Tensor, w_scale: Tensor, w_shift: Tensor, bias: Tensor | None) -> Tensor:
    """A whole int8 linear layer (rsd_runtime.linear.Int8Linear's forward) in one call: x [R, K] float32 rows, each
    quantised by its own scale, times weight [N, K] int8 (scales w_scale [N] float32, w_shift [N] int32 =
    128 * the row sums) plus bias [N] float32 or None -> [R, N] float32. Needs available(torch.int8),
    K % 64 == 0 and R <= MAX_ROWS."""
    x = x.contiguous()
    (rows, k), n = x.shape, weight.shape[0]
    if not 0 < rows <= MAX_ROWS:  # the C side keeps one scale a row in a MAX_ROWS-long array
        raise ValueError(f"int8_linear takes 1..{MAX_ROWS} rows, got {rows}: split them")
    y = torch.empty(rows, n)
    if _libs[torch.int8].int8_linear(
        x.data_ptr(), weight.data_ptr(), w_scale.data_ptr(), w_shift.data_ptr(),
        bias.data_ptr() if bias is not None else None, y.data_ptr(), rows, k, n, _threads(None, n),
    ):  # fmt: skip
        raise MemoryError(f"int8_linear: no memory to quantise {rows} x {k} input rows")
    return y


def _threads(threads: int | None, n: int) -> int:
    """Threads for N output columns: the caller's count (default torch's), at most one per 256 columns."""
    return max(1, min(threads or torch.get_num_threads(), n // 256))
