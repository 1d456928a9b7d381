"""Which attention a model's layers need, decided once at load, and the 4-D masks that give it exactly.

Tree forwards (rsd_runtime.runner) and the verifier's packed batches (verifier_service.engine) hand the
model their own float mask: a query sees its committed prefix and its own tree ancestors. A key's
slot in the cache is not its position (siblings share a position; the verifier packs many sessions),
so every rule that depends on positions is applied here, by position:
    full attention      allowed
    sliding window W    allowed and q_pos - k_pos < W   (transformers' sliding_window_overlay)
Attention itself is transformers' sdpa, except that a grouped-query layer attends per key/value head
(grouped_sdpa below) instead of copying every key and value once per query head, and that on a CPU with
AVX2 every query row is reduced alone over its own visible keys (row_sdpa: rsd_runtime.row_attention), so a
tree node's output is bit for bit the one-token step's, in any packed batch.
How a model takes its masks:
    one mask            every layer gets the same tensor (uniform models, Mistral-style windows)
    by layer type       {"full_attention": ..., "sliding_attention": ...}: models whose forward accepts
                        a dict (Gemma2/3, Qwen2/3 with sliding layers, Cohere2, ...)

check_model() refuses, with the reason, what no mask can express: ALiBi biases computed from the cache
layout (Bloom, MPT, Falcon with alibi), GPT-Neo's local layers (windowed by cache index), chunked or
non-attention layers, and attention backends that ignore a float mask; then it runs one small tree
through the model and compares it with the model's own causal forwards (once per model), which
catches any other architecture that takes positions from somewhere else. A refusal is an answer; a
wrong token is not.
"""

from __future__ import annotations

import inspect
import sys
from dataclasses import dataclass

import torch
from torch import Tensor
from transformers import AttentionInterface, PreTrainedModel
from transformers.integrations.sdpa_attention import sdpa_attention_forward
from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

from rsd_runtime import quant_q8, row_attention

# Backends that add our 4-D float mask as is (flash/flex ignore it or want a BlockMask).
GROUPED_SDPA = "grouped_sdpa"
ROW_SDPA = "row_sdpa"
MASKED_ATTENTION = (ROW_SDPA, GROUPED_SDPA, "sdpa", "eager")
_LAYER_WINDOWED = "sliding_attention"
_LAYER_FULL = "full_attention"


def grouped_sdpa(module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, **kwargs):
    """transformers' sdpa attention without repeat_kv for a grouped-query layer and a mask shared by its heads.

    query [B, H, n, D], key/value [B, H_kv, L, D], attention_mask [B, 1, n, L] additive. The H / H_kv query
    heads of one key/value head run as one head of rep * n queries (the mask repeated per query head), so
    the keys and values are read in place: sdpa with repeat_kv copies them rep times first, which a tree
    forward pays in every layer. sdpa computes every query row alone, so
    the output is sdpa's up to float rounding (its GEMMs see rep * n rows instead of n; mostly bit for
    bit). transformers packs a single query the same way already; everything else (no mask, a per-head
    mask or bias, softcapping, sinks) goes to its sdpa as is.
    """
    rep = getattr(module, "num_key_value_groups", 1)
    usable = (
        rep > 1
        and query.shape[2] > 1
        and attention_mask is not None
        and attention_mask.dim() == 4
        and attention_mask.shape[1] == 1
        and attention_mask.dtype != torch.bool
        and kwargs.get("position_bias") is None
        and kwargs.get("softcap") is None
        and kwargs.get("s_aux") is None
        and not kwargs.get("output_attentions", False)
        and kwargs.get("dropout", 0.0) == 0.0
    )
    if not usable:
        return sdpa_attention_forward(module, query, key, value, attention_mask, **kwargs)
    batch, heads, n, dim = query.shape
    kv_heads, length = key.shape[1], key.shape[2]
    mask = attention_mask[:, :, None].expand(attention_mask.shape[0], 1, rep, n, length)
    out = torch.nn.functional.scaled_dot_product_attention(
        query.reshape(batch, kv_heads, rep * n, dim),  # head h = kv * rep + r, as repeat_kv orders them
        key,
        value,
        attn_mask=mask.reshape(attention_mask.shape[0], 1, rep * n, length),
        scale=kwargs.get("scaling"),
    )  # [B, H_kv, rep * n, D]
    return out.reshape(batch, heads, n, dim).transpose(1, 2).contiguous(), None  # [B, n, H, D]


