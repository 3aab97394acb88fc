"""Model quality checks: perplexity over held-out text."""
