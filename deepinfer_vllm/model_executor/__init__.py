"""Model code, checkpoint format and weight loading for DeepSeek-V4.1 on vLLM."""
