"""rsd: the pure algorithm of Recursive Speculative Decoding (Jeon et al., 2024, arXiv 2402.14160).

Plain torch, no I/O: trees, sampling transforms, drafting strategies, acceptance rules.
Services and model runners live elsewhere and call in here.

Shape letters, used everywhere in this package (and in `# [N, V]` comments on the line that makes
a tensor):
    B  requests in a batch
    N  draft-tree nodes; node 0 is the last committed token (the root), the rest are drafts
    L  tree depth (longest root-to-leaf path, in draft tokens)
    K  branching: number of children of one node
    W  beam width (RSD-S)
    F  frontier: the nodes one drafting level expands at once
    T  committed prefix length
    V  vocabulary size

Names: `_ids` token ids, `_idx` node or row indices, `_probs` laws (rows sum to 1), `_mask` bool
(True = allowed / kept), `num_` counts. Inside rsd.acceptance the paper's letters: q the target's
law, p the draft's.

Randomness: every function that draws takes the step's rsd.random.StepRandom, and each uniform is a
pure function of (seed, stream, root position, draw, node, column) through Philox4x32-10, computed on
the law's device; nothing here touches torch's global RNG or carries a generator's state.

Glossary:
    target  the large model whose distribution the output must follow exactly.
    draft   the small model that proposes tokens.
    proposal law  the distribution a node's children were really sampled from (after every
            sampling transform and any drafter-side truncation). Exactness needs exactly it.
    accepted tokens  draft tokens the acceptance rule kept, root to leaf.
    correction token  sampled from the residual law at the first node whose children were all
            rejected.
    bonus token  sampled from the target at an accepted leaf; every step emits either a
            correction or a bonus token, so a step emits (accepted + 1) tokens.
    block efficiency  mean tokens emitted per target forward.
"""
