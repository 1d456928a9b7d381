"""A CUDA device emulated on the CPU, to catch device mixing on machines without a GPU.

Within `with emulated_cuda():`, `device="cuda"` (factories, `.to`, `.cuda()`) makes tensors that report
device cuda:0 and hold a CPU tensor inside; every torch call on them runs on those CPU tensors and
wraps its tensor results again. A call that meets a cuda tensor and a CPU tensor where real CUDA
refuses them raises as CUDA does ("Expected all tensors to be on the same device"). Unlike
FakeTensorMode, data-dependent calls (`.item()`, `.tolist()`, `float(t)`) work, so whole step paths
run. What CUDA allows stays allowed: 0-dim CPU tensors as scalars, copies between devices (`.to`,
`.cpu()`, `copy_`), CPU index tensors for a cuda tensor. The emulation is at the Python API (a torch
function mode): ops torch calls internally run on the CPU tensors unchecked, and kernels called
through ctypes are not reached.
"""

from __future__ import annotations

import contextlib

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten, tree_map

CUDA = torch.device("cuda", 0)
Tensor = torch.Tensor
_CROSS_DEVICE_OK = {Tensor.copy_, Tensor.__setitem__}  # CUDA copies a CPU source in
_INDEXING = {Tensor.__getitem__}  # a cuda tensor takes CPU index tensors


class EmulatedCudaTensor(Tensor):
    """Reports device cuda:0; `inner` is the CPU tensor holding its data."""

    inner: Tensor

    @staticmethod
    def __new__(cls, inner: Tensor):
        return Tensor._make_wrapper_subclass(
            cls, inner.shape, strides=inner.stride(), storage_offset=inner.storage_offset(), dtype=inner.dtype,
            device=CUDA, requires_grad=inner.requires_grad,
        )  # fmt: skip

    def __init__(self, inner: Tensor):
        self.inner = inner

    def __repr__(self) -> str:
        return f"EmulatedCudaTensor({self.inner!r})"

    __torch_function__ = torch._C._disabled_torch_function_impl  # the mode below does the checking

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):  # reached only past the mode
        return _wrap(func(*_unwrap(args), **_unwrap(kwargs or {})))


def _unwrap(x):
    return tree_map(lambda t: t.inner if isinstance(t, EmulatedCudaTensor) else t, x)


def _wrap(x):
    return tree_map(lambda t: EmulatedCudaTensor(t) if type(t) is Tensor or type(t) is torch.nn.Parameter else t, x)


def _is_cuda(device) -> bool:
    return device is not None and not isinstance(device, int) and torch.device(device).type == "cuda"


def _move_target(func, args, kwargs) -> tuple[torch.device | None, torch.dtype | None]:
    """The device and dtype a Tensor.to / .cuda / .cpu call asks for."""
    if func is Tensor.cuda:
        return CUDA, None
    if func is Tensor.cpu:
        return torch.device("cpu"), None
    device, dtype = kwargs.get("device"), kwargs.get("dtype")
    for a in args[1:]:
        if isinstance(a, (str, torch.device)):
            device = a
        elif isinstance(a, torch.dtype):
            dtype = a
        elif isinstance(a, Tensor):
            device, dtype = a.device, a.dtype
    return (torch.device(device) if device is not None else None), dtype


def _move(func, args, kwargs):
    device, dtype = _move_target(func, args, kwargs)
    src = args[0]
    on_cuda = isinstance(src, EmulatedCudaTensor)
    base = src.inner if on_cuda else src
    moved = base.to(dtype=dtype) if dtype is not None else base
    to_cuda = _is_cuda(device) or (device is None and on_cuda)
    if not to_cuda:
        return moved.clone() if moved is base and on_cuda else moved
    if on_cuda and moved is base:
        return src  # already there: .to returns self
    return EmulatedCudaTensor(moved.clone() if moved is base else moved)


class _EmulatedCuda(TorchFunctionMode):
    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in (Tensor.to, Tensor.cuda, Tensor.cpu):
            return _move(func, args, kwargs)
        if func == Tensor.device.__get__:  # method-wrappers compare equal, never identical
            return CUDA if isinstance(args[0], EmulatedCudaTensor) else func(*args, **kwargs)
        if func == Tensor.is_cuda.__get__:
            return isinstance(args[0], EmulatedCudaTensor)
        leaves = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, Tensor)]
        on_cuda = any(isinstance(x, EmulatedCudaTensor) for x in leaves)
        cpu = [x for x in leaves if not isinstance(x, EmulatedCudaTensor) and x.dim() > 0]
        if on_cuda and cpu and func not in _CROSS_DEVICE_OK:
            if func in _INDEXING and isinstance(args[0], EmulatedCudaTensor):
                pass
            else:
                raise RuntimeError(
                    "Expected all tensors to be on the same device, but found at least two devices, cuda:0 and cpu! "
                    f"(emulated CUDA, in {getattr(func, '__qualname__', func)})"
                )
        wants_cuda = _is_cuda(kwargs.get("device"))
        generators = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Generator)]
        if (on_cuda or wants_cuda) and any(g.device.type != "cuda" for g in generators):
            raise RuntimeError("Expected a 'cuda' device type for generator but found 'cpu' (emulated CUDA)")
        if not on_cuda and not wants_cuda:
            return func(*args, **kwargs)
        if wants_cuda:
            kwargs = {**kwargs, "device": torch.device("cpu")}
        out = func(*_unwrap(args), **_unwrap(kwargs))
        if func in (Tensor.copy_, Tensor.__setitem__) and not isinstance(args[0], EmulatedCudaTensor):
            return out
        return _wrap(out)


def module_to_emulated_cuda(module: torch.nn.Module) -> torch.nn.Module:
    """Module.to('cuda') for emulated CUDA: every parameter and buffer becomes an emulated tensor
    (Module.to itself checks shallow-copy compatibility, which a wrapper cannot pass)."""
    for m in module.modules():
        for name, t in list(m._parameters.items()):
            if t is not None:
                m._parameters[name] = EmulatedCudaTensor(t.detach())
        for name, t in list(m._buffers.items()):
            if t is not None:
                m._buffers[name] = EmulatedCudaTensor(t)
    return module


@contextlib.contextmanager
def emulated_cuda():
    """Within: device='cuda' makes emulated tensors (see the module docstring)."""
    with _EmulatedCuda():
        yield
