"""A lean forward for a drafter of the Llama family: the decoder written out in a few torch ops a layer.

A small drafter's forward of 1-4 tokens on a few CPU cores is as much Python and small-op overhead as
arithmetic: transformers' layers make many module calls and small ops a layer (RMSNorm, rotary, a cache
update, the attention dispatch). This forward computes the same function with fewer, larger steps:
q, k and v are one linear layer (and gate and up another) whose weights the original layers keep as
views, RMSNorm is torch's fused op, rotary runs on q and k at once, and attention is row_attention's
(each query row alone, so a row's bits do not depend on its batch) where it runs, else grouped_sdpa's.
It takes the same inputs as the model's own forward (ModelRunner and the packed drafter call it through
runner.model_logits) and writes the same cache.

For DRAFTERS, and for models in numeric "q8_activations": its logits equal the model's own up to float
rounding (and, with int8 activations, the per-row activation scales that rounding moves), which is harmless
where the law drawn from is the law sent with the tree, and is part of the definition of the q8 mode (a
target's law there is this runtime's computation of the file, the same in the verifier and the target alone:
load_model gives every such model this forward). A target in the exact mode stays on its own forward.
use_lean_forward checks the architecture, then compares both forwards on a small tree and refuses (returns
the reason) when they disagree; each forward's rows are their own (row_attention, per-row kernels), so a tree
row equals the one-token row bit for bit either way.

Where it lives: use_lean_forward sets the model's plain attribute `rsd_lean` (a LeanDecoder, not an
nn.Module, so model.modules() and model.parameters() stay the model's own: quantisation, pruning and the
kernel switches see each layer once); lean_decoder(model) reads it. Nothing else touches the attribute.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.nn.functional as F
from torch import Tensor

from rsd_runtime import quant_q8, row_attention
from rsd_runtime.attention import check_model, probe_inputs, relative_logit_error
from rsd_runtime.kvcache import SequenceKVCache
from rsd_runtime.linear import Int8Linear, SmallBatchLinear

log = logging.getLogger(__name__)

# Decoders whose layers are exactly: RMSNorm, q/k/v (optional bias), rotary, attention, o, residual,
# RMSNorm, SiLU-gated MLP, residual; embeddings unscaled.
LEAN_MODEL_TYPES = ("llama", "qwen2", "mistral")
_RELATIVE_TOLERANCE = 0.05  # of the probe's logits against the model's own forward (int8 rounding included)


def lean_unsupported(model: torch.nn.Module) -> str:
    """Why use_lean_forward cannot run this model ("" when it can)."""
    config = model.config.get_text_config()
    if os.environ.get("RSD_LEAN_FORWARD", "1") == "0":
        return "RSD_LEAN_FORWARD=0"
    if config.model_type not in LEAN_MODEL_TYPES:
        return f"model_type {config.model_type!r} is not one of {LEAN_MODEL_TYPES}"
    if getattr(config, "hidden_act", "silu") != "silu":
        return f"hidden_act {config.hidden_act!r} (the lean MLP is SiLU-gated)"
    if len(set(getattr(config, "layer_types", None) or ["full_attention"])) > 1:
        return "layers of more than one attention type (one mask serves every lean layer)"
    base = getattr(model, "model", None)
    if base is None or not all(hasattr(base, a) for a in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return f"{type(model).__name__} has no model.embed_tokens / layers / norm / rotary_emb"
    return ""


class _Fused:
    """The linear layers `names` of `owner`, over the same input, as one call: their outputs side by side. The
    layers stay the owner's, their weights turned into views of the fused ones (no second copy); the fused
    layer follows the first one's small-batch settings at each call (set_small_batch_rows, set_linear_kernel)."""

    def __init__(self, owner: torch.nn.Module, names: tuple[str, ...]):
        parts = [getattr(owner, n) for n in names]
        self.owner, self.first = owner, names[0]
        self.sizes = [p.out_features for p in parts]
        if all(type(p) is Int8Linear for p in parts):
            fused = Int8Linear.__new__(Int8Linear)
            torch.nn.Module.__init__(fused)
            fused.in_features, fused.out_features = parts[0].in_features, sum(self.sizes)
            for name in ("weight_int8", "w_scale", "w_shift", "bias"):
                values = [getattr(p, name) for p in parts]
                fused.register_buffer(name, None if values[0] is None else torch.cat(values))
                if values[0] is not None:
                    for p, view in zip(parts, getattr(fused, name).split(self.sizes), strict=True):
                        setattr(p, name, view)
        elif all(type(p) in (torch.nn.Linear, SmallBatchLinear) for p in parts):
            weight = torch.cat([p.weight for p in parts])
            has_bias = parts[0].bias is not None
            linear = torch.nn.Linear(weight.shape[1], weight.shape[0], bias=has_bias, device=weight.device)
            linear.to(weight.dtype).requires_grad_(False)
            linear.weight.copy_(weight)
            if has_bias:
                linear.bias.copy_(torch.cat([p.bias for p in parts]))
            for name in ("weight", "bias") if has_bias else ("weight",):
                for p, view in zip(parts, getattr(linear, name).split(self.sizes), strict=True):
                    setattr(p, name, torch.nn.Parameter(view, requires_grad=False))
            fused = SmallBatchLinear(linear, 0)
        else:  # int8 activations: one call where the parts share a type (each column's bits its own); else,
            # and for torch's dynamic int8 layers, one by one
            fused = quant_q8.Q8ActivationLinear.fuse(parts) if type(parts[0]) is quant_q8.Q8ActivationLinear else None
        self.fused, self.names = fused, names

    def __call__(self, x: Tensor) -> Tensor:  # [n, K] -> [n, Σ out]
        if isinstance(self.fused, quant_q8.Q8ActivationLinear) and getattr(self.owner, self.first).exact:
            self.fused.exact = True  # within exact_layers (the load-time probe): the parts' exact computation
            try:
                return self.fused(x)
            finally:
                self.fused.exact = False
        if isinstance(self.fused, SmallBatchLinear):
            first = getattr(self.owner, self.first)
            self.fused.small_batch_rows = getattr(first, "small_batch_rows", 0)
            self.fused.small_gemm = getattr(first, "small_gemm", False)
        if self.fused is not None:
            return self.fused(x)
        return torch.cat([getattr(self.owner, n)(x) for n in self.names], dim=-1)


