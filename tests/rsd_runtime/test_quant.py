"""The quantised kernel (csrc/quant_gemm.c) against gguf-py's dequantize, the reference of every GGUF weight:
its rebuild is the dequantised weight bit for bit, its products F.linear's on that weight up to summation
order, a row's bits its own whatever the batch. Every build this CPU runs is tested (avx512 and avx2 here on
an AVX-512 machine), on random blocks of each type (any bytes with finite scales are valid blocks)."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from rsd_runtime import quant

TYPES = {name: qtype for qtype, (name, _, _) in quant.KERNEL_TYPES.items()}
SCALE_BYTES = {"Q8_0": [(0, 2)], "Q5_0": [(0, 2)], "Q4_K": [(0, 2), (2, 4)], "Q6_K": [(208, 210)]}  # fp16 scales


def every_build(module):
    """A fixture: each test that takes it runs once on every build of `module`'s kernel this CPU runs."""
    params = [
        pytest.param(name, marks=pytest.mark.skipif(not module.runs_here(name), reason=f"no {name} CPU"))
        for name in module._BUILDS
    ]

    @pytest.fixture(params=params)
    def build(request, monkeypatch):
        lib = module.build(request.param)
        monkeypatch.setattr(module, "_library", lambda: (lib, request.param))
        return request.param

    return build


build = every_build(quant)  # every QuantLinear and rebuild of a test on each build of the kernel


def random_blocks(type_name: str, n: int, k: int, seed: int = 0) -> torch.Tensor:
    """uint8 [n, row_bytes]: random codes and scales, the fp16 scales set to finite values of weight size."""
    qtype = TYPES[type_name]
    _, elems, nbytes = quant.KERNEL_TYPES[qtype]
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (n, k // elems, nbytes), dtype=np.uint8)
    for lo, hi in SCALE_BYTES[type_name]:
        scales = (rng.random((n, k // elems)) * 0.02 + 1e-3).astype(np.float16)
        blocks[:, :, lo:hi] = scales.view(np.uint8).reshape(n, k // elems, 2)
    return torch.from_numpy(blocks.reshape(n, -1))


def k_for(type_name: str) -> int:
    return 512 if type_name in ("Q4_K", "Q6_K") else 96  # two K-quant blocks; three 32-blocks (a tail chunk)


@pytest.mark.parametrize("type_name", TYPES)
def test_rebuild_is_dequantize_bit_for_bit(build, type_name):
    k = k_for(type_name)
    blocks = random_blocks(type_name, 37, k)
    assert torch.equal(quant.rebuild(blocks, TYPES[type_name], k), quant.dequantize(blocks, TYPES[type_name], k))


@pytest.mark.parametrize("type_name", TYPES)
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 7, 13, 64, 65, 130])
def test_matches_f_linear_on_the_dequantised_weight(build, type_name, rows):
    k, n = k_for(type_name), 37  # columns past the kernel's blocks of 4
    blocks = random_blocks(type_name, n, k, seed=rows)
    bias = torch.randn(n)
    layer = quant.QuantLinear(blocks, TYPES[type_name], k, n, bias)
    x = torch.randn(rows, k, generator=torch.Generator().manual_seed(rows))
    w = quant.dequantize(blocks, TYPES[type_name], k).double()
    ref = F.linear(x.double(), w, bias.double())
    scale = F.linear(x.double().abs(), w.abs(), bias.double().abs())  # float32 sums round relative to this
    assert ((layer(x).double() - ref).abs() <= 1e-6 * scale).all()
    assert layer(x.reshape(1, rows, k)).shape == (1, rows, n)


@pytest.mark.parametrize("type_name", TYPES)
def test_a_rows_bits_do_not_depend_on_its_batch(build, type_name):
    """Tree rows equal one-token rows bit for bit: each row alone, in the register path (<= 3 rows) and the
    rebuilt-rows path, and past the 64-row calls, with 1 and 2 threads."""
    k, n = k_for(type_name), 300
    layer = quant.QuantLinear(random_blocks(type_name, n, k), TYPES[type_name], k, n)
    x = torch.randn(70, k, generator=torch.Generator().manual_seed(1))
    alone = torch.cat([layer(x[i : i + 1]) for i in range(70)])
    threads = torch.get_num_threads()
    try:
        for t in (1, 2):
            torch.set_num_threads(t)
            for rows in (2, 3, 4, 13, 64, 70):
                assert torch.equal(layer(x[:rows]), alone[:rows]), (t, rows)
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("type_name", TYPES)
def test_one_hot_rows_read_the_weight_exactly(build, type_name):
    """x = e_k gives column k of the dequantised weight exactly: the products use the rebuilt weight itself."""
    k, n = k_for(type_name), 9
    blocks = random_blocks(type_name, n, k, seed=3)
    picks = [0, 1, 31, 32, k // 2 + 5, k - 1]
    x = torch.zeros(len(picks), k)
    x[range(len(picks)), picks] = 1.0
    y = quant.QuantLinear(blocks, TYPES[type_name], k, n)(x)
    assert torch.equal(y, quant.dequantize(blocks, TYPES[type_name], k)[:, picks].T)


def test_refuses_what_it_cannot_compute(build):
    blocks = random_blocks("Q4_K", 4, 512)
    with pytest.raises(ValueError, match="do not hold"):
        quant.QuantLinear(blocks, TYPES["Q4_K"], 256, 4)  # the blocks hold 512-wide rows
    with pytest.raises(ValueError, match="no kernel"):
        quant.QuantLinear(blocks, 2, 512, 4)  # Q4_0: dequantised on load instead
    with pytest.raises(TypeError, match="float32"):
        quant.QuantLinear(blocks, TYPES["Q4_K"], 512, 4)(torch.randn(1, 512, dtype=torch.bfloat16))


def test_dequantized_layer_is_the_same_function(build):
    blocks, bias = random_blocks("Q6_K", 8, 256), torch.randn(8)
    layer = quant.QuantLinear(blocks, TYPES["Q6_K"], 256, 8, bias)
    plain = layer.dequantized()
    assert torch.equal(plain.weight, quant.dequantize(blocks, TYPES["Q6_K"], 256)) and torch.equal(plain.bias, bias)
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))  # unseeded, 1e-5 failed now and then
    torch.testing.assert_close(layer(x), plain(x), rtol=1e-5, atol=1e-5)
