"""Model runtime (torch + transformers, no gRPC): loading and checking a causal LM (models, attention), its
tokenizer (tokenizer: no torch at import), linear layers for a handful of rows (linear, on small_gemm's C kernels
in csrc/), a drafter's lean forward (lean), the one KV cache (kvcache), the tree-attention runner (runner), the
single-session Drafter and Verifier (engines), the in-process generator (generator) and pre-drafting (predraft).
Imports only rsd/ below it."""

# Model dtypes by name, for flags and configs that must not import torch to parse; models.DTYPES maps
# them to torch dtypes, and "auto" (models.parse_dtype) resolves to one of them per device.
DTYPE_NAMES = ("float32", "bfloat16", "float16")
# A drafter's quantisation (rsd_runtime.models.quantize_draft): none, int8 (dynamic int8 linear layers,
# CPU), auto (int8 where the VNNI kernel takes a drafter too large for the cache: models.int8_auto, never a
# timing). Targets are never quantised.
QUANTIZE_MODES = ("none", "int8", "auto")
# A GGUF model's numeric mode (load_model's `numeric`): "exact", or the opt-in int8 activations (rsd_runtime.quant_q8).
NUMERICS = ("exact", "q8_activations")
