"""The reward stage: scores every completion with its job's task verifier."""
