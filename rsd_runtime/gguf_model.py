"""A Llama-family model straight from its GGUF file: quantised linear layers stay as the file holds them.

    model = load_gguf("model.Q4_K_M.gguf", attn_implementation="sdpa")   # a transformers model, eval mode

The config comes from the file's metadata (transformers' GGUF reader), the model is built on the meta device
and each tensor is put in place from the memory-mapped file: a linear weight of a type rsd_runtime.quant
computes from (Q8_0, Q5_0, Q4_K, Q6_K) becomes a QuantLinear over the file's bytes where the kernel runs
here (on a CPU); every other tensor (norms, biases, the embedding, F32/F16/BF16 weights, other GGML types,
or every weight where the kernel cannot run) is dequantised on load to exactly the float32 values gguf-py's
dequantize gives, as transformers' own GGUF loading does. Either way the model is the file's model: the same
float32 weights, in the served dtype where a caller asks for another one (a GPU in bfloat16, say).

Architectures: those of rsd_runtime.lean (llama, qwen2, mistral: llama.cpp names their tensors alike).
llama.cpp stores a Llama's q and k rows in the interleaved rotary order; they are put back in Hugging Face's
order row by row (the blocks run along K, so a row's bytes move whole). An output.weight absent means the head
is tied to the embedding (the head then computes from token_embd's blocks).
"""

from __future__ import annotations

import logging
import re
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from rsd_runtime import quant, quant_q8

log = logging.getLogger(__name__)

ARCHITECTURES = ("llama", "qwen2", "mistral")
_LAYER = {  # blk.N.<gguf name> -> model.layers.N.<module>
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
}
_TOP = {"token_embd": "model.embed_tokens", "output_norm": "model.norm", "output": "lm_head"}


def gguf_file(path: str | Path) -> Path | None:
    """The GGUF file `path` names: itself, or a folder's one .gguf file where the folder holds no other
    weights (safetensors, pytorch_model.bin); None for an ordinary checkpoint folder."""
    path = Path(path)
    if path.is_file() and path.suffix == ".gguf":
        return path
    if not path.is_dir() or any(path.glob("*.safetensors")) or any(path.glob("pytorch_model*.bin")):
        return None
    files = sorted(path.glob("*.gguf"))
    if len(files) > 1:
        raise ValueError(f"{path} holds {len(files)} GGUF files; name one: {[f.name for f in files]}")
    return files[0] if files else None


def gguf_config(file: Path):
    """The transformers config the file's metadata describes (refused for an architecture not in ARCHITECTURES)."""
    from transformers import AutoConfig
    from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

    values = dict(load_gguf_checkpoint(str(file), return_tensors=False)["config"])
    model_type = values.pop("model_type", None)
    if model_type not in ARCHITECTURES:
        raise ValueError(f"{file.name}: architecture {model_type!r} is not served from GGUF (only {ARCHITECTURES})")
    values.pop("_model_name_or_path", None)
    return AutoConfig.for_model(model_type, **values)


