"""Write a Llama or Qwen2 checkpoint as a GGUF file of chosen types (the tests' quantised models).

    write_gguf(model, tokenizer, "out/model.gguf", types={"ffn_down": "Q6_K"}, default="Q4_K")

Tensor names, metadata and the Llama q/k row order follow llama.cpp's convert_hf_to_gguf.py, so the file
reads back through rsd_runtime.gguf_model as a real one does. Q8_0, Q5_0, BF16 and F16 blocks come from
gguf-py's quantize; gguf-py has no Q4_K or Q6_K quantiser, so those are written here: round to nearest
with one scale (and minimum) a sub-block, simpler than llama.cpp's search but valid blocks of the format,
whose dequantised values define the model (what a served GGUF model is, whatever quantiser made it).
Norms and biases stay F32, as llama.cpp keeps them.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

_NAMES = {  # Hugging Face module -> GGUF tensor name (blk.{i}. prefix for layers)
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
}
_TOP = {"model.embed_tokens": "token_embd", "model.norm": "output_norm", "lm_head": "output"}


def _q4_k(w: np.ndarray) -> np.ndarray:
    """float32 [n, 256 b] -> Q4_K blocks uint8 [n, 144 b] (ggml-common.h block_q4_K)."""
    x = w.reshape(-1, 8, 32).astype(np.float32)  # [blocks, sub-block, 32]
    lo = np.minimum(x.min(-1), 0)  # the format's minimum is subtracted: at most 0
    scale = (x.max(-1) - lo) / 15
    d = np.maximum(scale.max(-1), 1e-12) / 63  # [blocks]
    dmin = np.maximum(-lo.min(-1), 1e-12) / 63
    d16, dmin16 = d.astype(np.float16), dmin.astype(np.float16)
    sc = np.clip(np.round(scale / d16.astype(np.float32)[:, None]), 1, 63).astype(np.uint8)
    m = np.clip(np.round(-lo / dmin16.astype(np.float32)[:, None]), 0, 63).astype(np.uint8)
    step = d16.astype(np.float32)[:, None] * sc
    q = np.clip(np.round((x + (dmin16.astype(np.float32)[:, None] * m)[..., None]) / step[..., None]), 0, 15)
    q = q.astype(np.uint8).reshape(-1, 4, 2, 32)  # chunk c: sub-blocks 2c (low nibbles), 2c + 1 (high)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(-1, 128)
    s = np.zeros((x.shape[0], 12), np.uint8)  # 6-bit scales and mins, packed as get_scale_min_k4 reads them
    s[:, :4] = sc[:, :4] | ((sc[:, 4:] >> 4) << 6)
    s[:, 4:8] = m[:, :4] | ((m[:, 4:] >> 4) << 6)
    s[:, 8:] = (sc[:, 4:] & 15) | ((m[:, 4:] & 15) << 4)
    blocks = np.concatenate([d16.view(np.uint8).reshape(-1, 2), dmin16.view(np.uint8).reshape(-1, 2), s, qs], 1)
    return blocks.reshape(w.shape[0], -1)


def _q6_k(w: np.ndarray) -> np.ndarray:
    """float32 [n, 256 b] -> Q6_K blocks uint8 [n, 210 b] (ggml-common.h block_q6_K)."""
    x = w.reshape(-1, 16, 16).astype(np.float32)
    scale = np.abs(x).max(-1) / 31
    d16 = (np.maximum(scale.max(-1), 1e-12) / 127).astype(np.float16)
    sc = np.clip(np.round(scale / d16.astype(np.float32)[:, None]), 1, 127).astype(np.int8)
    step = d16.astype(np.float32)[:, None] * sc
    q = (np.clip(np.round(x / step[..., None]), -32, 31) + 32).astype(np.uint8).reshape(-1, 2, 128)  # [b, h, e]
    low, high = q & 15, q >> 4
    ql = (low[:, :, :64] | (low[:, :, 64:] << 4)).reshape(-1, 128)  # element 128 h + 64 t + l
    high = high.reshape(-1, 2, 4, 32)  # element 128 h + 32 u + l: bits 2u of qh[32 h + l]
    qh = (high[:, :, 0] | (high[:, :, 1] << 2) | (high[:, :, 2] << 4) | (high[:, :, 3] << 6)).reshape(-1, 64)
    blocks = np.concatenate([ql, qh, sc.view(np.uint8), d16.view(np.uint8).reshape(-1, 2)], 1)
    return blocks.reshape(w.shape[0], -1)


def quantize(w: np.ndarray, type_name: str) -> tuple[np.ndarray, int]:
    """A float32 [N, K] weight as the raw data of GGML type `type_name` and that type's id."""
    from gguf import GGMLQuantizationType
    from gguf.quants import quantize as gguf_quantize

    qtype = GGMLQuantizationType[type_name]
    if type_name == "F32":
        return w.astype(np.float32), qtype
    if type_name == "F16":
        return w.astype(np.float16), qtype
    if type_name in ("Q4_K", "Q6_K"):
        return (_q4_k if type_name == "Q4_K" else _q6_k)(w), qtype
    return gguf_quantize(w.astype(np.float32), qtype), qtype


