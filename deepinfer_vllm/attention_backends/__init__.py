"""DeepInfer's attention backend for DeepSeek-V4.1 on vLLM: the paged cache specs (MXFP8 window,
FP4 compressed KV, MXFP4 index keys, the compressor ring), their byte layout and the step metadata."""
