"""The layers of DeepSeek-V4.1 on vLLM: attention (``v41_attention``), mHC (``v41_mhc``), MoE
(``v41_moe``), Engram (``v41_engram``), norms (``norm``), linears (``linear``), parameters held in
the checkpoint's dtype (``params``), the step's state (``step_state``) and parallel layout
(``parallel``). The GEMMs over the released weight formats are ``ops.weight_gemm``."""
