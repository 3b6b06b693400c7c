"""The ref stage: per-token log-probs of completions under a frozen reference model."""
