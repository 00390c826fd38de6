"""DeepInfer's additions to vLLM's V1 model runner, shared by every platform's runner.

vLLM's runner is reused as is; :class:`V41RunnerMixin` only adds what V4.1
needs and the V1 runner does not do, none of it device-specific:

* each request's prompt length in the step metadata, which anchors DeepInfer's
  prefill truncation of the decoder half (``DEEPINFER_PREFILL_TRUNCATION_MODE``), and
  which requests keep every prompt row (prompt logprobs);
* SWA bounded replay (vLLM's ``swa_bounded_replay``): the scheduler rewinds a
  prefix hit by the window and tells each admitted request where its replay
  starts (``NewRequestData.replay_start``); vLLM's V1 runner drops that value,
  so the mixin keeps it per request and hands each step's starts to the model
  (``V41StepMetadata.replay_start``), which clamps window attention there and
  leaves the hit's cached compressed KV as it is. A request resumed after
  preemption arrives without the field; its start is its rewound computed
  count, which is what ``_mark_prefix_replay`` sets it to;
* DSpark drafting (``spec_decode``): the drafts of every step, their
  distributions for vLLM's rejection sampler, and the cost table of adaptive
  verification, profiled once the KV caches exist; with data parallelism a
  dummy draft step wherever a rank drafts nothing (its dummy batches included),
  so the draft MoE meets the other ranks';
* seeded sampling across prefill chunks: after a step that ends inside a
  prompt, vLLM discards the request's sample and rewinds its generator by
  CUDA's offset, which CPU generators lack (the engine dies) and which need not
  hold for an NPU's generator; the runner restores the generator's state from
  before sampling instead (``patch.generator_rewind``), so a seeded request draws
  the same numbers however its prompt is chunked;
* expert load balancing where the plugin drives it (``model_executor.eplb``): the
  balancer is built after loading and stepped where vLLM steps its own EPLB state;
* Engram rows in host memory hashed on the host (``model_executor.engram_host``, ``copy``
  transfer): each step's n-gram windows, read from the host token table, in the step metadata;
* with adaptive verification, step times measured on the device: the clock is
  read after the device finished (``_sync_device``), not when the host has
  only queued the work.

Other models never see a difference (only ``V41StepMetadata`` objects are
touched, and the DSpark hooks run only with DeepInfer's proposer). The CPU
runner is ``V41RunnerMixin`` + vLLM's ``CPUModelRunner`` (``cpu_worker.py``);
the NPU runner is ``V41RunnerMixin`` + vLLM's ``GPUModelRunner``
(``ascend/worker.py``).
"""

from __future__ import annotations

import collections
import contextlib
import time

import numpy as np
import torch

from deepinfer_vllm.attention_backends.mla_swa import V41StepMetadata
from deepinfer_vllm.model_executor.engram_host import dummy_windows, step_windows
from deepinfer_vllm.model_executor.eplb import expert_balancer
from deepinfer_vllm.patch import generator_rewind
from deepinfer_vllm.spec_decode.proposer import DSparkProposer

# Adaptive verification's start-up profile stops here; larger steps are
# extrapolated from the last two sizes (the cost is linear there).
PROFILE_MAX_TOKENS = 512


