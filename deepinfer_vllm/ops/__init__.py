"""Pure-torch operators and numeric references for DeepSeek-V4.1-Flash (no vLLM imports)."""
