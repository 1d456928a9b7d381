"""Load causal LMs and their tokenizers from local folders (or GGUF files) for inference."""

from __future__ import annotations

import copy
import logging
import time
import warnings
from collections import Counter
from functools import partial
from pathlib import Path

import torch
from torch import Tensor
from transformers import AutoModelForCausalLM, PreTrainedModel

from rsd_runtime import DTYPE_NAMES, QUANTIZE_MODES, quant, quant_q8, row_attention, small_gemm
from rsd_runtime.attention import GROUPED_SDPA, PROBE_KEYS, ROW_SDPA, check_model
from rsd_runtime.gguf_model import gguf_file, load_gguf
from rsd_runtime.lean import lean_decoder, use_lean_forward
from rsd_runtime.linear import (
    Int8Linear,
    SmallBatchLinear,
    as_plain_linear,
    plain_linear,
    replace_linear,
    use_small_batch_linear,
)

log = logging.getLogger(__name__)

DTYPES = dict(zip(DTYPE_NAMES, (torch.float32, torch.bfloat16, torch.float16), strict=True))


def cpu_has_native_bf16() -> bool:
    """Whether this CPU multiplies bfloat16 in hardware (x86 AVX512-BF16 or AMX-BF16, Arm BF16): there
    a bf16 model runs faster than fp32; without, bf16 is emulated and slower."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return False
    flags = {f for line in info.splitlines() if line.startswith(("flags", "Features")) for f in line.split()}
    return bool(flags & {"avx512_bf16", "amx_bf16", "bf16"})


def parse_dtype(name: str, device: str = "cpu") -> torch.dtype:
    """ "float32" | "bfloat16" | "float16" | "auto" -> torch dtype. "auto" is the fastest dtype the
    device runs natively: bfloat16 on a GPU that has it (float16 on an older one), bfloat16 on a CPU
    with bf16 instructions, float32 elsewhere. (16-bit dtypes keep speculative decoding exact with
    respect to the 16-bit target; only the T=0 text may differ from fp32's.)"""
    if name == "auto":
        if torch.device(device).type == "cuda":
            return torch.bfloat16 if torch.cuda.is_bf16_supported() else torch.float16
        return torch.bfloat16 if torch.device(device).type == "cpu" and cpu_has_native_bf16() else torch.float32
    if name not in DTYPES:
        raise ValueError(f"dtype must be one of {sorted(DTYPES)} or 'auto', got {name!r}")
    return DTYPES[name]


def load_model(
    path: str | Path,
    device: str = "cpu",
    dtype: str = "float32",
    attn_implementation: str = "auto",
    small_batch_rows: int | None = None,
    numeric: str = "exact",
) -> PreTrainedModel:
    """A causal LM in eval mode with gradients off, on `device` (any torch device string).

    `path` is a checkpoint folder, a GGUF file, or a folder holding one GGUF file and no other weights (what
    `rsd provision` makes). A GGUF model is read by rsd_runtime.gguf_model: on a CPU in float32 ("auto" is
    float32 there) its quantised linear layers compute from the file's blocks (rsd_runtime.quant); on any
    other device or dtype it is dequantised on load to the file's float32 weights, then cast.

    small_batch_rows: linear layers over at most this many rows take rsd_runtime.linear.SmallBatchLinear's path
    (on a CPU rsd_runtime.small_gemm's kernels, which stream each weight once for all rows). None picks per
    device: on a CPU small_gemm.preferred_rows (any number where a kernel runs, a prompt in calls of 64 rows, so
    a row's bits never depend on its batch: batch_variance), at least 64 for float32; 0 (F.linear) elsewhere.

    attn_implementation "auto" takes sdpa where the architecture has it, as rsd_runtime.attention.grouped_sdpa
    where its layers dispatch through transformers' AttentionInterface (as row_sdpa on a CPU with AVX2: each
    query row reduced alone, so a tree node's logits are the one-token step's bit for bit), else eager (Gemma2,
    GPT-Neo, Bloom, MPT, XGLM have no sdpa path); the choice is logged and kept in model.config._attn_implementation.
    Tree forwards need one of rsd_runtime.attention.MASKED_ATTENTION.

    numeric: "exact" (the default: the file's float32 weights, float32 sums) or the opt-in "q8_activations"
    (a GGUF model's quantised layers computed with int8 activations as llama.cpp does: rsd_runtime.quant_q8;
    another deterministic function, refused with the reason where it cannot run). Kept in model.rsd_numeric.
    """
    numeric = quant_q8.check_numeric(numeric)
    gguf = gguf_file(path)
    if numeric != "exact":
        on_cpu = torch.device(device).type == "cpu"
        torch_dtype = torch.float32 if dtype == "auto" and on_cpu else parse_dtype(dtype, device)
        if problem := quant_q8.unavailable_reason(device, torch_dtype, gguf is not None):
            raise ValueError(problem)
    attn = "sdpa" if attn_implementation == "auto" else attn_implementation
    if gguf is not None:
        on_cpu = torch.device(device).type == "cpu"
        torch_dtype = torch.float32 if dtype == "auto" and on_cpu else parse_dtype(dtype, device)
        quantized = on_cpu and torch_dtype == torch.float32 and quant.kernel_name() is not None
        model = load_gguf(gguf, attn, quantized, numeric).to(torch_dtype)
    else:
        kwargs = {"dtype": parse_dtype(dtype, device)}
        try:
            model = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation=attn, **kwargs)
        except ValueError as e:
            if attn_implementation != "auto" or ("scaled_dot_product_attention" not in str(e) and "sdpa" not in str(e)):
                raise
            model = AutoModelForCausalLM.from_pretrained(str(path), attn_implementation="eager", **kwargs)
    model.rsd_numeric = numeric
    auto_sdpa = attn_implementation == "auto" and model.config._attn_implementation == "sdpa"
    if auto_sdpa and model._can_set_attn_implementation():
        # sdpa up to float rounding, without repeat_kv's copies; on a CPU a row's bits its own (batch_variance)
        row = torch.device(device).type == "cpu" and row_attention.available()
        model.set_attn_implementation(ROW_SDPA if row else GROUPED_SDPA)
    model.to(torch.device(device)).eval().requires_grad_(False)
    as_plain_linear(model)  # GPT-2's Conv1D and the like: nn.Linear, which the row-invariant kernels take
    if small_batch_rows is None and torch.device(device).type != "cpu":
        small_batch_rows = 0
    elif small_batch_rows is None:  # float32 takes the small-row path even without its kernel (weight @ x.T)
        small_batch_rows = max(small_gemm.preferred_rows(model.dtype), 64 if model.dtype == torch.float32 else 0)
    if small_batch_rows:
        use_small_batch_linear(model, small_batch_rows)
    if numeric == "q8_activations":  # this mode's function is the runtime's own: its decoder is the lean one
        use_lean_forward(model)
    log.info(
        "loaded %s: %s%s, attention %s, %s on %s, small-batch linear %s",
        path,
        type(model).__name__,
        _quantized_summary(model),
        model.config._attn_implementation,
        model.dtype,
        device,
        f"<= {small_batch_rows if small_batch_rows < small_gemm.ANY_ROWS else 'any'} rows "
        f"({small_gemm.kernel_name(model.dtype) or 'torch'})"
        if small_batch_rows
        else "off",
    )
    return model


