"""DeepInfer's corrections of vLLM 0.32's behaviour, one module each.

Each module's docstring says what vLLM does (file and function), why that is wrong or
not enough for V4.1 or this plugin, what the correction does, in which process and at
which moment it is applied, and when it can be removed. Each is applied through one
explicit call, made where the correction belongs (plugin entry point, platform, worker,
runner), and changes nothing until then. ``tests/patch/`` checks, for each, that the
installed vLLM still behaves as the docstring says (so a vLLM upgrade that changes it
fails there) and that the correction gives the corrected behaviour.

* ``config_registry``: vLLM's config registry names vLLM's own V4.1 config class;
  DeepInfer's class is put there and in ``AutoConfig`` (plugin entry point).
* ``structured_outputs`` (with its catalogue ``schema_keywords``): xgrammar's JSON
  grammars, as vLLM compiles them, admit control characters in length-bounded strings
  and unbounded whitespace, and vLLM's request validation accepts keywords xgrammar
  ignores and sends some schemas to guidance; for V4.1, grammars are bounded, such
  keywords refused, and schemas kept on xgrammar (plugin entry point).
* ``rejection_sampler``: vLLM's CPU fallback of the rejection sampler's
  ``expand_kernel`` never writes float outputs; a torch kernel replaces it (CPU
  platform, each worker).
* ``cpu_worker_runner``: vLLM's CPU worker builds its runner by class name; DeepInfer's
  runner is named there during ``init_device`` (CPU worker).
* ``generator_rewind``: vLLM's runner rewinds a discarded sample's seeded generator by
  CUDA's offset; the state from before sampling is restored instead (DeepInfer's
  runners, each step).
* ``torch_device_calls``: vLLM's GPU runner calls ``torch.cuda`` streams and events and
  ``torch.accelerator`` synchronisation by name; they are the NPU's while the NPU worker
  lives (Ascend worker).

Layering: this package sits below ``platforms`` and ``entrypoints`` (they call it) and
imports only ``envs``, ``ops``, ``configs`` and vLLM.
"""
