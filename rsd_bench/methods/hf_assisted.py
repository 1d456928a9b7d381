"""The outside peer: transformers' assisted generation with the same two models."""

from __future__ import annotations

import time

from rsd_bench.methods.planning import Spec

# transformers 5.24's defaults for assisted generation (GenerationConfig._get_default_generation_params).
_HF_DEFAULTS = {
    "num_assistant_tokens": 20,
    "num_assistant_tokens_schedule": "constant",
    "assistant_confidence_threshold": 0.4,
}


class _StepStreamer:
    """A transformers streamer that timestamps each put: the prompt first, then one put per step."""

    def __init__(self, marks: list):
        self.marks, self.seen_prompt = marks, False

    def put(self, value) -> None:
        if self.seen_prompt:
            self.marks.append((time.perf_counter(), int(value.numel())))
        self.seen_prompt = True

    def end(self) -> None:
        pass


def run_hf_assisted(
    target_model,
    draft_model,
    prompt_ids,
    spec: Spec,
    temperature,
    max_new,
    eos,
    seed,
    ignore_eos,
    marks: list,
    counts: dict | None = None,
):
    """One transformers assisted generation; returns (new token ids, wall seconds, settings used,
    (start, end) times); appends (time, tokens) per step to marks and adds the forwards of each model
    to counts["target"] / counts["draft"] (forward hooks: transformers reports no target calls)."""
    import copy

    import torch

    gen_cfg = copy.deepcopy(target_model.generation_config)
    gen_cfg.max_new_tokens = max_new
    gen_cfg.do_sample = temperature > 0
    gen_cfg.temperature = temperature if temperature > 0 else None
    # Explicit "off" values: None would fall back to transformers' defaults (top_k 50).
    gen_cfg.top_k, gen_cfg.top_p, gen_cfg.repetition_penalty = 0, 1.0, 1.0
    gen_cfg.eos_token_id = list(eos) or None
    gen_cfg.pad_token_id = gen_cfg.pad_token_id if gen_cfg.pad_token_id is not None else (eos[0] if eos else 0)
    if ignore_eos:
        gen_cfg.min_new_tokens = max_new
    # transformers reads the drafting settings from the assistant's own generation config (and its
    # "heuristic" schedule writes back into it): set them for this call only, then restore.
    assistant_cfg = draft_model.generation_config
    saved = copy.deepcopy(assistant_cfg)
    settings = dict(_HF_DEFAULTS)
    if spec.shape:  # k drafts per step, always: like sd:k
        settings.update(num_assistant_tokens=int(spec.shape), assistant_confidence_threshold=0.0)
    for k, v in settings.items():
        setattr(assistant_cfg, k, v)
    ids = torch.tensor([prompt_ids])
    counts = {} if counts is None else counts
    counts.setdefault("target", 0)
    counts.setdefault("draft", 0)

    def counter(role: str):
        def hook(*_):
            counts[role] += 1

        return hook

    hooks = [target_model.register_forward_hook(counter("target")), draft_model.register_forward_hook(counter("draft"))]
    torch.manual_seed(seed)
    t = time.perf_counter()
    try:
        with torch.inference_mode():
            out = target_model.generate(
                ids,
                attention_mask=torch.ones_like(ids),
                generation_config=gen_cfg,
                assistant_model=draft_model,
                streamer=_StepStreamer(marks),
            )
    finally:
        draft_model.generation_config = saved
        for hook in hooks:
            hook.remove()
    t_end = time.perf_counter()
    return out[0, len(prompt_ids) :].tolist(), t_end - t, settings, (t, t_end)