def _quantized_summary(model: torch.nn.Module) -> str:
    """ ", 196 linear layers on GGUF blocks (Q4_K x 140, Q6_K x 56; avx512 kernel)" or ""."""
    types = Counter(quant.KERNEL_TYPES[m.qtype][0] for m in model.modules() if isinstance(m, quant.QuantLinear))
    if not types:
        return ""
    listed = ", ".join(f"{name} x {n}" for name, n in sorted(types.items()))
    if getattr(model, "rsd_numeric", "exact") == "q8_activations":
        kernel = f"int8 activations, {quant_q8.kernel_name()}"
        return f", {types.total()} linear layers on GGUF blocks ({listed}; {kernel} kernel)"
    return f", {types.total()} linear layers on GGUF blocks ({listed}; {quant.kernel_name()} kernel)"


def batch_variance(model: torch.nn.Module) -> str:
    """Why a row's logits from this loaded model may depend on the other rows of its forward ("" where they
    never do): on how many rows share it, which sessions they belong to, which masked keys lie between its own.
    Result files record it (the benchmark's batch_invariant), tests/rsd_runtime/test_batch_invariance.py checks it.

    Invariant: a CPU model whose every linear layer runs on rsd_runtime.small_gemm at any row count (in calls of
    64 rows: float32 on AVX2, bfloat16 on AVX512-BF16 or AMX; an int8 drafter's Int8Linear on AVX512-VNNI) and
    whose attention is row_sdpa (rsd_runtime.row_attention, AVX2). Not invariant: F.linear and weight @ x.T (MKL's
    float32 rows change with the row count: RSD_SMALL_GEMM=0, a CPU or layer width the kernel does not take,
    small_batch_rows below any), fbgemm's dynamic int8 (a CPU without VNNI: one activation scale a call), sdpa,
    grouped_sdpa and eager attention (a row reduced over every key of its forward, in blocks set by the forward's
    shape), the lean draft forward without row attention (sdpa), any module other than a linear layer, an embedding
    or a quantised kernel that multiplies by weights of its own (Mixtral's batched experts; GPT-2's Conv1D is an
    nn.Linear after load_model's as_plain_linear), any GPU (cuBLAS, flash: tiles by shape).
    """
    device = next(model.parameters()).device
    if device.type != "cpu":
        return f"on {device}: its GEMM and attention kernels are picked by shape"
    if lean_decoder(model) is not None and not row_attention.available():
        return "the lean draft forward attends with sdpa"
    config = model.config.get_text_config()
    attn = model.config._attn_implementation
    if attn != ROW_SDPA:
        return f"attention {attn!r} reduces a row over every key of its forward (row_sdpa: each row alone)"
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    if head_dim % 8 or model.dtype not in (torch.float32, torch.bfloat16):
        return f"row_sdpa takes float32 or bfloat16 heads of a multiple of 8 dims, not {model.dtype} x {head_dim}"
    if any(getattr(config, a, None) for a in ("attn_logit_softcapping", "sliding_window_pattern_sinks")):
        return "softcapped attention goes to grouped_sdpa"
    for name, m in model.named_modules():
        if type(m).__module__.startswith("torch.ao.nn.quantized"):
            return f"{name}: fbgemm's dynamic int8 scales a call's activations at once"
        if not isinstance(m, torch.nn.Linear):
            if not isinstance(m, _ROW_KERNELS) and any(p.dim() > 1 for p in m.parameters(recurse=False)):
                return f"{name}: {type(m).__name__} multiplies by its own weights outside the row kernels"
            continue
        if not isinstance(m, SmallBatchLinear) or not m.small_gemm or m.small_batch_rows < small_gemm.ANY_ROWS:
            return f"{name}: F.linear or weight @ x.T above {getattr(m, 'small_batch_rows', 0)} rows"
        if not small_gemm.supports(m.weight.new_zeros(1, m.in_features), m.weight):
            why = small_gemm.kernel_name(m.weight.dtype) or "no kernel here"
            return f"{name}: small_gemm ({why}) does not take {m.weight.dtype} x {m.in_features} (F.linear instead)"
    return ""


