"""Runtime: model loading, tree-attention runner, in-process generator, CLI."""
