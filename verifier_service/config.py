"""Every setting of the verifier service, with its default, in one frozen dataclass.

Read with rsd_service.serving.load_config(VerifierConfig, "verifier", argv): defaults, then
RSD_VERIFIER_<FIELD> environment variables, then --field flags (e.g. --max-batch-nodes 256).
Network, security, limits, operations, model and registry fields: rsd_service.config.
"""

from __future__ import annotations

from dataclasses import dataclass

from rsd_service.config import ModelServiceConfig


@dataclass(frozen=True)
class VerifierConfig(ModelServiceConfig):
    """rsd verifier: holds the target model and batches the draft trees of many sessions."""

    # Name in the registry and in AttachResponse.verifier_id ("" = "verifier-<host>-<port>").
    verifier_id: str = ""
    # KV pool: sessions held at once (each holds max_len tokens).
    num_slots: int = 8
    # Largest tree (nodes, root included) one DraftTree may carry; reported on Attach.
    max_tree_nodes: int = 64
    # Batching: after the first tree arrives, wait at most batch_wait_ms for trees of other sessions,
    # and pack at most max_batch_nodes tokens (tree nodes + prefill chains) into one forward (a single
    # larger request still runs, alone). batching=False verifies one tree per forward (benchmarks).
    batching: bool = True
    batch_wait_ms: float = 2.0
    max_batch_nodes: int = 512
    # An attached session is not evicted for this long before its first tree (its drafter drafts it).
    attach_grace_s: float = 30.0
    # An Attach that finds every slot held by a session with an open Verify stream waits this long for
    # one to close (a finished run's stream closes as its last tokens leave) before RESOURCE_EXHAUSTED.
    attach_wait_s: float = 2.0

    def checks(self) -> dict[str, bool]:
        return {
            **super().checks(),
            "num_slots": self.num_slots >= 1,
            "max_tree_nodes": 1 <= self.max_tree_nodes < self.max_len,
            "batch_wait_ms": self.batch_wait_ms >= 0,
            "max_batch_nodes": self.max_batch_nodes >= 1,
            "attach_grace_s": self.attach_grace_s > 0,
            "attach_wait_s": self.attach_wait_s >= 0,
        }