# Modules holding matrices whose rows are their own: a lookup, or a kernel that computes each row alone.
_ROW_KERNELS = (torch.nn.Embedding, quant.QuantLinear, Int8Linear)


class PrunedLMHead(torch.nn.Module):
    """A language-model head that scores only the first `keep` vocabulary ids; the others get -inf.

    For a drafter: its output layer is a large share of a small model's bytes (Qwen2.5-0.5B: 136M of
    494M parameters for 151,936 ids), and BPE ids are numbered by merge rank, so the first ids are
    the frequent ones. The drafter then proposes only among them (its law is 0 elsewhere), and the
    verifier judges the proposals with exactly that law: speculative sampling stays exact for any
    draft law, only acceptance can drop (the idea of FR-Spec, Zhao et al., 2025).
    """

    def __init__(self, lm_head: torch.nn.Linear | quant.QuantLinear, keep: int):
        super().__init__()
        vocab, hidden = lm_head.out_features, lm_head.in_features
        if not 0 < keep <= vocab:
            raise ValueError(f"draft vocabulary {keep} must be in [1, {vocab}]")
        self.vocab_size = vocab
        if isinstance(lm_head, quant.QuantLinear):  # a GGUF head: its first `keep` rows of blocks
            bias = None if lm_head.bias is None else lm_head.bias[:keep]
            self.kept = type(lm_head)(
                lm_head.file_blocks()[:keep].clone(), lm_head.qtype, hidden, keep, bias
            )  # its numeric too
            return
        self.kept = torch.nn.Linear(hidden, keep, bias=lm_head.bias is not None)  # use_small_batch_linear may swap it
        self.kept.to(lm_head.weight.device, lm_head.weight.dtype)
        with torch.no_grad():
            self.kept.weight.copy_(lm_head.weight[:keep])
            if lm_head.bias is not None:
                self.kept.bias.copy_(lm_head.bias[:keep])

    def forward(self, hidden: Tensor) -> Tensor:  # [..., H] -> [..., V]
        kept = self.kept(hidden)  # [..., keep]
        out = kept.new_full((*kept.shape[:-1], self.vocab_size), float("-inf"))
        out[..., : kept.shape[-1]] = kept
        return out