def row_sdpa(module, query: Tensor, key: Tensor, value: Tensor, attention_mask: Tensor | None, **kwargs):
    """grouped_sdpa with every query row reduced alone over its visible keys (rsd_runtime.row_attention): a row's
    output bits never depend on the other rows of the forward, the masked keys between its own, or the threads.

    query [1, H, n, D], key/value [1, H_kv, L, D], attention_mask [1, 1, n, L]: additive (0 allowed, the dtype's
    min not) or bool (True allowed), or None (causal: row i sees the first L - n + i + 1 keys). Anything else
    (a bias in the mask, softcapping, sinks, a batch, another device) goes to grouped_sdpa: row_invariant_attention
    names the configs that would."""
    allowed = _allowed_keys(attention_mask, query.shape[2], key.shape[2])
    plain = not any(kwargs.get(k) for k in ("position_bias", "softcap", "s_aux", "output_attentions", "dropout"))
    if allowed is None or not plain or not row_attention.supports(query, key, value):
        return grouped_sdpa(module, query, key, value, attention_mask, **kwargs)
    scale = kwargs.get("scaling") or query.shape[-1] ** -0.5
    return row_attention.row_attention(query, key, value, allowed, scale), None  # [1, n, H, D]


def _allowed_keys(attention_mask: Tensor | None, n: int, length: int) -> Tensor | None:
    """[n, L] bool: which keys each query row sees, from a mask row_sdpa takes (else None)."""
    if attention_mask is None:  # transformers' causal forward without padding
        return torch.ones(n, length, dtype=torch.bool).tril_(length - n)
    if attention_mask.dim() != 4 or attention_mask.shape[:2] != (1, 1) or attention_mask.shape[2:] != (n, length):
        return None
    mask = attention_mask[0, 0]
    if mask.dtype == torch.bool:
        return mask
    allowed = mask == 0
    if not torch.all(allowed | (mask == torch.finfo(mask.dtype).min)):  # a bias, not a mask
        return None
    return allowed


AttentionInterface.register(GROUPED_SDPA, grouped_sdpa)
AttentionMaskInterface.register(GROUPED_SDPA, sdpa_mask)  # causal forwards get sdpa's masks (windows included)
AttentionInterface.register(ROW_SDPA, row_sdpa)
AttentionMaskInterface.register(ROW_SDPA, sdpa_mask)


class UnsupportedModelError(ValueError):
    """The model cannot be run exactly by tree attention; the message says why."""


@dataclass(frozen=True)
class AttentionPlan:
    """How to mask a model's tree forwards. `windows` maps each mask key to its sliding window (None:
    full causal); with `by_layer_type` the model takes a dict of masks, else the single key's mask."""

    windows: dict[str, int | None]
    by_layer_type: bool

    def masks(self, allowed: Tensor, q_pos: Tensor, k_pos: Tensor, dtype: torch.dtype) -> Tensor | dict[str, Tensor]:
        """Additive float masks [1, 1, n, kv] from `allowed` [n, kv] bool (True = may attend), the
        queries' positions q_pos [n] and the keys' positions k_pos [kv] (all on the model's device)."""
        neg = torch.finfo(dtype).min
        out = {}
        for key, window in self.windows.items():
            ok = allowed if window is None else allowed & (q_pos[:, None] - k_pos[None, :] < window)  # [n, kv]
            out[key] = torch.zeros(ok.shape, dtype=dtype, device=ok.device).masked_fill_(~ok, neg)[None, None]
        return out if self.by_layer_type else next(iter(out.values()))


def check_model(model: PreTrainedModel, max_kv_len: int) -> AttentionPlan:
    """The plan for tree forwards whose keys never number more than `max_kv_len`, or
    UnsupportedModelError naming the architecture and the reason: first what the config says
    (below), then one small tree through the model itself (probe_tree_forward), so an architecture
    that takes positions or biases from anywhere else is refused too."""
    plan = _plan(model, max_kv_len)
    probe_tree_forward(model, plan)
    return plan