class LeanDecoder:
    """The model's decoder as a lean forward: see the module docstring. It reads the model's modules at each
    call (a layer swapped in after it was made, say by use_small_batch_linear, is the one that runs), except
    the fused q/k/v and gate/up layers it made."""

    def __init__(self, model: torch.nn.Module):
        config = model.config.get_text_config()
        self.model = model
        self.heads = config.num_attention_heads
        self.kv_heads = getattr(config, "num_key_value_heads", None) or self.heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.heads
        self.calls = 0  # forwards run (tests check that the runner takes this path)
        self.layers = [
            (
                layer,
                _Fused(layer.self_attn, ("q_proj", "k_proj", "v_proj")),
                _Fused(layer.mlp, ("gate_proj", "up_proj")),
            )
            for layer in model.model.layers[: config.num_hidden_layers]
        ]

    @staticmethod
    def _rms(norm: torch.nn.Module, x: Tensor) -> Tensor:
        eps = getattr(norm, "variance_epsilon", None) or getattr(norm, "eps", 1e-6)
        return F.rms_norm(x, norm.weight.shape, norm.weight, eps)

    def __call__(self, input_ids: Tensor, position_ids: Tensor, attention_mask: Tensor, cache, rows: Tensor) -> Tensor:
        """input_ids, position_ids [1, n], attention_mask [1, 1, n, L] additive (L = cached + n keys),
        cache a transformers Cache of this model's layers (written as the model's own forward would),
        rows [R] -> float32 logits [R, V] at those rows."""
        n = input_ids.shape[1]
        hq, hkv, d = self.heads, self.kv_heads, self.head_dim
        rep = hq // hkv
        base = self.model.model
        x = base.embed_tokens(input_ids[0])  # [n, H]
        cos, sin = base.rotary_emb(x, position_ids)  # [1, n, D] each
        cos, sin = cos[0, :, None], sin[0, :, None]  # [n, 1, D]
        half = d // 2
        sin_signed = torch.cat([-sin[..., :half], sin[..., half:]], dim=-1)  # rotate_half's signs, once
        # Each query head's copy of the mask: [1, 1, rep * n, L] (grouped attention, as grouped_sdpa)
        mask = attention_mask[:, :, None].expand(1, 1, rep, n, attention_mask.shape[-1]).reshape(1, 1, rep * n, -1)
        allowed = attention_mask[0, 0] == 0  # [n, L]: row_attention's form of the additive mask
        for i, (layer, qkv_proj, gate_up) in enumerate(self.layers):
            scaling = layer.self_attn.scaling
            qkv = qkv_proj(self._rms(layer.input_layernorm, x))  # [n, (hq + 2 hkv) d]
            qk = qkv[:, : (hq + hkv) * d].view(n, hq + hkv, d)
            qk = qk * cos + qk.roll(half, dims=-1) * sin_signed  # rotary on q and k at once
            q = qk[:, :hq]  # [n, hq, d]
            k = qk[:, hq:].transpose(0, 1)[None]  # [1, hkv, n, d]
            v = qkv[:, (hq + hkv) * d :].view(n, hkv, d).transpose(0, 1)[None]  # [1, hkv, n, d]
            keys, values = cache.layers[i].update(k, v)  # [1, hkv, L, d]
            heads_first = q.transpose(0, 1)[None]  # [1, hq, n, d]
            if row_attention.supports(heads_first, keys, values):  # each row alone: its bits not its batch's
                out = row_attention.row_attention(heads_first, keys, values, allowed, scaling).reshape(n, hq * d)
            else:
                # query head h = kv * rep + r: group kv's rows are (r, token), r-major
                q = q.view(n, hkv, rep, d).permute(1, 2, 0, 3).reshape(1, hkv, rep * n, d)
                out = F.scaled_dot_product_attention(q, keys, values, attn_mask=mask, scale=scaling)
                out = out.view(hkv, rep, n, d).permute(2, 0, 1, 3).reshape(n, hq * d)  # [n, hq d]
            x = x + layer.self_attn.o_proj(out)
            gu = gate_up(self._rms(layer.post_attention_layernorm, x))  # [n, 2 I]
            inter = gu.shape[-1] // 2
            x = x + layer.mlp.down_proj(F.silu(gu[:, :inter]) * gu[:, inter:])
        self.calls += 1
        return self.model.get_output_embeddings()(self._rms(base.norm, x[rows])).float()  # [R, V]


