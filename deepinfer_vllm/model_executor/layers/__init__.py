"""The layers of DeepSeek-V4.1 on vLLM: attention, mHC, MoE, Engram, norms and the GEMMs over the
released weight formats."""
