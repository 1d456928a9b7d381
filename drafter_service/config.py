"""Every setting of the drafter service, with its default, in one frozen dataclass.

Read with rsd_service.serving.load_config(DrafterConfig, "drafter", argv): defaults, then
RSD_DRAFTER_<FIELD> environment variables, then --field flags (e.g. --proposal-top-k 64).
Network, security, limits, operations, model and registry fields: rsd_service.config.
"""

from __future__ import annotations

from dataclasses import dataclass

from rsd_runtime import QUANTIZE_MODES
from rsd_service.config import ModelServiceConfig, PeerTLSConfig


@dataclass(frozen=True)
class DrafterConfig(PeerTLSConfig, ModelServiceConfig):
    """rsd drafter: holds the draft model and runs each session's speculative loop against a verifier."""

    drafter_id: str = ""  # "" = "drafter-<host>-<port>"
    # Sessions held at once: a session's runner (and its draft cache of max_len tokens) is kept after
    # its run for the session's next turn and evicted least-recently-used when a new session needs one.
    max_sessions: int = 8
    # Drafter-side truncation of the proposal law: children are sampled from the draft's top-k
    # (0 = off) / top-p (1.0 = off) tokens, renormalised, and exactly that law travels. Exactness
    # holds for any law the drafter really sampled from (the verifier uses the law on the wire);
    # truncation only trades acceptance for wire size. Default 256: for Qwen2.5 (V = 151,936) a
    # dense law is 600 KB per internal node, a top-256 law 2 KB (sparse int32 ids + float32
    # probs), and the draft's mass beyond its top 256 is small. For V <= 256 it changes nothing.
    proposal_top_k: int = 256
    proposal_top_p: float = 1.0
    # Draft vocabulary: the draft model scores only its first draft_vocab ids (0 = all; see
    # rsd_runtime.models.PrunedLMHead): a cheaper output layer, still exact.
    draft_vocab: int = 0
    # Context lookups merged into the model's trees (rsd.lookup.HybridProposal): a node whose context ends
    # in a repeated n-gram of at least lookup_n tokens takes the law of what followed it, with no draft
    # forward (0 = off). Exact like any draft law; it pays where the text repeats (code).
    lookup_n: int = 0
    # Quantisation of the draft model (rsd_runtime.models.quantize_draft): "none", "int8" (int8 linear
    # layers on the CPU, per-row activations on an AVX512-VNNI kernel where the CPU has one, else torch's
    # dynamic int8; exact,
    # since the verifier judges each proposal with the law it was drawn from), "auto" (int8 where the
    # VNNI kernel takes every layer of a drafter too large for the cache: models.int8_auto; never by
    # timing). int8 needs dtype float32 or auto. The verifier has no such setting: the target is never quantised.
    quantize: str = "none"
    # Largest tree (nodes, root included) a run may draft; the verifier's own limit (from Attach)
    # applies too.
    max_tree_nodes: int = 64
    # Verifier calls: deadline of Attach (which may queue behind a forward) in seconds. A verdict not
    # back within verify_timeout_s, or a Verify stream that broke, is resent on a fresh stream,
    # verify_attempts times in all.
    # Pre-drafting (rsd_runtime.predraft): while a tree is verified, draft the next tree for up to
    # predraft_outcomes predicted verdicts (fewer when the verdict comes back sooner than that takes);
    # a verdict that matches one sends its tree at once. Exact: the output is token for token the
    # same with it on or off; it costs draft forwards on trees that are never sent.
    predraft: bool = True
    predraft_outcomes: int = 4
    # How many of those trees are drafted at once, each on a shadow copy of the session's draft runner,
    # their levels packed into one forward (rsd_runtime.predraft.draft_wave; needs batching). 1 drafts
    # them one after another: the output is token for token the same as without pre-drafting. > 1 keeps
    # the law exact, but packing changes the draft logits' rounding (int8: the activations' scale), so a
    # seeded run may differ at near-ties; it holds up to predraft_outcomes more runners per session.
    predraft_width: int = 1
    # Batched drafting (rsd_runtime.packed): the draft forwards of all sessions drafting at once run as
    # one forward (a level of a few tokens costs about one token's forward, so 8 sessions cost far
    # less than 8 x one). A forward waits at most batch_wait_ms for sessions that are drafting but
    # have not asked for their next forward yet, and packs at most max_batch_nodes tokens.
    # batching=False runs each session's forwards on their own (benchmarks).
    batching: bool = True
    batch_wait_ms: float = 10.0
    max_batch_nodes: int = 256
    attach_timeout_s: float = 30.0
    verify_timeout_s: float = 60.0
    verify_attempts: int = 3

    def checks(self) -> dict[str, bool]:
        return {
            **super().checks(),
            "max_sessions": self.max_sessions >= 1,
            "proposal_top_k": self.proposal_top_k >= 0,
            "proposal_top_p": 0 < self.proposal_top_p <= 1,
            "draft_vocab": self.draft_vocab >= 0,
            "lookup_n": self.lookup_n >= 0,
            "quantize": self.quantize in QUANTIZE_MODES,
            "max_tree_nodes": 2 <= self.max_tree_nodes < self.max_len,
            "predraft_outcomes": self.predraft_outcomes >= 1,
            "predraft_width": self.predraft_width >= 1,
            "batch_wait_ms": self.batch_wait_ms >= 0,
            "max_batch_nodes": self.max_batch_nodes >= 1,
            "attach_timeout_s": self.attach_timeout_s > 0,
            "verify_timeout_s": self.verify_timeout_s > 0,
            "verify_attempts": self.verify_attempts >= 1,
        }

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.quantize == "int8" and self.dtype in ("bfloat16", "float16"):
            raise ValueError(
                f"invalid DrafterConfig: quantize='int8' computes in float32 activations, dtype={self.dtype!r}: "
                "use dtype float32 or auto"
            )
        if self.quantize == "int8" and not self.device.startswith("cpu"):
            raise ValueError(f"invalid DrafterConfig: quantize='int8' runs on the CPU only, device={self.device!r}")