def _plan(model: PreTrainedModel, max_kv_len: int) -> AttentionPlan:
    config = model.config.get_text_config()
    arch = f"{config.model_type} ({type(model).__name__})"
    attn = model.config._attn_implementation
    if attn not in MASKED_ATTENTION:
        raise UnsupportedModelError(
            f"{arch}: attn_implementation {attn!r} ignores a tree mask; load it with one of {MASKED_ATTENTION}"
        )
    _refuse_position_biases(config, arch)
    _refuse_index_windows(config, arch, max_kv_len)
    if getattr(config, "attention_chunk_size", None):
        raise UnsupportedModelError(f"{arch}: chunked attention (attention_chunk_size) is not supported")

    window = getattr(config, "sliding_window", None)
    layer_types = getattr(config, "layer_types", None)
    if layer_types:
        unknown = set(layer_types) - {_LAYER_FULL, _LAYER_WINDOWED}
        if unknown:
            raise UnsupportedModelError(
                f"{arch}: layers of type {sorted(unknown)} cannot be run as a tree (only attention layers)"
            )
        if _LAYER_WINDOWED in layer_types and not window:
            raise UnsupportedModelError(f"{arch}: sliding layers without a sliding_window in the config")
        windows = {t: (window if t == _LAYER_WINDOWED else None) for t in dict.fromkeys(layer_types)}
        if len(windows) == 1:
            return AttentionPlan(windows, by_layer_type=False)
        if not _takes_mask_dict(model):
            raise UnsupportedModelError(
                f"{arch}: mixes full and sliding layers but its forward takes one mask for all layers"
            )
        return AttentionPlan(windows, by_layer_type=True)
    if window and _mentions(model, "sliding_window"):  # Mistral, Phi-3, Starcoder2, Mixtral: every layer
        return AttentionPlan({_LAYER_WINDOWED: int(window)}, by_layer_type=False)
    return AttentionPlan({_LAYER_FULL: None}, by_layer_type=False)


def _refuse_position_biases(config, arch: str) -> None:
    """ALiBi in transformers is built from the 2-D padding mask or the key index (Bloom, Falcon) or from
    the key length alone (MPT): neither sees a tree's positions, so tree logits would be off."""
    alibi = (
        config.model_type in ("bloom", "mpt")
        or getattr(config, "alibi", False)
        or getattr(getattr(config, "attn_config", None), "alibi", False)
        or getattr(config, "position_embedding_type", None) == "alibi"
    )
    if alibi:
        raise UnsupportedModelError(
            f"{arch}: ALiBi position biases are computed from the cache layout, not from token positions, "
            "so a draft tree's logits would be silently wrong"
        )


def _refuse_index_windows(config, arch: str, max_kv_len: int) -> None:
    """GPT-Neo's local layers mask by distance in the cache (a fixed lower-triangular band), which in a
    tree or a packed batch is larger than the distance in positions: exact only while every key
    fits in the window."""
    types = getattr(config, "attention_layers", None) or []
    size = getattr(config, "window_size", None)
    if "local" in types and size is not None and max_kv_len > size:
        raise UnsupportedModelError(
            f"{arch}: local attention layers window by cache index (window_size {size}); "
            f"exact only for at most {size} keys, this runner may hold {max_kv_len} (lower max_len)"
        )


def _module_source(model: PreTrainedModel) -> str:
    module = sys.modules.get(type(model.base_model).__module__)
    try:
        return inspect.getsource(module) if module is not None else ""
    except (OSError, TypeError):
        return ""


def _mentions(model: PreTrainedModel, word: str) -> bool:
    return word in _module_source(model)


def _takes_mask_dict(model: PreTrainedModel) -> bool:
    """transformers' models with layer types accept {layer_type: mask} (`isinstance(..., dict)`)."""
    return "attention_mask, dict)" in _module_source(model)


