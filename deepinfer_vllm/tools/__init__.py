"""Offline tools: random-weight V4.1 checkpoints, their presets and tokenizers."""
