"""Tiny random draft/target pairs (Llama, Qwen2, GPT-2 or OPT), saved like real checkpoints, without any hub access.

The target is a seeded random model. The draft is the target cut to its first layers (same
embedding, final norm and head) with seeded noise on every weight, so the two next-token laws
differ but are correlated, as for a real small/large pair. Both share one word-level tokenizer:
    ids 0..3: <pad> <eos> <bos> <unk>; id 4 + i: "w{i}"
so "w0 w1" encodes to [4, 5] and any other word to <unk>. Its chat template (TINY_CHAT_TEMPLATE) writes
each message as "<bos> ROLE CONTENT <eos>" (roles encode to <unk>) and the generation prompt as
"<bos> assistant", so chat works on the tiny models too; <eos> ends a turn.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from pathlib import Path

import torch
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import WhitespaceSplit
from transformers import (
    AutoModelForCausalLM,
    GPT2Config,
    LlamaConfig,
    OPTConfig,
    PretrainedConfig,
    PreTrainedModel,
    PreTrainedTokenizerFast,
    Qwen2Config,
)

SPECIAL_TOKENS = {"pad_token": "<pad>", "eos_token": "<eos>", "bos_token": "<bos>", "unk_token": "<unk>"}
FAMILIES = {"llama": LlamaConfig, "qwen2": Qwen2Config, "gpt2": GPT2Config, "opt": OPTConfig}
_DONE = "rsd_tiny_done"  # written last, inside the temporary folder that becomes the pair
TINY_CHAT_TEMPLATE = (
    "{% for message in messages %}<bos> {{ message['role'] }} {{ message['content'] }} <eos> {% endfor %}"
    "{% if add_generation_prompt %}<bos> assistant {% endif %}"
)


def word_tokenizer(vocab_size: int) -> PreTrainedTokenizerFast:
    """The word-level tokenizer described in the module docstring, with `vocab_size` ids."""
    specials = list(SPECIAL_TOKENS.values())
    if vocab_size <= len(specials):
        raise ValueError(f"vocab_size must exceed the {len(specials)} special tokens, got {vocab_size}")
    words = specials + [f"w{i}" for i in range(vocab_size - len(specials))]
    tok = Tokenizer(WordLevel({w: i for i, w in enumerate(words)}, unk_token=SPECIAL_TOKENS["unk_token"]))
    tok.pre_tokenizer = WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, chat_template=TINY_CHAT_TEMPLATE, **SPECIAL_TOKENS)


def _add_chat_template(model_dir: Path) -> None:
    """Give a pair built before the tiny tokenizer had a chat template one (written whole, then renamed)."""
    path = model_dir / "chat_template.jinja"
    config = model_dir / "tokenizer_config.json"
    if path.is_file() or (config.is_file() and '"chat_template"' in config.read_text()):
        return
    tmp = path.with_name(f".{path.name}.{os.getpid()}")
    tmp.write_text(TINY_CHAT_TEMPLATE)
    tmp.replace(path)


def tiny_config(family: str, vocab_size: int, hidden_size: int, num_layers: int) -> PretrainedConfig:
    """A small config with 4 query heads (llama and qwen2: 2 K/V heads, grouped-query attention), a feed-forward
    width of twice the hidden size and an untied head. gpt2's layers are transformers' Conv1D, opt's learned
    positions are offset by 2: the architectures whose exactness on the served path the tests check too."""
    if family not in FAMILIES:
        raise ValueError(f"family must be one of {sorted(FAMILIES)}, got {family!r}")
    sizes = {  # each family's names for the same sizes
        "gpt2": {"n_embd": hidden_size, "n_inner": 2 * hidden_size, "n_layer": num_layers, "n_head": 4},
        "opt": {"hidden_size": hidden_size, "word_embed_proj_dim": hidden_size, "ffn_dim": 2 * hidden_size},
    }.get(family, {"hidden_size": hidden_size, "intermediate_size": 2 * hidden_size, "num_key_value_heads": 2})
    return FAMILIES[family](
        vocab_size=vocab_size,
        **sizes,
        num_hidden_layers=num_layers,
        num_attention_heads=4,
        max_position_embeddings=4096,
        initializer_range=0.05,  # layer weights; see _target_model for embedding and head
        tie_word_embeddings=False,
        pad_token_id=0,
        eos_token_id=1,
        bos_token_id=2,
        dtype="float32",
    )


def _random_model(config: PretrainedConfig, seed: int) -> PreTrainedModel:
    with torch.random.fork_rng(devices=[]):  # leave the caller's global RNG untouched
        torch.manual_seed(seed)
        return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa").eval()


def _target_model(config: PretrainedConfig, seed: int) -> PreTrainedModel:
    """A random model whose laws look like a language model's rather than near-uniform noise.

    With the usual init the logits have std ~0.2 (flat laws) and, at larger init, the layers swamp
    the token embedding (a draft with fewer layers is then uncorrelated). A unit-std embedding
    keeps the residual stream led by the current token, layers at std 0.05 add a visible context
    effect, and a head at std 0.25 gives an entropy of about half of log V (measured at V=256:
    top-1 agreement with the draft ~60%, total variation ~0.25).
    """
    model = _random_model(config, seed)
    with torch.no_grad():
        for weight, std in ((model.get_input_embeddings().weight, 1.0), (model.get_output_embeddings().weight, 0.25)):
            weight.mul_(std / weight.std())
    return model


def _draft_from_target(target: PreTrainedModel, config: PretrainedConfig, noise: float, seed: int) -> PreTrainedModel:
    """Target's first layers (as many as `config` has), embedding, norm and head, each weight plus
    noise·std(weight)."""
    draft = _random_model(config, seed)
    gen = torch.Generator().manual_seed(seed)
    target_params = dict(target.named_parameters())
    with torch.no_grad():
        for name, param in draft.named_parameters():  # every draft name exists in the target
            src = target_params[name]
            param.copy_(src + noise * src.std(unbiased=False) * torch.randn(src.shape, generator=gen))
    return draft


def build_tiny_pair(
    out_dir: str | Path,
    family: str = "llama",
    vocab_size: int = 256,
    seed: int = 0,
    *,
    hidden_size: int = 128,
    num_layers: int = 4,
    draft_layers: int = 2,
    draft_noise: float = 0.1,
) -> tuple[Path, Path]:
    """Build (or reuse) a tiny pair under out_dir/<family>-v<vocab>-s<seed>-..., return (draft_dir, target_dir).

    Same arguments give bit-identical weights; an existing complete pair is reused as is.
    """
    name = f"{family}-v{vocab_size}-s{seed}-d{hidden_size}-l{num_layers}-dl{draft_layers}-n{draft_noise}"
    root = Path(out_dir) / name
    draft_dir, target_dir = root / "draft", root / "target"
    if (root / _DONE).is_file():
        for model_dir in (draft_dir, target_dir):
            _add_chat_template(model_dir)
        return draft_dir, target_dir
    if not 0 < draft_layers <= num_layers:
        raise ValueError(f"draft_layers must be in [1, {num_layers}], got {draft_layers}")

    tokenizer = word_tokenizer(vocab_size)
    target = _target_model(tiny_config(family, vocab_size, hidden_size, num_layers), seed)
    draft_config = tiny_config(family, vocab_size, hidden_size, draft_layers)
    draft = _draft_from_target(target, draft_config, draft_noise, seed + 1)
    # Build in a temporary sibling and rename, so an interrupted build never looks complete.
    root.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=root.parent))
    for model, sub in ((draft, "draft"), (target, "target")):
        model.save_pretrained(tmp / sub)
        tokenizer.save_pretrained(tmp / sub)
    (tmp / _DONE).touch()
    try:
        tmp.rename(root)  # atomic: `root` is either absent or complete
    except OSError:
        if not (root / _DONE).is_file():
            raise
        shutil.rmtree(tmp)  # another process built the same pair first
    return draft_dir, target_dir


def build_tiny_vocab_pair(
    out_dir: str | Path, vocab_size: int = 8, family: str = "llama", seed: int = 0
) -> tuple[Path, Path]:
    """A pair with a vocabulary small enough to enumerate (statistical tests): 4 specials + words."""
    return build_tiny_pair(out_dir, family, vocab_size, seed)


# Every type the quantised kernel computes from, and the float ones, in one target (K-quants need K % 256 == 0).
TARGET_GGUF_TYPES = {
    "attn_q": "Q4_K",
    "attn_k": "Q5_0",
    "attn_v": "Q6_K",
    "attn_output": "Q8_0",
    "ffn_gate": "Q4_K",
    "blk.0.ffn_up": "F16",
    "blk.1.ffn_up": "BF16",
    "ffn_down": "Q6_K",
    "token_embd": "Q8_0",
    "output": "Q6_K",
}
DRAFT_GGUF_TYPES = {"attn_q": "Q5_0", "attn_k": "Q5_0", "ffn_down": "Q4_K", "output": "Q8_0"}  # else Q8_0


def build_tiny_gguf_pair(
    out_dir: str | Path, family: str = "qwen2", vocab_size: int = 256, seed: int = 0, **kwargs
) -> tuple[Path, Path]:
    """The tiny pair of build_tiny_pair (hidden size 256 unless given) written as GGUF folders, as `rsd
    provision` lays out a real pair: <root>-gguf/{draft,target}/model.gguf beside the tokenizer files.
    Types: TARGET_GGUF_TYPES and DRAFT_GGUF_TYPES (rsd_tools.gguf_export). Reused when complete."""
    from transformers import AutoModelForCausalLM

    from rsd_runtime.gguf_model import gguf_config
    from rsd_tools.gguf_export import write_gguf

    kwargs.setdefault("hidden_size", 256)
    draft_dir, target_dir = build_tiny_pair(out_dir, family, vocab_size, seed, **kwargs)
    root = draft_dir.parent.with_name(draft_dir.parent.name + "-gguf")
    if (root / _DONE).is_file():
        return root / "draft", root / "target"
    tmp = Path(tempfile.mkdtemp(prefix=f".{root.name}-", dir=root.parent))
    for src, sub, types in ((draft_dir, "draft", DRAFT_GGUF_TYPES), (target_dir, "target", TARGET_GGUF_TYPES)):
        model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32)
        gguf_config(write_gguf(model, tmp / sub / "model.gguf", types)).save_pretrained(tmp / sub)
        for f in src.iterdir():  # the tokenizer files (the GGUF's own vocabulary is a placeholder)
            if f.name.startswith(("tokenizer", "special_tokens", "chat_template")):
                shutil.copy(f, tmp / sub / f.name)
    (tmp / _DONE).touch()
    try:
        tmp.rename(root)
    except OSError:
        if not (root / _DONE).is_file():
            raise
        shutil.rmtree(tmp)
    return root / "draft", root / "target"
