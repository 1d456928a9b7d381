"""The small-row CPU kernel: float rounding away from F.linear, and a row's value independent of its batch."""

import pytest
import torch
import torch.nn.functional as F

from rsd_runtime import small_gemm as sg

pytestmark = pytest.mark.skipif(not sg.available(), reason="no AVX2+FMA CPU or no C compiler here")


@pytest.mark.parametrize("rows", [1, 2, 5, 6, 7, 12, 13, 16, 64])
@pytest.mark.parametrize("n", [1, 2, 7, 256, 1000])
def test_matches_f_linear_to_rounding(rows, n):
    gen = torch.Generator().manual_seed(rows * 1000 + n)
    x, w = torch.randn(rows, 64, generator=gen), torch.randn(n, 64, generator=gen)
    assert sg.supports(x, w)
    torch.testing.assert_close(sg.small_gemm(x, w), F.linear(x, w), rtol=1e-5, atol=1e-5)


def test_a_row_is_the_same_in_any_batch_and_any_thread_count():
    gen = torch.Generator().manual_seed(0)
    x, w = torch.randn(13, 128, generator=gen), torch.randn(1030, 128, generator=gen)
    whole = sg.small_gemm(x, w, threads=1)
    assert torch.equal(whole, sg.small_gemm(x, w, threads=2))
    for r in range(13):
        assert torch.equal(whole[r], sg.small_gemm(x[r : r + 1], w, threads=1)[0])
        assert torch.equal(whole[r], sg.small_gemm(x[r:], w, threads=3)[0])


def test_refuses_what_it_cannot_take():
    w = torch.randn(16, 64)
    assert not sg.supports(torch.randn(2, 64, dtype=torch.bfloat16), w.bfloat16())
    assert not sg.supports(torch.randn(sg.MAX_ROWS + 1, 64), w)
    assert not sg.supports(torch.randn(2, 60), torch.randn(16, 60))  # K not a multiple of 8
