"""The small-row CPU kernels (float32 AVX2; bfloat16 on AMX or AVX512-BF16): float rounding away from F.linear,
a row's value independent of its batch and of the thread count, and the model path that uses them. Every
kernel this CPU runs is tested, not only the one a dtype picks (on an AMX Xeon both bf16 kernels)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from rsd_runtime import small_gemm as sg

DTYPES = [
    pytest.param(torch.float32, marks=pytest.mark.skipif(not sg.available(torch.float32), reason="no AVX2+FMA")),
    pytest.param(
        torch.bfloat16, marks=pytest.mark.skipif(not sg.available(torch.bfloat16), reason="no AVX512-BF16 CPU")
    ),
]
K = {torch.float32: 64, torch.bfloat16: 96}  # multiples of each kernel's vector (8 / 32), more than one vector


def _runs_here(kernel) -> bool:
    return sg.available(kernel.x_dtype) and all(f in sg._cpu_flags() for f in kernel.cpu_flags)


KERNELS = [
    pytest.param(kernel, id=kernel.name, marks=pytest.mark.skipif(not _runs_here(kernel), reason="not on this CPU"))
    for dtype in (torch.float32, torch.bfloat16)
    for kernel in sg._KERNELS[dtype]
]


@pytest.fixture
def kernel(request, monkeypatch):
    """small_gemm on the given kernel of its dtype (built here if the dtype picked another one)."""
    kernel = request.param
    monkeypatch.setitem(sg._libs, kernel.x_dtype, sg._build(kernel))
    return kernel


def _close(y, ref, dtype):
    if dtype == torch.float32:
        torch.testing.assert_close(y, ref.float(), rtol=1e-5, atol=1e-5)
    else:  # float32 sums in another order, then one rounding to bfloat16: within one bf16 ulp of the exact sum
        exact = ref.float()
        assert (y.float() - exact).abs().le(exact.abs() * 2**-8 + 1e-6).all()


@pytest.mark.parametrize("kernel", KERNELS, indirect=True)
@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 12, 13, 16, 17, 40, 64])
@pytest.mark.parametrize("n", [1, 2, 3, 5, 7, 256, 1000])
def test_matches_f_linear_to_rounding(kernel, rows, n):
    """Row counts across the AMX kernel's groups of 16 rows, output columns past its blocks of 16."""
    dtype = kernel.x_dtype
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    x, w = torch.randn(rows, K[dtype], generator=gen), torch.randn(n, K[dtype], generator=gen)
    x, w = x.to(dtype), w.to(dtype)
    assert sg.supports(x, w)
    y = sg.small_gemm(x, w)
    assert y.dtype == dtype and y.shape == (rows, n)
    _close(y, F.linear(x.double(), w.double()), dtype)


@pytest.mark.parametrize("kernel", KERNELS, indirect=True)
@pytest.mark.parametrize("rows", [13, 37])
def test_a_row_is_the_same_in_any_batch_and_any_thread_count(kernel, rows):
    dtype = kernel.x_dtype
    gen = torch.Generator().manual_seed(rows)
    x = torch.randn(rows, 2 * K[dtype], generator=gen).to(dtype)
    w = torch.randn(1030, 2 * K[dtype], generator=gen).to(dtype)
    whole = sg.small_gemm(x, w, threads=1)
    assert torch.equal(whole, sg.small_gemm(x, w, threads=2))
    for r in range(rows):
        assert torch.equal(whole[r], sg.small_gemm(x[r : r + 1], w, threads=1)[0])
        assert torch.equal(whole[r], sg.small_gemm(x[r:], w, threads=3)[0])


@pytest.mark.parametrize("kernel", [k for k in KERNELS if k.values[0].x_dtype == torch.bfloat16], indirect=True)
def test_bf16_rounds_to_nearest_even_and_keeps_nan_and_inf(kernel):
    one = torch.zeros(1, 32, dtype=torch.bfloat16)
    one[0, 0] = 1.0
    # w[:, 0] holds values whose float32 sums sit exactly between two bf16 numbers, or carry inf/nan
    values = torch.tensor([1 + 2**-8, 1 + 3 * 2**-8, float("inf"), float("nan"), -0.0], dtype=torch.float32)
    w = torch.zeros(len(values), 32, dtype=torch.bfloat16)
    w[:, 0] = values.bfloat16()  # bf16 of 1 + 2^-8 ties to 1.0, of 1 + 3 * 2^-8 to 1 + 2^-6 (even mantissas)
    y = sg.small_gemm(one, w)[0]
    assert torch.equal(y[:3], F.linear(one.float(), w.float())[0, :3].bfloat16())
    assert y[3].isnan()