# Worst tolerated |tree logit - causal logit| / (1 + max |causal logit|) of the load-time probe: float32
# rounds to ~1e-6 here; 16-bit kernels on different shapes differ by up to a few ulps of the logits.
_PROBE_TOLERANCE = {torch.float32: 1e-4, torch.float64: 1e-9}
_PROBE_TOLERANCE_16BIT = 5e-2


PROBE_KEYS = 5  # the probe's tree: keys in its one forward


def probe_inputs(model: PreTrainedModel) -> tuple[Tensor, Tensor, Tensor]:
    """The probe's tree (probe_tree_forward): token ids [5] and positions [5] on the model's device, and
    allowed [5, 5] bool (each node sees its ancestors and itself)."""
    vocab, device = model.config.get_text_config().vocab_size, model.device
    ids = torch.tensor([(5 * i + 3) % vocab for i in range(5)], device=device)  # [p0 p1 a b c]
    parents = [-1, 0, 1, 1, 3]
    allowed = torch.zeros(5, 5, dtype=torch.bool)
    for i in range(5):
        j = i
        while j != -1:
            allowed[i, j], j = True, parents[j]
    return ids, torch.tensor([0, 1, 2, 2, 3], device=device), allowed


def relative_logit_error(logits: Tensor, ref: Tensor) -> float:
    """max |logits - ref| / (1 + max |ref|) over ref's finite entries (a pruned draft head scores some ids
    -inf: models.PrunedLMHead); inf where the two are not finite at the same entries."""
    finite = torch.isfinite(ref)
    if not torch.equal(torch.isfinite(logits), finite):
        return float("inf")
    return float((logits - ref)[finite].abs().max() / (1 + ref[finite].abs().max()))


@torch.inference_mode()
def probe_tree_forward(model: PreTrainedModel, plan: AttentionPlan) -> float:
    """Run one small tree through the model with the plan's masks and explicit positions and compare
    each node's logits with the model's own causal forward of its path; UnsupportedModelError when
    they differ (an architecture that takes positions or biases from somewhere else). Returns the
    relative error. Once per model: the result is kept on it.

    The tree: a prefix p0 p1, then siblings a and b (both at position 2) and c, child of b (3): five
    keys, so it fits any runner worth having (GPT-Neo's local layers are exact only within their window).
    """
    cached = model.__dict__.get("_rsd_tree_probe")
    if cached is not None:
        return cached
    config = model.config.get_text_config()
    arch = f"{config.model_type} ({type(model).__name__})"
    ids, pos, allowed = probe_inputs(model)
    masks = plan.masks(allowed.to(model.device), pos, pos, model.dtype)
    try:
        with quant_q8.exact_layers(model):  # positions and masks, not int8 rounding steps (its docstring)
            tree = model(input_ids=ids[None], attention_mask=masks, position_ids=pos[None], use_cache=False)
            tree_logits = tree.logits[0, 2:].float()  # [3, V]: a, b, c
            paths = ([0, 1, 2], [0, 1, 3], [0, 1, 3, 4])
            ref = [model(input_ids=ids[list(p)][None], use_cache=False).logits[0, -1].float() for p in paths]
        ref = torch.stack(ref)
    except Exception as e:  # what the model cannot take is a refusal, not a crash in the first request
        raise UnsupportedModelError(f"{arch}: a tree forward with a 4-D mask and positions fails: {e}") from e
    err = relative_logit_error(tree_logits, ref)
    tolerance = _PROBE_TOLERANCE.get(model.dtype, _PROBE_TOLERANCE_16BIT)
    if getattr(model, "rsd_quantize", "none") != "none":
        # A dynamically quantised drafter quantises activations per forward, so a tree row differs from
        # its path run alone by far more than rounding, whatever the positions: models.quantize_draft
        # probes the float model before. Here only that it runs is checked: a drafter's law need only be
        # known to the verifier, not equal to anything.
        tolerance = float("inf")
    if not err <= tolerance:
        raise UnsupportedModelError(
            f"{arch}: a tree forward differs from the model's own causal forward (relative error {err:.1e} > "
            f"{tolerance:.0e}): it takes positions or attention biases from the cache layout"
        )
    model.__dict__["_rsd_tree_probe"] = err
    return err
