"""DSpark speculative decoding for V4.1 (docs/architecture.md, "DSpark"; docs/design-notes.md, "DSpark").

The settings (vLLM's ``speculative_config`` validated and recorded at config time) are
``configs.dspark``; the draft stages inside the model (context keys, parallel draft
forward) are ``model_executor.models.dspark_draft``. Here: ``proposer``: per-step drafting, sampling and confidences, driven by
DeepInfer's model runner; ``adaptive``: how many drafts each request verifies.
Device-agnostic torch; the platforms' runners drive it.
"""