def _unpermute_rows(n_rows: int, heads: int) -> np.ndarray:
    """The row order that undoes llama.cpp's rotary permutation of a q or k weight (transformers' GGUF
    loader: reshape(heads, dim, 2, ...).swapaxes(1, 2))."""
    return np.arange(n_rows).reshape(heads, n_rows // heads // 2, 2).swapaxes(1, 2).reshape(-1)


def _module_name(gguf_name: str) -> tuple[str, str]:
    """'blk.3.attn_q.weight' -> ('model.layers.3.self_attn.q_proj', 'weight')."""
    stem, _, leaf = gguf_name.rpartition(".")
    m = re.fullmatch(r"blk\.(\d+)\.(\w+)", stem)
    if m and m.group(2) in _LAYER:
        return f"model.layers.{m.group(1)}.{_LAYER[m.group(2)]}", leaf
    if stem in _TOP:
        return _TOP[stem], leaf
    raise ValueError(f"tensor {gguf_name!r} has no place in the model")


def load_gguf(
    path: str | Path, attn_implementation: str = "sdpa", quantized: bool | None = None, numeric: str = "exact"
):
    """The model of GGUF file `path` (see the module docstring), float32 on the CPU, eval mode, no gradients.
    quantized: keep kernel-type linear weights as QuantLinear (None: where rsd_runtime.quant's kernel runs).
    numeric "q8_activations": those layers compute with int8 activations instead (rsd_runtime.quant_q8; an
    explicit choice of another function, refused where its kernel cannot run)."""
    from gguf import GGUFReader
    from transformers import AutoModelForCausalLM

    file = Path(path)
    config = gguf_config(file)
    layer_class = quant.QuantLinear
    numeric = quant_q8.check_numeric(numeric)
    if numeric == "q8_activations":
        if problem := quant_q8.unavailable_reason():
            raise ValueError(problem)
        quantized, layer_class = True, quant_q8.Q8ActivationLinear
    if quantized is None:
        quantized = quant.kernel_name() is not None
        if not quantized:
            log.info("%s: dequantised on load (no quantised kernel here: %s)", file.name, quant.unavailable_reason())
    with torch.device("meta"):
        model = AutoModelForCausalLM.from_config(config, dtype=torch.float32, attn_implementation=attn_implementation)
    reader = GGUFReader(str(file))
    tensors = {t.name: t for t in reader.tensors}
    if "output.weight" not in tensors and "token_embd.weight" in tensors:
        tensors = {**tensors, "output.weight": tensors["token_embd.weight"]}  # a tied head
    text = config.get_text_config()
    kv_heads = getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    permuted = {"attn_q": text.num_attention_heads, "attn_k": kv_heads} if text.model_type == "llama" else {}
    for name, t in sorted(tensors.items(), key=lambda item: not item[0].endswith(".bias")):  # biases first
        module_name, leaf = _module_name(name)
        module = model.get_submodule(module_name)
        qtype, shape = int(t.tensor_type), tuple(int(d) for d in reversed(t.shape))  # [N, K] or [N]
        data = np.asarray(t.data)
        kind = name.split(".")[-2]
        if kind in permuted:  # whole rows (a weight's blocks, a bias' values) back in Hugging Face's order
            data = data[_unpermute_rows(shape[0], permuted[kind])]
        if leaf == "weight" and isinstance(module, torch.nn.Linear) and quantized and qtype in quant.KERNEL_TYPES:
            blocks = torch.from_numpy(np.array(data))  # a copy: the model does not hold the file open
            bias = None if module.bias is None else module.bias.data  # set already (still meta if the file lacks it)
            _replace(model, module_name, layer_class(blocks, qtype, shape[1], shape[0], bias))
            continue
        setattr(module, leaf, torch.nn.Parameter(_dequantized(data, qtype, shape), requires_grad=False))
    _fresh_rotary(model, config)
    _check_complete(model, file)
    model.rsd_numeric = numeric
    return model.eval().requires_grad_(False)


def _dequantized(data: np.ndarray, qtype: int, shape: tuple[int, ...]) -> Tensor:
    """The float32 tensor of `shape` a GGUF tensor holds: F32 as is, F16 and BF16 widened (exact), a block type
    as quant.float_weight gives it."""
    if qtype == 0:
        return torch.from_numpy(np.array(data, dtype=np.float32)).reshape(shape)
    if qtype == 1:
        return torch.from_numpy(np.array(data).view(np.float16).astype(np.float32)).reshape(shape)
    if qtype == 30:  # BF16: the top half of a float32
        return torch.from_numpy(np.array(data).view(np.int16)).view(torch.bfloat16).float().reshape(shape)
    return quant.float_weight(np.ascontiguousarray(data), qtype, shape[-1]).reshape(shape)


def _replace(model: torch.nn.Module, name: str, layer: torch.nn.Module) -> None:
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, layer)


def _check_complete(model: torch.nn.Module, file: Path) -> None:
    """Refuse a model with a weight or bias the file did not give (still on the meta device)."""
    missing = [n for n, p in model.named_parameters() if p.device.type == "meta"]
    missing += [n for n, b in model.named_buffers() if b is not None and b.device.type == "meta"]
    if missing:
        more = " ..." if len(missing) > 5 else ""
        raise ValueError(f"{file.name} lacks tensors the model needs: {missing[:5]}{more}")


def _fresh_rotary(model: torch.nn.Module, config) -> None:
    """Rotary tables are computed at init, not read from a file: build them for real (the model was on meta)."""
    for name, module in list(model.named_modules()):
        if name.endswith("rotary_emb"):
            _replace(model, name, type(module)(config=config.get_text_config()))
