"""A matrix of tiny random causal LMs of many architectures, saved and loaded like real checkpoints.

Each entry is a transformers model_type with a small config (2-3 layers, hidden 64, vocabulary 96).
Windowed architectures get a window of WINDOW tokens, far shorter than the tests' sequences, so a
window ignored or applied by cache slot instead of position changes the output. `refused` names the
reason rsd_runtime.attention.check_model must give; every other entry must be exact.

    python -m rsd_bench.architectures     # the README's architecture table, from this matrix
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import torch
from transformers import AutoConfig, AutoModelForCausalLM, PreTrainedModel

V = 96
WINDOW = 6
_IDS = {"pad_token_id": 0, "eos_token_id": 1, "bos_token_id": 2, "tie_word_embeddings": False}
_COMMON = {
    "vocab_size": V,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "max_position_embeddings": 256,
    **_IDS,
}
_GPT2 = {"vocab_size": V, "n_embd": 64, "n_layer": 2, "n_head": 4, "n_positions": 256, "n_inner": 128, **_IDS}
_SLIDING_FULL = {"sliding_window": WINDOW, "layer_types": ["sliding_attention", "full_attention"]}


@dataclass(frozen=True)
class Arch:
    name: str
    model_type: str
    config: dict
    refused: str = ""  # a phrase of the refusal; "" = must be exact
    note: str = ""  # what the entry exercises, for the README table
    windowed: bool = False


ARCHS = [
    Arch("llama", "llama", _COMMON),
    Arch("qwen2", "qwen2", _COMMON),
    Arch(
        "qwen2-sliding",
        "qwen2",
        {**_COMMON, "use_sliding_window": True, "sliding_window": WINDOW, "max_window_layers": 1},
        note="use_sliding_window: layer 1 windowed",
        windowed=True,
    ),
    Arch("qwen3", "qwen3", {**_COMMON, "head_dim": 16}),
    Arch(
        "mistral-window",
        "mistral",
        {**_COMMON, "sliding_window": WINDOW},
        note="sliding_window on every layer",
        windowed=True,
    ),
    Arch(
        "phi3-window",
        "phi3",
        {**_COMMON, "sliding_window": WINDOW},
        note="sliding_window on every layer",
        windowed=True,
    ),
    Arch(
        "starcoder2-window",
        "starcoder2",
        {**_COMMON, "sliding_window": WINDOW},
        note="sliding_window on every layer",
        windowed=True,
    ),
    Arch(
        "mixtral-window",
        "mixtral",
        {**_COMMON, "sliding_window": WINDOW, "num_local_experts": 4, "num_experts_per_tok": 2},
        note="MoE, sliding_window",
        windowed=True,
    ),
    Arch("gemma", "gemma", {**_COMMON, "head_dim": 16}),
    Arch(
        "gemma2",
        "gemma2",
        {**_COMMON, "head_dim": 16, "sliding_window": WINDOW},
        note="alternating sliding/full layers, soft-capping; eager only",
        windowed=True,
    ),
    Arch(
        "gemma3",
        "gemma3_text",
        {
            **_COMMON,
            "head_dim": 16,
            "sliding_window": WINDOW,
            "num_hidden_layers": 3,
            "layer_types": ["sliding_attention", "sliding_attention", "full_attention"],
        },
        note="layer_types, local rope base",
        windowed=True,
    ),
    Arch("cohere2", "cohere2", {**_COMMON, **_SLIDING_FULL}, note="layer_types", windowed=True),
    Arch("exaone4", "exaone4", {**_COMMON, **_SLIDING_FULL}, note="layer_types", windowed=True),
    Arch("gpt2", "gpt2", _GPT2, note="learned absolute positions"),
    Arch("gpt_bigcode", "gpt_bigcode", _GPT2, note="multi-query attention"),
    Arch("codegen", "codegen", {**_GPT2, "rotary_dim": 8}),
    Arch("gptj", "gptj", {**_GPT2, "rotary_dim": 8}),
    Arch(
        "opt",
        "opt",
        {
            "vocab_size": V,
            "hidden_size": 64,
            "ffn_dim": 128,
            "num_hidden_layers": 2,
            "num_attention_heads": 4,
            "max_position_embeddings": 256,
            "word_embed_proj_dim": 64,
            **_IDS,
        },
        note="learned positions with an offset",
    ),
    Arch("gpt_neox", "gpt_neox", _COMMON),
    Arch("phi", "phi", _COMMON),
    Arch("falcon", "falcon", {**_COMMON, "num_kv_heads": 2, "new_decoder_architecture": True}, note="rotary"),
    Arch("stablelm", "stablelm", _COMMON),
    Arch("olmo", "olmo", _COMMON),
    Arch("olmo2", "olmo2", _COMMON),
    Arch("granite", "granite", _COMMON),
    Arch("cohere", "cohere", _COMMON),
    Arch("biogpt", "biogpt", _COMMON, note="scaled learned positions"),
    Arch("glm", "glm", _COMMON),
    Arch("smollm3", "smollm3", _COMMON),
    Arch(
        "xglm",
        "xglm",
        {
            "vocab_size": V,
            "d_model": 64,
            "num_layers": 2,
            "attention_heads": 4,
            "ffn_dim": 128,
            "max_position_embeddings": 256,
            **_IDS,
        },
        note="sinusoidal positions; eager only",
    ),
    Arch(
        "gpt_neo-global",
        "gpt_neo",
        {
            "vocab_size": V,
            "hidden_size": 64,
            "num_layers": 2,
            "num_heads": 4,
            "max_position_embeddings": 256,
            "attention_types": [[["global"], 2]],
            "intermediate_size": 128,
            **_IDS,
        },
        note="global layers only; eager only",
    ),
    Arch(
        "gpt_neo-local",
        "gpt_neo",
        {
            "vocab_size": V,
            "hidden_size": 64,
            "num_layers": 2,
            "num_heads": 4,
            "max_position_embeddings": 256,
            "attention_types": [[["global", "local"], 1]],
            "window_size": WINDOW,
            "intermediate_size": 128,
            **_IDS,
        },
        refused="window by cache index",
        note="local layers (window_size)",
    ),
    Arch(
        "bloom",
        "bloom",
        {"vocab_size": V, "hidden_size": 64, "n_layer": 2, "n_head": 4, **_IDS},
        refused="ALiBi",
        note="ALiBi from the 2-D padding mask",
    ),
    Arch(
        "mpt",
        "mpt",
        {"vocab_size": V, "d_model": 64, "n_layers": 2, "n_heads": 4, "max_seq_len": 256, **_IDS},
        refused="ALiBi",
        note="ALiBi from the key length",
    ),
    Arch(
        "falcon-alibi",
        "falcon",
        {**_COMMON, "alibi": True, "new_decoder_architecture": False},
        refused="ALiBi",
        note="alibi=True",
    ),
]
BY_NAME = {a.name: a for a in ARCHS}


def build(arch: Arch, seed: int = 0) -> PreTrainedModel:
    """A seeded random model whose laws are peaked enough that greedy has no near-ties: unit-std
    embeddings and a head at std 0.25 (as rsd_tools.tiny does for the Llama/Qwen2 pairs)."""
    config = AutoConfig.for_model(arch.model_type, **arch.config)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config, attn_implementation="eager").eval()
    with torch.no_grad():
        for weight, std in ((model.get_input_embeddings().weight, 1.0), (model.get_output_embeddings().weight, 0.25)):
            weight.mul_(std / weight.std())
    return model


def noisy_copy(model: PreTrainedModel, noise: float, seed: int) -> PreTrainedModel:
    """The same architecture with every weight moved by noise·std: a correlated draft."""
    with torch.random.fork_rng(devices=[]):
        draft = AutoModelForCausalLM.from_config(model.config, attn_implementation="eager").eval()
    draft.load_state_dict(model.state_dict())
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in draft.parameters():
            if p.numel() > 1:
                p.add_(noise * p.std(unbiased=False) * torch.randn(p.shape, generator=gen))
    return draft


def save_pair(arch: Arch, out_dir: Path, seed: int = 0) -> tuple[Path, Path]:
    """(draft_dir, target_dir) of `arch` saved with save_pretrained, reused when already there."""
    from rsd_tools.tiny import word_tokenizer

    root = Path(out_dir) / f"{arch.name}-s{seed}"
    draft_dir, target_dir = root / "draft", root / "target"
    if not (root / "done").is_file():
        target = build(arch, seed)
        draft = noisy_copy(target, 0.1, seed + 1)
        tokenizer = word_tokenizer(V)
        for model, sub in ((draft, draft_dir), (target, target_dir)):
            model.save_pretrained(sub)
            tokenizer.save_pretrained(sub)
        (root / "done").touch()
    return draft_dir, target_dir