def prune_draft_vocab(model: torch.nn.Module, keep: int) -> None:
    """Give a (draft) causal LM a PrunedLMHead over its first `keep` ids (0 or the full size: no-op).
    Unties a head shared with the input embeddings: the embeddings keep every id. Prune before
    quantize_draft (the pruned head is then quantised too)."""
    head = model.get_output_embeddings()
    if keep and not isinstance(head, (torch.nn.Linear, quant.QuantLinear)):
        raise ValueError(
            f"cannot prune a {type(head).__name__} output layer: prune the draft vocabulary before quantising"
        )
    if not keep or keep >= head.out_features:
        return
    model.set_output_embeddings(PrunedLMHead(head, keep))
    model.config.tie_word_embeddings = False


def prepare_draft(model: torch.nn.Module, draft_vocab: int = 0, quantize: str = "none", dtype: str = "float32") -> str:
    """Make a loaded model the drafter the config asks for, in the one order that works: prune its vocabulary
    (prune_draft_vocab), quantise it (quantize_draft), then give it the lean forward where its architecture
    allows (rsd_runtime.lean: fewer, fused steps a layer; a drafter's law need only be known, not equal to
    anything). Returns the quantisation applied; ValueError for a setting the model cannot take."""
    prune_draft_vocab(model, draft_vocab)
    applied = quantize_draft(model, quantize, dtype)
    if lean_decoder(model) is None or draft_vocab or applied != "none":  # load_model gave a q8 model one already
        use_lean_forward(model)  # (again) over the layers as they are now
    return applied


# ---------------------------------------------------------------- a cheap drafter: int8