def use_lean_forward(model: torch.nn.Module) -> str:
    """Give a DRAFT model (or a q8_activations one: module docstring) the lean forward (runner.model_logits then
    calls it) after it is loaded, pruned and quantised; returns "" when applied, else why not (the model keeps
    its own forward). RSD_LEAN_FORWARD=0 in the environment keeps every model on its own forward (an A/B
    through the services; in the q8 mode it also changes the target's function, so set it alike everywhere)."""
    problem = lean_unsupported(model)
    if not problem:
        lean = LeanDecoder(model)
        err = _compare(model, lean)
        if not err <= _RELATIVE_TOLERANCE:
            problem = f"its logits differ from the model's own by {err:.1e} (relative; at most {_RELATIVE_TOLERANCE})"
        else:
            model.rsd_lean = lean  # a plain attribute (LeanDecoder is no nn.Module): lean_decoder reads it
            log.info("lean forward on (probe tree: relative logit difference %.1e)", err)
            return ""
    log.info("lean forward off: %s", problem)
    return problem


def lean_decoder(model: torch.nn.Module) -> LeanDecoder | None:
    """The lean forward use_lean_forward gave this model, or None (the model runs its own forward)."""
    return getattr(model, "rsd_lean", None)


@torch.inference_mode()
def _compare(model: torch.nn.Module, lean: LeanDecoder) -> float:
    """attention.relative_logit_error of the lean logits against the model's own over the load-time probe's tree,
    int8-activation layers computing exactly meanwhile (as the tree probe: the steps compared, not int8 rounding)."""
    with quant_q8.exact_layers(model):  # one unpacking of repacked weights for the probe and the comparison
        plan = check_model(model, 8)
        ids, pos, allowed = probe_inputs(model)
        mask = plan.masks(allowed.to(model.device), pos, pos, model.dtype)
        num_layers = model.config.get_text_config().num_hidden_layers
        rows = torch.arange(ids.shape[0], device=model.device)
        own = model(input_ids=ids[None], attention_mask=mask, position_ids=pos[None], use_cache=False).logits[0].float()
        return relative_logit_error(lean(ids[None], pos[None], mask, SequenceKVCache(num_layers, 8), rows), own)