def _permute(w: np.ndarray, heads: int) -> np.ndarray:
    """Hugging Face's q/k row order -> llama.cpp's interleaved rotary order (convert_hf_to_gguf's permute)."""
    return w.reshape(heads, 2, w.shape[0] // heads // 2, *w.shape[1:]).swapaxes(1, 2).reshape(w.shape)


def write_gguf(model, path: str | Path, types: dict[str, str] | None = None, default: str = "Q8_0") -> Path:
    """Write `model` (a Llama or Qwen2 causal LM) to GGUF file `path`. Each 2-D weight gets
    types[<gguf name>] (e.g. "attn_q", "output", "token_embd", or "blk.1.ffn_up" for one layer) or
    `default`; 1-D tensors F32. Returns the path."""
    import gguf

    config = model.config.get_text_config()
    arch = config.model_type
    if arch not in ("llama", "qwen2"):
        raise ValueError(f"write_gguf writes llama and qwen2 models, not {arch!r}")
    types = types or {}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    writer = gguf.GGUFWriter(str(path), arch)
    writer.add_name(f"tiny-{arch}")
    writer.add_block_count(config.num_hidden_layers)
    writer.add_context_length(config.max_position_embeddings)
    writer.add_embedding_length(config.hidden_size)
    writer.add_feed_forward_length(config.intermediate_size)
    writer.add_head_count(config.num_attention_heads)
    writer.add_head_count_kv(config.num_key_value_heads)
    writer.add_rope_freq_base(float(getattr(config, "rope_theta", None) or config.rope_parameters["rope_theta"]))
    writer.add_layer_norm_rms_eps(config.rms_norm_eps)
    writer.add_vocab_size(config.vocab_size)
    # A placeholder vocabulary (transformers' GGUF config reader wants one); the tokenizer is the folder's own.
    writer.add_tokenizer_model("gpt2")
    writer.add_token_list([f"t{i}" for i in range(config.vocab_size)])
    writer.add_token_types([1] * config.vocab_size)
    writer.add_bos_token_id(config.bos_token_id)
    writer.add_eos_token_id(config.eos_token_id)
    heads = {"attn_q": config.num_attention_heads, "attn_k": config.num_key_value_heads}
    for name, tensor in model.state_dict().items():
        module, _, leaf = name.rpartition(".")
        parts = module.split(".")
        if module in _TOP:
            gname, short = _TOP[module], _TOP[module]
        else:
            short = _NAMES[".".join(parts[3:])]
            gname = f"blk.{parts[2]}.{short}"
        data = tensor.detach().float().numpy()
        if arch == "llama" and short in heads:
            data = _permute(data, heads[short])
        if data.ndim == 1:
            writer.add_tensor(f"{gname}.{leaf}", data.astype(np.float32))
            continue
        raw, qtype = quantize(data, types.get(gname, types.get(short, default)))
        writer.add_tensor(f"{gname}.{leaf}", raw, raw_dtype=qtype)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path
