"""DSpark speculative decoding for V4.1 (spec §13, deepinfer-design §2).

``config``: vLLM's ``speculative_config`` validated and recorded at config time;
``draft_model``: the draft stages inside the model (context keys, parallel draft
forward); ``proposer``: per-step drafting, sampling and confidences, driven by
DeepInfer's model runner; ``adaptive``: how many drafts each request verifies.
Device-agnostic torch; the platforms' runners drive it.
"""
