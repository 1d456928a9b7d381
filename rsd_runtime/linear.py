"""Linear layers for a handful of rows, as module classes that replace a model's nn.Linear children (the way
gpt-fast's quantize.py swaps in WeightOnlyInt8Linear): nothing is patched, `print(model)` shows which layer runs.

    SmallBatchLinear   an nn.Linear over the same weight and bias Parameters (tied weights stay tied) whose
                       forward, up to `small_batch_rows` rows, runs rsd_runtime.small_gemm's kernel (each weight
                       streamed once for all rows; a row's value the same in any batch) or weight @ x.T
    Int8Linear         a drafter's int8 layer on small_gemm's AVX512-VNNI kernel (quantize_draft puts it in)

as_plain_linear makes the layers that are a linear map under another class (GPT-2's Conv1D, Falcon's FalconLinear)
plain nn.Linear ones (load_model does on every device), use_small_batch_linear swaps SmallBatchLinear in (load_model
does on a CPU), plain_linear swaps it out again, set_small_batch_rows and set_linear_kernel change the swapped-in
layers of a loaded model.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import partial

import torch
from torch import Tensor
from transformers.pytorch_utils import Conv1D

from rsd_runtime import small_gemm

LINEAR_KERNELS = ("f_linear", "torch", "small_gemm")


class SmallBatchLinear(torch.nn.Linear):
    """An nn.Linear computed for at most small_batch_rows input rows on a path made for few rows.

    On CPU, F.linear with a handful of rows is far slower than the same product written the other way round,
    and a draft tree or a tree verification is exactly a handful of rows. With `small_gemm` True, float32 and
    bfloat16 rows take rsd_runtime.small_gemm where the CPU runs it (AVX2+FMA; AMX-BF16 or AVX512-BF16; and a
    compiler): it streams each weight once for all rows and gives a row the same value in any batch (above
    small_gemm.MAX_ROWS rows in calls of that many: models.batch_variance). Otherwise the product is
    weight @ x.T, rows above 4 padded to a multiple of 8 (an odd row count falls off MKL's fast path; zero rows
    change no other row), except 16-bit inputs of up to 8 rows, which keep F.linear (oneDNN's bf16 F.linear
    beats the transposed product there). Every path differs from F.linear by float rounding only. Above
    small_batch_rows rows (0: always) the layer is F.linear.

    It is an nn.Linear (isinstance checks, .weight, tied embeddings and pruning see the layer they expect),
    holding the very Parameters of the layer it replaces."""

    def __init__(self, linear: torch.nn.Linear, small_batch_rows: int, use_kernel: bool = True):
        super().__init__(linear.in_features, linear.out_features, bias=linear.bias is not None, device="meta")
        self.weight, self.bias = linear.weight, linear.bias
        self.small_batch_rows = small_batch_rows
        self.small_gemm = use_kernel  # whether rows go to rsd_runtime.small_gemm where it takes them

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, x.shape[-1])  # [R, in]
        n = rows.shape[0]
        if n > self.small_batch_rows:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        if self.small_gemm and small_gemm.supports(rows[: small_gemm.MAX_ROWS], self.weight):
            # [R, out]: each weight read once for all rows (a prompt, where small_batch_rows allows it, in calls)
            out = _in_calls(partial(small_gemm.small_gemm, weight=self.weight), rows)
            out = out + self.bias if self.bias is not None else out
            return out.reshape(*x.shape[:-1], out.shape[-1])
        if n > small_gemm.MAX_ROWS:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        if n <= 8 and x.dtype != torch.float32:
            return torch.nn.functional.linear(x, self.weight, self.bias)
        if n > 4 and n % 8:  # BLAS is much faster on a multiple of 8 columns: 13 rows cost more than 16
            rows = torch.cat([rows, rows.new_zeros(8 - n % 8, rows.shape[1])])
        out = (self.weight @ rows.T).T[:n]  # [R, out]
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], out.shape[-1])

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, small_batch_rows={self.small_batch_rows}, small_gemm={self.small_gemm}"


class Int8Linear(torch.nn.Module):
    """A drafter's linear layer in int8 on rsd_runtime.small_gemm's AVX512-VNNI kernel: weights symmetric per
    output channel, activations symmetric per row and shifted by 128 into uint8 (vpdpbusd multiplies uint8
    by int8), the shift taken back exactly in int32:

        y[r, j] = x_scale[r] * w_scale[j] * (sum_k (xq[r, k] + 128) * wq[j, k] - 128 * sum_k wq[j, k]) + bias[j]

    A row's scale is its own, so its output is the same whatever rows share the forward (fbgemm's dynamic
    quantisation scales a whole call at once), and stays closer to the float layer. One C call a layer
    (small_gemm.int8_linear: quantise, multiply, scale) streams the int8 weights once for all rows. Float32 in
    and out; more than small_gemm.MAX_ROWS rows (a prompt) go through in chunks, each row giving the same
    values."""

    def __init__(self, linear: torch.nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight = linear.weight.detach().float()  # [N, K]
        w_scale = weight.abs().amax(dim=1).clamp(min=1e-12) / 127  # [N]
        weight_int8 = torch.round(weight / w_scale[:, None]).clamp(-127, 127).to(torch.int8)  # [N, K]
        self.register_buffer("weight_int8", weight_int8)
        self.register_buffer("w_scale", w_scale)
        self.register_buffer("w_shift", 128 * weight_int8.sum(dim=1, dtype=torch.int32))  # [N]
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach().float())

    @staticmethod
    def takes(linear: torch.nn.Linear) -> bool:
        """Whether the kernel runs here (AVX512-VNNI, a compiler) and takes this layer (K % 64 == 0, CPU)."""
        device = next(linear.buffers()).device if not hasattr(linear, "weight") else linear.weight.device  # GGUF
        return device.type == "cpu" and linear.in_features % 64 == 0 and small_gemm.available(torch.int8)

    def forward(self, x: Tensor) -> Tensor:
        rows = x.reshape(-1, self.in_features)  # [R, K]
        rows = rows if rows.dtype == torch.float32 else rows.float()
        args = (self.weight_int8, self.w_scale, self.w_shift, self.bias)
        out = _in_calls(lambda c: small_gemm.int8_linear(c, *args), rows)  # [R, N]
        out = out.view(*x.shape[:-1], self.out_features)
        return out if out.dtype == x.dtype else out.to(x.dtype)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def _in_calls(kernel: Callable[[Tensor], Tensor], rows: Tensor) -> Tensor:
    """kernel over rows [R, K] in calls of at most small_gemm.MAX_ROWS rows (what its kernels take) -> [R, N];
    a draft or a tree is one call (no split and concatenation: a layer costs microseconds of Python)."""
    if rows.shape[0] <= small_gemm.MAX_ROWS:
        return kernel(rows)
    return torch.cat([kernel(c) for c in rows.split(small_gemm.MAX_ROWS)])


def replace_linear(
    model: torch.nn.Module, kinds: tuple[type, ...], make: Callable[[torch.nn.Module], torch.nn.Module]
) -> int:
    """Replace every child of `model` (at any depth) whose type is exactly one of `kinds` with make(child); a
    layer held by two parents gets one replacement. Returns the number of layers replaced."""
    made: dict[int, torch.nn.Module] = {}
    for path, child in list(model.named_modules(remove_duplicate=False)):  # every place a layer is held
        if path and type(child) in kinds:
            if id(child) not in made:
                made[id(child)] = make(child)
            parent, _, name = path.rpartition(".")
            setattr(model.get_submodule(parent), name, made[id(child)])
    return len(made)


def as_plain_linear(model: torch.nn.Module) -> int:
    """Make every layer that computes x @ W.T + b under a class of its own an nn.Linear, so the layer kernels
    (SmallBatchLinear, Int8Linear) take it and a row's value stops depending on its batch. Left as they are,
    GPT-2's Conv1D (torch.addmm over W [in, out]) and Falcon's FalconLinear run MKL, whose rows change with the
    row count (a one-row gemv and a gemm round differently), while batch_variance saw no nn.Linear to name:
    a seeded run could draw other tokens depending on which rows shared a forward. Conv1D's weight is stored
    transposed ([out, in], a copy); FalconLinear's Parameters are kept. The same function either way. Returns
    the number of layers replaced."""
    falcon = _falcon_linear()

    def plain(layer: torch.nn.Module) -> torch.nn.Linear:
        conv = isinstance(layer, Conv1D)
        weight = torch.nn.Parameter(layer.weight.detach().T.contiguous(), False) if conv else layer.weight
        linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=layer.bias is not None, device="meta")
        linear.weight, linear.bias = weight, layer.bias
        return linear

    return replace_linear(model, (Conv1D, *falcon), plain)


def _falcon_linear() -> tuple[type, ...]:
    try:
        from transformers.models.falcon.modeling_falcon import FalconLinear
    except ImportError:  # a transformers without Falcon
        return ()
    return (FalconLinear,)


def use_small_batch_linear(model: torch.nn.Module, max_rows: int = 64, kernel: str = "auto") -> int:
    """Make every nn.Linear child of `model` a SmallBatchLinear for inputs of at most max_rows rows (layers that
    are one already take the new setting); max_rows 0 leaves them F.linear (set_small_batch_rows turns them
    on again). kernel "auto" runs rsd_runtime.small_gemm where it takes the rows, "torch" keeps weight @ x.T.
    Returns the number of layers set."""
    if kernel not in ("auto", "torch"):
        raise ValueError(f"kernel must be auto or torch, got {kernel!r}")
    configured = [m for m in model.modules() if type(m) is SmallBatchLinear]
    for layer in configured:
        layer.small_batch_rows, layer.small_gemm = max_rows, kernel != "torch"
    swapped = replace_linear(model, (torch.nn.Linear,), lambda m: SmallBatchLinear(m, max_rows, kernel != "torch"))
    return len(configured) + swapped


def plain_linear(model: torch.nn.Module) -> int:
    """Undo use_small_batch_linear: every SmallBatchLinear child back to an nn.Linear over the same Parameters.
    Returns the number of layers replaced."""

    def plain(layer: SmallBatchLinear) -> torch.nn.Linear:
        linear = torch.nn.Linear(layer.in_features, layer.out_features, bias=layer.bias is not None, device="meta")
        linear.weight, linear.bias = layer.weight, layer.bias
        return linear

    return replace_linear(model, (SmallBatchLinear,), plain)


def set_small_batch_rows(model: torch.nn.Module, max_rows: int) -> None:
    """Change max_rows of every SmallBatchLinear of the model (0: plain F.linear everywhere)."""
    for m in model.modules():
        if isinstance(m, SmallBatchLinear):
            m.small_batch_rows = max_rows


def set_linear_kernel(model: torch.nn.Module, kernel: str, max_rows: int = 64) -> int:
    """Switch the model's SmallBatchLinear layers to one kernel for inputs of at most max_rows rows, so a
    benchmark compares kernels on one loaded model (rsd_bench.forward_cost):

        f_linear     torch's F.linear for any row count (max_rows 0)
        torch        weight @ x.T (use_small_batch_linear's kernel "torch")
        small_gemm   rsd_runtime.small_gemm where it takes the rows (float32: AVX2; bfloat16: AMX or AVX512-BF16),
                     else SmallBatchLinear's fallback

    All three agree up to float rounding. Returns the number of layers switched. A model with no
    SmallBatchLinear is refused for "torch" and "small_gemm": it would time F.linear under another kernel's name."""
    if kernel not in LINEAR_KERNELS:
        raise ValueError(f"kernel must be one of {', '.join(LINEAR_KERNELS)}, got {kernel!r}")
    layers = [m for m in model.modules() if isinstance(m, SmallBatchLinear)]
    if not layers and kernel != "f_linear":
        raise ValueError(f"kernel {kernel!r}: no linear layer of this model is patched (use_small_batch_linear)")
    for layer in layers:
        layer.small_batch_rows = 0 if kernel == "f_linear" else max_rows
        layer.small_gemm = kernel == "small_gemm"
    return len(layers)