@pytest.mark.skipif(not sg.available(torch.int8), reason="no AVX512-VNNI CPU")
@pytest.mark.parametrize("rows", [1, 4, 6, 7, 13, 64])
def test_int8_sums_exactly_in_any_batch_and_thread_count(rows):
    """uint8 rows times int8 weights: exact int32 sums (the extremes included), the same per row whatever
    rows and threads share the call."""
    gen = torch.Generator().manual_seed(rows)
    x = torch.randint(0, 256, (rows, 192), dtype=torch.uint8, generator=gen)
    w = torch.randint(-128, 128, (1001, 192), dtype=torch.int8, generator=gen)
    x[0], w[0] = 255, -128  # the largest products
    assert sg.supports(x, w) and not sg.supports(x.char(), w)  # the rows must be uint8
    y = sg.small_gemm(x, w, threads=1)
    assert y.dtype == torch.int32 and torch.equal(y.long(), x.long() @ w.long().T)
    assert torch.equal(sg.small_gemm(x, w, threads=2), y)
    assert torch.equal(sg.small_gemm(x[-1:], w)[0], y[-1])


def test_refuses_what_it_cannot_take():
    w = torch.randn(16, 64)
    assert not sg.supports(torch.randn(2, 64, dtype=torch.float16), w.half())  # no float16 kernel
    assert not sg.supports(torch.randn(2, 64).bfloat16(), w)  # mixed dtypes
    assert not sg.supports(torch.randn(sg.MAX_ROWS + 1, 64), w)
    assert not sg.supports(torch.randn(2, 60), torch.randn(16, 60))  # K not a multiple of 8
    assert not sg.supports(torch.randn(2, 48).bfloat16(), torch.randn(16, 48).bfloat16())  # nor of 32 in bf16
    assert not sg.supports(torch.zeros(2, 96, dtype=torch.uint8), torch.zeros(16, 96, dtype=torch.int8))  # nor of 64


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_model_uses_the_kernel_and_keeps_its_logits(dtype, tmp_path, monkeypatch):
    """load_model puts a CPU model of either dtype on the kernel by default, and its logits stay within
    rounding of F.linear's."""
    if not sg.preferred_rows(dtype):
        pytest.skip(f"load_model keeps F.linear for {dtype} on this CPU")
    from transformers import LlamaConfig, LlamaForCausalLM

    from rsd_runtime.linear import set_linear_kernel
    from rsd_runtime.models import load_model

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4
    )
    LlamaForCausalLM(config).save_pretrained(tmp_path)
    model = load_model(tmp_path, "cpu", {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype])
    layer = model.model.layers[0].mlp.up_proj
    assert layer.small_batch_rows == sg.preferred_rows(dtype) == sg.ANY_ROWS and layer.small_gemm
    calls = []
    original = sg.small_gemm
    monkeypatch.setattr(sg, "small_gemm", lambda *a, **k: calls.append(1) or original(*a, **k))
    ids = torch.randint(0, 128, (1, 6), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        kernel_logits = model(ids).logits
    assert calls  # the kernel ran
    prompt = torch.randint(0, 128, (1, 150), generator=torch.Generator().manual_seed(2))
    calls.clear()
    with torch.no_grad():
        prompt_logits = model(prompt).logits
    chunks = len(calls)  # a prompt above 64 rows: calls of 64 rows, never F.linear (batch_variance)
    assert chunks == 3 * 7 * 2 + 3  # 150 rows in 3 calls: 7 layers a block, 2 blocks, the head
    set_linear_kernel(model, "f_linear")
    with torch.no_grad():
        blas_logits, blas_prompt_logits = model(ids).logits, model(prompt).logits
    tol = 1e-4 if dtype == torch.float32 else 0.1
    torch.testing.assert_close(kernel_logits.float(), blas_logits.float(), rtol=tol, atol=tol)
    torch.testing.assert_close(prompt_logits.float(), blas_prompt_logits.float(), rtol=tol, atol=tol)


def test_rsd_small_gemm_0_turns_the_kernels_off():
    """The A/B switch: every process started with RSD_SMALL_GEMM=0 keeps torch's path (checked in a child:
    this process has built its kernels already)."""
    code = "import torch; from rsd_runtime import small_gemm as sg; print(sg.available(), sg.available(torch.bfloat16))"
    env = {**os.environ, "RSD_SMALL_GEMM": "0"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["False", "False"]


def test_rsd_small_gemm_no_amx_keeps_the_avx512_bf16_kernel():
    """The bf16 A/B switch: RSD_SMALL_GEMM=no-amx skips the AMX kernel (which an AMX CPU picks by default)."""
    code = "import torch; from rsd_runtime import small_gemm as sg; print(sg.kernel_name(torch.bfloat16))"
    names = {}
    for setting in ("1", "no-amx"):
        env = {**os.environ, "RSD_SMALL_GEMM": setting}
        out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
        names[setting] = out.stdout.strip()
    flags = sg._cpu_flags()
    avx512 = "avx512-bf16" if "avx512_bf16" in flags else "None"
    assert names == {"1": "amx-bf16" if "amx_bf16" in flags and "amx_tile" in flags else avx512, "no-amx": avx512}


# --------------------------------------------------------------- the portable fallback and the AVX2 choice

REPO = Path(__file__).resolve().parents[2]

# A child that loads a tiny pair (argv[1:3]) and decodes greedily with a float and an int8 drafter, as a
# service user without a home directory (Path.home() raises): the kernel each dtype runs on, the int8
# layer's type, and whether both outputs equal the target's own greedy output through F.linear.
_LOADS_AND_GENERATES = """
import json, logging, pathlib, sys
def no_home(cls):
    raise RuntimeError("Could not determine home directory.")
pathlib.Path.home = classmethod(no_home)
logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
import torch
from rsd.methods import Method
from rsd.sampling import SamplingParams
from rsd_runtime import small_gemm
from rsd_runtime.generator import SpeculativeGenerator
from rsd_runtime.models import load_model, quantize_draft
from rsd_runtime.runner import ModelRunner
torch.set_num_threads(1)
draft_dir, target_dir = sys.argv[1:3]
target, reference = load_model(target_dir), load_model(target_dir, small_batch_rows=0)  # reference: F.linear
prompt, greedy = [3, 5, 7, 9], []
with torch.inference_mode():
    for _ in range(12):
        greedy.append(int(reference(torch.tensor([prompt + greedy])).logits[0, -1].argmax()))
same = []
for quantize in ("none", "int8"):
    draft = load_model(draft_dir)
    quantize_draft(draft, quantize)
    gen = SpeculativeGenerator(ModelRunner(target, 128), ModelRunner(draft, 128))
    out = gen.generate(prompt, Method.parse("rsd_s", "2x2"), SamplingParams(0), max_new_tokens=12)
    same.append(out.token_ids == greedy)
kernels = [small_gemm.kernel_name(d) for d in (torch.float32, torch.bfloat16, torch.int8)]
print(json.dumps({"kernels": kernels, "int8_layer": draft.lm_head._get_name(), "same": same}))
"""


@pytest.fixture(scope="module")
def tiny_pair(tmp_path_factory):
    from rsd_tools.tiny import build_tiny_pair

    return build_tiny_pair(tmp_path_factory.mktemp("fallback"), "qwen2")


def _loads_and_generates(tiny_pair, kernel_dir: Path, **env) -> tuple[dict, str]:
    from tests.fixtures import unprivileged

    env = {**os.environ, "PYTHONPATH": str(REPO), "RSD_KERNEL_DIR": str(kernel_dir), **env}
    env.pop("HOME", None)
    out = unprivileged.run([sys.executable, "-c", _LOADS_AND_GENERATES, *map(str, tiny_pair)], env=env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1]), out.stderr


def _fallback_line(dtype: str, err: str) -> str:
    lines = [line for line in err.splitlines() if f"small_gemm kernel for torch.{dtype} off" in line]
    assert len(lines) == 1, err  # one line a dtype, whatever asked how many times
    return lines[0]


@pytest.mark.skipif(not sg.available(torch.float32), reason="no kernel runs on this CPU: nothing to fall back from")
@pytest.mark.parametrize("missing", ["compiler", "writable cache"])
def test_fallback_without_a_compiler_or_a_writable_cache_is_torchs_path(tiny_pair, tmp_path, missing):
    """No C compiler ($CC names a missing one), or an empty kernel dir it may not write (0555): every kernel
    is off with one warning a dtype that says why, models load on F.linear (int8 on fbgemm) and decode
    exactly the target's greedy output; no home directory is needed with RSD_KERNEL_DIR set."""
    kernel_dir = tmp_path / "kernels"
    kernel_dir.mkdir()
    env = {"CC": str(tmp_path / "no-such-cc")} if missing == "compiler" else {}
    if missing == "writable cache":
        kernel_dir.chmod(0o555)
    result, err = _loads_and_generates(tiny_pair, kernel_dir, **env)
    assert result == {"kernels": [None, None, None], "int8_layer": "DynamicQuantizedLinear", "same": [True, True]}
    line = _fallback_line("float32", err)
    why = "No such file or directory" if missing == "compiler" else "Permission denied"
    assert line.startswith("WARNING rsd_runtime.small_gemm:") and "avx2: cannot build or load it:" in line
    assert why in line and "torch's path instead" in line
    assert "no-such-cc" in line if missing == "compiler" else str(kernel_dir) in line
    assert list(kernel_dir.iterdir()) == []  # nothing left behind


@pytest.mark.skipif(not sg.available(torch.float32), reason="no kernel runs on this CPU")
def test_fallback_not_needed_where_a_read_only_cache_holds_the_kernels(tiny_pair, tmp_path):
    """The kernels built before (this process's, copied) in a read-only dir: loaded as they are, no compiler
    needed; the choice is this process's own (RSD_SMALL_GEMM included)."""
    import shutil

    kernel_dir = tmp_path / "kernels"
    kernel_dir.mkdir()
    for so in sg.kernel_dir().glob("small_gemm_*.so"):
        shutil.copy(so, kernel_dir)
    kernel_dir.chmod(0o555)
    result, err = _loads_and_generates(tiny_pair, kernel_dir, CC=str(tmp_path / "no-such-cc"))
    expected = [sg.kernel_name(d) for d in (torch.float32, torch.bfloat16, torch.int8)]
    assert result["kernels"] == expected and result["same"] == [True, True], err
    assert result["int8_layer"] == ("Int8Linear" if expected[2] else "DynamicQuantizedLinear")


def test_the_kernel_dir_needs_no_home_when_rsd_kernel_dir_is_set(monkeypatch, tmp_path):
    def no_home(cls):
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(Path, "home", classmethod(no_home))
    monkeypatch.setenv("RSD_KERNEL_DIR", str(tmp_path))
    assert sg.kernel_dir() == tmp_path
    monkeypatch.delenv("RSD_KERNEL_DIR")
    with pytest.raises(RuntimeError, match="set RSD_KERNEL_DIR"):
        sg.kernel_dir()


# What an AVX2-only CPU changes: no bf16 or int8 kernel (bf16 on F.linear, int8 on fbgemm), float32 on avx2.
AVX2_CHOICE_TESTS = [
    "tests/rsd_runtime/test_small_gemm.py",
    "tests/rsd_runtime/test_quantize.py::test_int8_replaces_every_linear_and_changes_the_draft_law",
    "tests/rsd_runtime/test_quantize.py::test_int8_drafter_keeps_greedy_output",
    "tests/rsd_runtime/test_quantize.py::test_options_compose_in_order_or_are_refused",
    "tests/rsd_runtime/test_quantize.py::test_int8_takes_the_vnni_kernel_where_it_runs_else_fbgemm",
]


@pytest.mark.skipif(os.environ.get("RSD_SMALL_GEMM") == "avx2", reason="this is the run under the AVX2 choice")
@pytest.mark.skipif("avx512f" not in sg._cpu_flags(), reason="no AVX-512 here: this whole run is the AVX2 choice")
def test_kernel_choice_tests_pass_under_the_avx2_choice(tmp_path):
    """RSD_SMALL_GEMM=avx2 makes this CPU choose its kernels as an AVX2-only one does (and torch's own
    dispatch is held to AVX2): the tests whose assertions follow the kernel choice pass under it, here."""
    env = {**os.environ, "RSD_SMALL_GEMM": "avx2", "ATEN_CPU_CAPABILITY": "avx2", "PYTHONPATH": str(REPO)}
    code = "import torch; from rsd_runtime import small_gemm as sg\n"
    code += "print(*(sg.kernel_name(d) for d in (torch.float32, torch.bfloat16, torch.int8)))"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.split() == ["avx2" if {"avx2", "fma"} <= sg._cpu_flags() else "None", "None", "None"]
    args = ["-m", "pytest", "-q", "-p", "no:cacheprovider", "--basetemp", str(tmp_path / "avx2"), *AVX2_CHOICE_TESTS]
    args += ["-k", "not fallback"]  # the fallback tests' children (a kernel dir of their own) need no second run
    out = subprocess.run([sys.executable, *args], cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert out.returncode == 0, out.stdout[-4000:]
    assert " passed" in out.stdout.splitlines()[-1] and "failed" not in out.stdout.splitlines()[-1]
