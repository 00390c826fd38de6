"""vLLM model classes: ``DeepseekV41ForCausalLM`` (registered lazily by ``deepinfer_vllm.register``)."""