def quantize_draft(model: torch.nn.Module, mode: str, dtype: str = "float32") -> str:
    """Quantise a DRAFT model in place: mode "none" | "int8" | "auto"; returns what was applied
    ("none" or "int8"). Never call it on a target: only the drafter's law may change, since the
    verifier judges each proposal with exactly the law it was drawn from (exact for any draft law).

    int8 replaces every nn.Linear (the output layer and a PrunedLMHead's included) with an int8 one, float32
    elsewhere. Where the CPU has AVX512-VNNI (and every layer's input width is a multiple of 64), that is
    Int8Linear: weights int8 per output channel, activations int8 per row, on rsd_runtime.small_gemm's kernel.
    Elsewhere it is dynamic quantisation: weights int8 per output channel, activations quantised per call,
    through torch's fbgemm/x86 kernels (torch.ao.quantization.quantize_dynamic: deprecated in torch 2.13 but
    still the fastest int8 CPU path we found, ahead of torchao's eager int8 and torch._int_mm). Its logits
    depend on which tokens share a forward: harmless for a drafter (its law is whatever it computed
    and sent), never acceptable for a verifier. CPU only; the model must be float32 or `dtype` "auto"
    (a bf16/fp16 model is converted to float32 for int8); an explicit bfloat16/float16 is refused.
    Order with the other drafter options: prune_draft_vocab first, then this (which replaces the float
    layers, SmallBatchLinear ones included), then use_small_batch_linear (replaces only the nn.Linear layers
    left: none after int8).

    "auto" picks by the machine and the model, never by a timing: int8 where int8_auto says so (the
    AVX512-VNNI kernel takes every layer, and the float32 weights are large enough that a forward streams
    them from memory), else "none". A timing taken at start decided it once, and on a busy machine it chose
    the other law: the draft law, and with it a seeded run's tokens, changed with the machine's load.
    int8_speedup still measures the ratio for a benchmark to report.
    """
    if mode not in QUANTIZE_MODES:
        raise ValueError(f"draft quantize must be one of {QUANTIZE_MODES}, got {mode!r}")
    if mode == "none":
        return "none"
    problem = int8_unsupported(model, dtype)
    if problem:
        if mode == "int8":
            raise ValueError(problem)
        log.info("draft quantize auto -> none: %s", problem)
        return "none"
    if mode == "auto":
        why = int8_auto(model)
        log.info("draft quantize auto -> %s", why)
        if not why.startswith("int8"):
            return "none"
    if next(model.parameters()).dtype != torch.float32:
        model.float()
    # The support check's probe runs on the float model (and is kept on it): int8 activations make a
    # tree row differ from the same path run alone by far more than rounding, which says nothing
    # about positions. The runner checks the rest of the support again with its own max_len.
    check_model(model, PROBE_KEYS)
    from torch.ao.quantization import per_channel_dynamic_qconfig, quantize_dynamic

    replace_linear(model, (quant.QuantLinear,), quant.QuantLinear.dequantized)  # a GGUF drafter: its weights
    plain_linear(model)  # int8 layers replace the float ones: load_model's SmallBatchLinear goes first
    if all(Int8Linear.takes(m) for m in model.modules() if type(m) is torch.nn.Linear):
        replace_linear(model, (torch.nn.Linear,), Int8Linear)
    else:
        with warnings.catch_warnings():  # torch 2.13 warns that torch.ao.quantization is deprecated
            warnings.simplefilter("ignore")
            quantize_dynamic(model, {torch.nn.Linear: per_channel_dynamic_qconfig}, dtype=torch.qint8, inplace=True)
    model.rsd_quantize = "int8"
    return "int8"


# Float32 linear weights from which quantize_draft "auto" takes int8: well past any CPU's last-level cache, so
# a forward streams them from memory and int8 reads a quarter of the bytes (the 0.5B drafter: ~2 GB). Smaller
# drafters are bound by per-layer overhead, where int8 gains nothing (tiny ones measured 0.9x-1.1x).
INT8_AUTO_MIN_BYTES = 256 << 20


def int8_auto(model: torch.nn.Module) -> str:
    """quantize_draft "auto"'s choice with its reason: "int8: ..." or "none: ...". A function of the CPU's
    kernels and the model's shapes only, so the same on an idle machine and a busy one."""
    layers = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, quant.QuantLinear))]
    if getattr(model, "rsd_numeric", "exact") == "q8_activations":
        return "none: its layers compute with int8 activations from the file's blocks already"
    if not layers or not all(Int8Linear.takes(m) for m in layers):
        return "none: the AVX512-VNNI int8 kernel does not take every linear layer here (torch's dynamic int8 would)"
    size = sum(4 * m.in_features * m.out_features for m in layers)
    if size < INT8_AUTO_MIN_BYTES:
        return f"none: {size >> 20} MiB of float32 linear weights, below {INT8_AUTO_MIN_BYTES >> 20} MiB"
    return f"int8: {size >> 20} MiB of float32 linear weights on the AVX512-VNNI kernel"