class V41RunnerMixin:
    """V4.1's additions to vLLM's V1 model runner (see the module docstring); put before the
    device's runner class in the bases."""

    _v41_step_metadata: dict | None = None

    def _build_attention_metadata(self, num_tokens: int, num_reqs: int, *args, **kwargs):
        attn_metadata, spec_metadata = super()._build_attention_metadata(
            num_tokens, num_reqs, *args, **kwargs
        )
        fields = None
        windows = self._v41_engram_windows_of(num_tokens)
        layers = attn_metadata if isinstance(attn_metadata, list) else [attn_metadata]
        for per_layer in layers:
            for meta in per_layer.values():
                if isinstance(meta, V41StepMetadata):
                    if fields is None:
                        fields = self._v41_request_fields(meta.num_reqs, meta.seq_lens)
                    meta.prompt_lens, meta.full_prefill, meta.replay_start, meta.prompt_rows = fields
                    meta.engram_windows = windows
        if isinstance(attn_metadata, dict):
            self._v41_step_metadata = attn_metadata
        return attn_metadata, spec_metadata

    def _v41_request_fields(self, num_reqs: int, like: torch.Tensor) -> tuple:
        """Per-request step fields vLLM's common metadata lacks, from host values: prompt
        lengths, which requests keep every prompt row, replay starts (None when no request of
        the step is still inside its replay) and whether any token lies below its prompt length.
        ``num_reqs`` may count padding requests past the batch's own."""
        batch = self.input_batch
        real = min(batch.num_reqs, num_reqs)
        computed = batch.num_computed_tokens_cpu[:real]
        prompt = batch.num_prompt_tokens[:real]
        host = batch.num_prompt_tokens_cpu_tensor[:num_reqs]
        prompt_lens = host.to(like.device, like.dtype, non_blocking=True)
        req_ids = batch.req_ids[:real]
        full = None
        if self.num_prompt_logprobs:
            keep_all = np.zeros(num_reqs, dtype=np.bool_)
            keep_all[:real] = [rid in self.num_prompt_logprobs for rid in req_ids]
            if keep_all.any():
                full = torch.from_numpy(keep_all).to(like.device)
        replay = None
        window = self._replay_window()
        if window and self._v41_replay_starts:
            starts = np.zeros(num_reqs, dtype=np.int64)
            starts[:real] = [self._v41_replay_starts.get(rid, 0) for rid in req_ids]
            # Rows at or past the hit see no window below the start anyway.
            starts[:real][computed >= starts[:real] + window] = 0
            if starts.any():
                replay = torch.from_numpy(starts).to(like.device, like.dtype)
        return prompt_lens, full, replay, bool((computed < prompt).any())

    # ---------------------------------------------------- SWA bounded replay
    _v41_replay_window: int | None = None
    _v41_replay_starts: dict | None = None  # request id -> replay start of its last admission
    # (request id, replay start, tokens) of recent admissions (``V41WorkerMixin.deepinfer_replay_log``).
    _v41_replay_log: collections.deque | None = None
    REPLAY_LOG_LEN = 4096

    def _replay_window(self) -> int:
        """Tokens a prefix hit replays (the window groups' ``prefix_replay_tokens``; 0: none)."""
        if self._v41_replay_window is None:
            config = getattr(self, "kv_cache_config", None)
            if config is None:
                return 0
            self._v41_replay_window = max(
                (g.kv_cache_spec.prefix_replay_tokens for g in config.kv_cache_groups), default=0
            )
        return self._v41_replay_window

    def _update_states(self, scheduler_output):
        out = super()._update_states(scheduler_output)
        if self._replay_window():
            self._record_replay_starts(scheduler_output)
        return out

    def _record_replay_starts(self, scheduler_output) -> None:
        if self._v41_replay_starts is None:
            self._v41_replay_starts = {}
            self._v41_replay_log = collections.deque(maxlen=self.REPLAY_LOG_LEN)
        starts = self._v41_replay_starts
        for rid in scheduler_output.finished_req_ids:
            starts.pop(rid, None)
        admitted = [(new.req_id, new.replay_start) for new in scheduler_output.scheduled_new_reqs]
        cached = scheduler_output.scheduled_cached_reqs
        admitted += [
            (rid, cached.num_computed_tokens[i])
            for i, rid in enumerate(cached.req_ids)
            if rid in cached.resumed_req_ids
        ]
        for rid, start in admitted:
            starts[rid] = int(start)
            state = self.requests.get(rid)
            self._v41_replay_log.append((rid, int(start), None if state is None else state.num_tokens))

    # ------------------------------------------------------- seeded sampling
    _rewind: dict | None = None

    def _sample(self, logits, spec_decode_metadata):
        # The generators of requests whose sample this step discards (a prompt chunk that
        # is not the last), saved before the sampler draws (``patch.generator_rewind``).
        num_reqs = self.input_batch.num_reqs
        self._rewind = generator_rewind.save_discarded(
            self.input_batch.generators, self.discard_request_mask.np[:num_reqs]
        )
        return super()._sample(logits, spec_decode_metadata)

    def _bookkeeping_sync(self, *args, **kwargs):
        # Those states restored, and the generators hidden from vLLM's CUDA offset rewind.
        rewind, self._rewind = self._rewind or {}, None
        with generator_rewind.apply(self.input_batch.generators, rewind):
            return super()._bookkeeping_sync(*args, **kwargs)

    # ---------------------------------------------------------------- DSpark
    def _dspark(self) -> DSparkProposer | None:
        drafter = getattr(self, "drafter", None)
        return drafter if isinstance(drafter, DSparkProposer) else None

    # Steps that serve requests feed adaptive verification's cost table; profiles and the
    # warm-up (``unmeasured_steps``) do not: they time themselves, or run cold.
    _measure_steps = True

    @contextlib.contextmanager
    def unmeasured_steps(self):
        saved, self._measure_steps = self._measure_steps, False
        try:
            yield
        finally:
            self._measure_steps = saved

    def _model_forward(self, input_ids=None, positions=None, *args, **kwargs):
        drafter = self._dspark()
        if drafter is None or not drafter.settings.adaptive or not self._measure_steps:
            return super()._model_forward(input_ids, positions, *args, **kwargs)
        # The forward's device time: nothing queued before it, all of it finished after.
        self._sync_device()
        t0 = time.perf_counter()
        out = super()._model_forward(input_ids, positions, *args, **kwargs)
        self._sync_device()
        if positions is not None and self._v41_step_metadata:
            drafter.verify_costs.observe(int(positions.shape[-1]), time.perf_counter() - t0)
        return out

    def initialize_kv_cache(self, kv_cache_config, *args, **kwargs) -> None:
        super().initialize_kv_cache(kv_cache_config, *args, **kwargs)
        drafter = self._dspark()
        if drafter is not None and drafter.settings.adaptive:
            limit = min(
                self.scheduler_config.max_num_batched_tokens,
                self.scheduler_config.max_num_seqs * (1 + drafter.k),
                PROFILE_MAX_TOKENS,
            )
            # The target's steps alone (vLLM's ``_dummy_run``, not ours with its dummy draft);
            # every data-parallel rank profiles the same sizes, so their collectives meet.
            target_step = super()._dummy_run
            with self.unmeasured_steps():
                drafter.profile(lambda n: target_step(n), limit, self._sync_device)

    @torch.inference_mode()  # as vLLM's own _dummy_run: its tensors (weight workspaces) are inference tensors
    def _dummy_run(self, num_tokens: int, *args, skip_eplb: bool = False, is_profile: bool = False, **kwargs):
        drafter = self._dspark()
        if drafter is None or drafter.data_parallel_size == 1:
            return super()._dummy_run(num_tokens, *args, skip_eplb=skip_eplb, is_profile=is_profile, **kwargs)
        # An idle data-parallel rank's step (vLLM's dummy batch) meets the busy ranks' draft step
        # too (``DSparkProposer.dummy_draft``), before the EPLB step as on a busy rank (and as
        # vLLM's own drafters' ``dummy_run`` inside its ``_dummy_run``).
        out = super()._dummy_run(num_tokens, *args, skip_eplb=True, is_profile=is_profile, **kwargs)
        drafter.dummy_draft(self.device, self.dtype)
        if not skip_eplb:
            self.eplb_step(is_dummy=True, is_profile=is_profile)
        return out

    def _input_fits_in_drafter(self, common_attn_metadata) -> bool:
        if self._dspark() is None:
            return super()._input_fits_in_drafter(common_attn_metadata)
        # DSpark skips each request whose block would pass max_model_len (vLLM's test, per
        # request, in ``DSparkProposer.draft``) and so runs every step: with data
        # parallelism a skipped draft step would leave the other ranks' draft MoE waiting.
        return common_attn_metadata is not None

    def propose_draft_token_ids(
        self,
        scheduler_output,
        sampled_token_ids,
        sampling_metadata,
        hidden_states,
        sample_hidden_states,
        aux_hidden_states,
        spec_decode_metadata,
        common_attn_metadata,
        slot_mappings,
    ):
        drafter = self._dspark()
        if drafter is None:
            return super().propose_draft_token_ids(
                scheduler_output,
                sampled_token_ids,
                sampling_metadata,
                hidden_states,
                sample_hidden_states,
                aux_hidden_states,
                spec_decode_metadata,
                common_attn_metadata,
                slot_mappings,
            )
        self._draft_probs = None
        self._draft_prob_req_ids = None
        num_drafts = None if spec_decode_metadata is None else list(spec_decode_metadata.num_draft_tokens)
        drafts, probs = drafter.draft(self, sampled_token_ids, self._v41_step_metadata or {}, num_drafts)
        if probs is not None:
            self._draft_probs = probs
            self._draft_prob_req_ids = list(self.input_batch.req_ids)
        return drafts

    # ------------------------------------------------ Engram rows in host memory
    # With the ``copy`` transfer the model hashes its Engram rows on the host from the step's
    # n-gram windows, read here from the runner's host token table (``engram_host.step_windows``).
    _v41_engram_windows: torch.Tensor | None = None

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens, *args, **kwargs):
        out = super()._prepare_inputs(scheduler_output, num_scheduled_tokens, *args, **kwargs)
        model = getattr(self, "model", None)
        self._v41_engram_windows = step_windows(model, self.input_batch, num_scheduled_tokens)
        return out

    def _v41_engram_windows_of(self, num_tokens: int) -> torch.Tensor | None:
        """The windows of the step being prepared; for a dummy batch (no ``_prepare_inputs``:
        profiling, warm-up, an idle data-parallel rank), pad windows."""
        windows = self._v41_engram_windows
        if windows is not None and windows.shape[0] == num_tokens:
            return windows
        return dummy_windows(getattr(self, "model", None), num_tokens)

    # ------------------------------------------------- expert load balancing
    # The plugin's EPLB driver where vLLM's config refuses ``enable_eplb`` (``model_executor.eplb``).
    _expert_balancer = None

    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        self._expert_balancer = expert_balancer(self.get_model(), self.vllm_config)

    def eplb_step(self, is_dummy: bool = False, is_profile: bool = False) -> None:
        # vLLM calls this after every step's forward and every dummy batch (idle data-parallel
        # ranks included), so every rank of the expert group counts the same steps.
        if self._expert_balancer is None:
            return super().eplb_step(is_dummy, is_profile)
        self._expert_balancer.step(is_dummy, is_profile)


class V41WorkerMixin:
    """What every DeepInfer worker answers besides vLLM's worker API."""

    def deepinfer_replay_log(self) -> list[tuple[str, int, int | None]]:
        """Recent admissions of this worker's requests under SWA bounded replay:
        ``(request id, replay start, tokens at admission)``, replay start 0 where nothing is
        replayed (``collective_rpc("deepinfer_replay_log")``; tests pass them to the reference)."""
        return list(self.model_runner._v41_replay_log or ())

    def deepinfer_weight_bytes(self) -> dict[str, dict[str, int]]:
        """This worker's resident weight bytes per component, beside the checkpoint's
        (``collective_rpc("deepinfer_weight_bytes")``; ``deepinfer-weight-bytes``)."""
        from deepinfer_vllm.model_executor.resident_bytes import weight_bytes

        return weight_bytes(self.model_runner.get_model())