def int8_unsupported(model: torch.nn.Module, dtype: str = "float32") -> str:
    """Why this model cannot be given int8 linear layers here ("" when it can)."""
    device = next(model.parameters()).device
    if device.type != "cpu":
        return f"int8 drafters run on the CPU only (fbgemm/x86 kernels); this one is on {device}"
    if dtype in ("bfloat16", "float16"):
        return f"int8 computes in float32 activations; the drafter's dtype is {dtype}: use float32 or auto"
    engines = torch.backends.quantized.supported_engines
    if not any(e in engines for e in ("x86", "fbgemm", "qnnpack")):
        return f"this torch has no int8 CPU engine (supported: {engines})"
    try:
        from torch.ao.quantization import quantize_dynamic  # noqa: F401
    except ImportError:
        return "this torch has no torch.ao.quantization.quantize_dynamic"
    if getattr(model, "rsd_quantize", "none") != "none":
        return "the model is quantised already"
    return ""


@torch.inference_mode()
def int8_speedup(model: torch.nn.Module, rows: tuple[int, ...] = (1, 4), reps: int = 3) -> float:
    """Estimated int8 / float time of the model's linear layers for one forward of each row count:
    each distinct (in, out) shape is timed once (at most 8192 output rows, scaled up), weighted by
    how many layers have it. Timing uses the current torch threads (apply placement first)."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicLinear
    from torch.ao.quantization import per_channel_dynamic_qconfig

    layers = [m for m in model.modules() if isinstance(m, (torch.nn.Linear, quant.QuantLinear))]
    shapes = Counter((m.in_features, m.out_features) for m in layers)
    first = {(m.in_features, m.out_features): m for m in reversed(layers)}
    vnni = all(Int8Linear.takes(m) for m in layers)  # what quantize_draft would use
    total = {"float": 0.0, "int8": 0.0}
    for (n_in, n_out), count in shapes.items():
        used = min(n_out, 8192)
        layer = first[(n_in, n_out)]
        if isinstance(layer, quant.QuantLinear):  # a GGUF drafter: its own blocks against int8
            layer = type(layer)(layer.file_blocks()[:used], layer.qtype, n_in, used)  # in its numeric mode
        weight = layer.dequantized().weight if isinstance(layer, quant.QuantLinear) else layer.weight[:used]
        float_layer = torch.nn.Linear(n_in, used, bias=False, dtype=weight.dtype)
        float_layer.weight.copy_(weight)
        source = copy.deepcopy(float_layer).float()
        source.qconfig = per_channel_dynamic_qconfig
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            int8_layer = Int8Linear(source) if vnni else DynamicLinear.from_float(source)
        if isinstance(layer, SmallBatchLinear):  # time it on the model's own path (small_gemm)
            float_layer = SmallBatchLinear(float_layer, layer.small_batch_rows)
        elif isinstance(layer, quant.QuantLinear):
            float_layer = layer
        for r in rows:
            x = torch.randn(r, n_in)
            xf = x if isinstance(float_layer, quant.QuantLinear) else x.to(float_layer.weight.dtype)
            best = {"float": float("inf"), "int8": float("inf")}
            for rep in range(reps + 1):  # rep 0 warms up
                for kind, fn in (("float", partial(float_layer, xf)), ("int8", partial(int8_layer, x))):
                    t = time.perf_counter()
                    fn()
                    if rep:
                        best[kind] = min(best[kind], time.perf_counter() - t)
            for kind in total:
                total[kind] += best[kind] * count * n_out / used
    return total["int8"] / total["float"]
