"""DSpark proposer for vLLM's V1 model runner (docs/architecture.md, "Draft step";
docs/design-notes.md, "Draft sampling and verification").

After every target step the runner hands over each request's accepted tokens. For every
request that got a bonus token ``a`` at position ``p+1``, one parallel draft forward over
``[a, N, .., N]`` (``DeepseekV41ForCausalLM.draft_block``) gives base logits; the sequential
Markov head then samples ``d_0 .. d_{k-1}`` (greedy: lowest id on ties; otherwise the
request's temperature, top-k and top-p, from a generator seeded by the request's seed and
``p`` when it has one) and the confidence head scores each. The draft distributions go to
vLLM's rejection sampler with the drafts, so verification is exact speculative sampling.
With adaptive verification only the slots chosen by ``adaptive.choose_draft_counts`` are
returned (a prefix per request); vLLM's scheduler verifies exactly those.

With data parallelism (``data_parallel_size > 1``) the stages' MoE runs over the expert
group, so every data-parallel rank takes part in every draft step: a rank with nothing to
draft this step (no request got a bonus token, or every drafting request is at the length
limit) runs ``dummy_draft`` instead, and an idle rank runs it after each of vLLM's dummy
batches (``V41RunnerMixin._dummy_run``), as vLLM's own drafters do with their ``dummy_run``.
A step is always one draft forward, whatever the requests' ``k`` and whatever adaptive
verification then keeps (it picks from drafts already made), so every rank makes the same
collective calls per step without agreeing on ``k``.
"""

from __future__ import annotations

import logging
import time

import torch

from deepinfer_vllm.configs.dspark import dspark_settings
from deepinfer_vllm.model_executor.layers.step_state import StepState
from deepinfer_vllm.ops.dspark import confidence, markov_logits
from deepinfer_vllm.spec_decode.adaptive import CostTable, OnlineAcceptance, choose_draft_counts, survivals

__all__ = ["DSparkProposer"]

logger = logging.getLogger(__name__)

# vLLM treats temperatures below this as greedy (``vllm.v1.sample.sampler._SAMPLING_EPS``).
GREEDY_EPS = 1e-5
# RNG tag of draft sampling (DeepInfer's "mtp" stream: seed + 1000000007).
DRAFT_SEED_TAG = 1_000_000_007


def draft_generator(seed: int, anchor: int) -> torch.Generator:
    """The generator of a seeded request's drafts after anchor ``p``: the same draws alone or
    in any batch."""
    g = torch.Generator()
    g.manual_seed((int(seed) * 0x9E3779B97F4A7C15 + DRAFT_SEED_TAG + int(anchor)) % (2**63))
    return g


class DSparkProposer:
    """The drafter vLLM's runner builds for ``method="custom_class"`` (see ``spec_decode.config``)."""

    def __init__(self, vllm_config):
        settings = dspark_settings(vllm_config)
        if settings is None:
            raise RuntimeError("DSparkProposer needs the settings deepinfer's platform records")
        self.settings = settings
        self.k = settings.num_speculative_tokens
        self.max_model_len = int(vllm_config.model_config.max_model_len)
        self.data_parallel_size = int(vllm_config.parallel_config.data_parallel_size)
        self.model = None
        self.verify_costs = CostTable()
        self.draft_costs = CostTable()
        self.online: OnlineAcceptance | None = None
        # req_id -> online-estimator features of the drafts it returned last step.
        self._last_features: dict[str, list[float]] = {}

    # vLLM's runner calls these two --------------------------------------------------
    def load_model(self, model) -> None:
        if getattr(model, "mtp", None) is None:
            raise RuntimeError("DSpark is on but the model was built without its stages")
        self.model = model
        if self.settings.adaptive and model.mtp[-1].confidence_head is None:
            self.online = OnlineAcceptance(self.k)

    def propose(self, *args, **kwargs):
        raise RuntimeError("DSpark drafts are driven by DeepInfer's model runner (DSparkProposer.draft)")

    # start-up profile -------------------------------------------------------------------
    def profile(self, run_target, max_tokens: int, sync=None) -> None:
        """Median target-step times at 1, 2, 4, .. tokens (``run_target(n)`` runs one step).

        ``sync()`` waits for the device (the runner's ``_sync_device``): a device step
        returns once queued, so the clock is read only after it; without it the table would
        hold enqueue times. Each size runs once unmeasured first (its operators' first call)."""
        sync = sync or (lambda: None)
        sizes, n = [], 1
        while n < max_tokens:
            sizes.append(n)
            n *= 2
        sizes.append(max_tokens)
        for n in sizes:
            run_target(n)
            for _ in range(3):
                sync()
                t0 = time.perf_counter()
                run_target(n)
                sync()
                self.verify_costs.observe(n, time.perf_counter() - t0)
        logger.info("DSpark verification cost table (tokens, s): %s", self.verify_costs.table())

    def _draft_cost(self, num_reqs: int) -> float:
        if self.draft_costs:
            return self.draft_costs(num_reqs)
        # Before any draft ran: the stages' share of a target step over the draft rows.
        a = self.model.arch
        return self.verify_costs(num_reqs * self.k) * a.num_dspark_layers / a.num_layers

    # one step -----------------------------------------------------------------------------
    @torch.no_grad()
    def draft(
        self,
        runner,
        sampled: list[list[int]],
        step_metadata: dict,
        num_draft_tokens: list[int] | None,
    ) -> tuple[list[list[int]], torch.Tensor | None]:
        """Drafts per request of ``runner.input_batch`` (empty where none) and the draft
        distributions ``[num_reqs, k, V]`` (None when every drafting request is greedy)."""
        batch = runner.input_batch
        req_ids = list(batch.req_ids)
        k = self.k
        if self.online is not None and num_draft_tokens is not None:
            self._observe(req_ids, sampled, num_draft_tokens)
        rows, bonus, anchor = [], [], []
        for i, req_id in enumerate(req_ids):
            toks = sampled[i] if i < len(sampled) else []
            if not toks:
                continue
            p = int(batch.num_tokens_no_spec[i]) - 2  # the bonus token sits at p + 1
            if p + k >= self.max_model_len:
                continue
            rows.append(i)
            bonus.append(int(toks[-1]))
            anchor.append(p)
        drafts: list[list[int]] = [[] for _ in req_ids]
        if not rows or not step_metadata:
            if self.data_parallel_size > 1:
                self.dummy_draft(runner.device, runner.dtype)
            return drafts, None
        R = len(rows)
        # Draft costs feed adaptive verification only; timed on the device (as ``profile``).
        sync = runner._sync_device if self.settings.adaptive else None
        if sync is not None:
            sync()
        t0 = time.perf_counter()
        any_layer = next(iter(step_metadata))
        state = StepState.from_metadata(step_metadata, any_layer)
        rows_t = torch.tensor(rows, dtype=torch.int64)
        bonus_t = torch.tensor(bonus, dtype=torch.int64)
        anchor_t = torch.tensor(anchor, dtype=torch.int64)
        hh, base = self.model.draft_block(bonus_t, anchor_t, rows_t, k, state)
        hh = hh.view(R, k, -1)
        base = base.view(R, k, -1)
        V = base.shape[-1]

        params = [runner.requests[req_ids[i]].sampling_params for i in rows]
        greedy = torch.tensor([sp.temperature < GREEDY_EPS for sp in params])
        random_rows = (~greedy).nonzero(as_tuple=True)[0].tolist()
        gens = [
            draft_generator(sp.seed, anchor[j]) if sp.seed is not None and not bool(greedy[j]) else None
            for j, sp in enumerate(params)
        ]
        last = self.model.mtp[-1]
        # markov_logits works in fp32; widen the [V, rank] head once per step, not once per slot.
        embed, head = last.markov_head.embed.weight, last.markov_head.head.weight.float()
        proj = None if last.confidence_head is None else last.confidence_head.proj.weight
        tokens = torch.empty(R, k, dtype=torch.int64)
        conf = torch.empty(R, k, dtype=torch.float64)
        probs_out = torch.zeros(len(req_ids), k, V, dtype=torch.float32) if random_rows else None
        prev = bonus_t
        for i in range(k):
            logits, e = markov_logits(base[:, i], prev, embed, head)
            d = torch.argmax(logits, dim=-1)  # first maximum: lowest id on ties
            if random_rows:
                q = self._distribution(logits[random_rows], [params[j] for j in random_rows])
                for n, j in enumerate(random_rows):
                    d[j] = torch.multinomial(q[n], 1, generator=gens[j]).squeeze(0)
                    probs_out[rows[j], i] = q[n]
            tokens[:, i] = d
            if proj is not None:
                conf[:, i] = confidence(proj, hh[:, i], e).double()
            else:
                top = torch.softmax(logits, dim=-1).amax(dim=-1)
                conf[:, i] = OnlineAcceptance.feature(top)
            prev = d
        if sync is not None:
            sync()
            self.draft_costs.observe(R, time.perf_counter() - t0)

        counts = [k] * R
        if self.settings.adaptive:
            acc = conf if self.online is None else self.online.predict(conf)
            counts, budget = choose_draft_counts(survivals(acc), self.verify_costs, self._draft_cost(R))
            logger.debug("DSpark adaptive verification: budget %d of %d drafts over %d requests", budget, R * k, R)
        self._last_features = {}
        for j, i in enumerate(rows):
            drafts[i] = tokens[j, : counts[j]].tolist()
            if self.online is not None:
                self._last_features[req_ids[i]] = conf[j, : counts[j]].tolist()
        return drafts, probs_out

    @torch.no_grad()
    def dummy_draft(self, device, dtype: torch.dtype) -> None:
        """A draft step that drafts nothing: each stage's MoE over one zero row
        (``DSparkStage.dummy_forward``), so this data-parallel rank's draft step meets the
        other ranks' in the expert group (see the module docstring)."""
        for stage in self.model.mtp:
            stage.dummy_forward(1, dtype, device)

    @staticmethod
    def _distribution(logits: torch.Tensor, params) -> torch.Tensor:
        """The draft distribution of sampled requests: temperature, then top-k / top-p."""
        from vllm.v1.sample.ops.topk_topp_sampler import apply_top_k_top_p

        V = logits.shape[-1]
        temp = torch.tensor([sp.temperature for sp in params], dtype=torch.float32)
        x = logits / temp.unsqueeze(1)
        top_k = torch.tensor([sp.top_k if 0 < sp.top_k < V else V for sp in params], dtype=torch.int64)
        top_p = torch.tensor([sp.top_p for sp in params], dtype=torch.float32)
        x = apply_top_k_top_p(
            x, None if bool((top_k == V).all()) else top_k, None if bool((top_p >= 1).all()) else top_p
        )
        return torch.softmax(x, dim=-1)

    def _observe(self, req_ids, sampled, num_draft_tokens) -> None:
        """Outcomes of last step's drafts for the online estimator: accepted slots 1, the first
        rejected one 0."""
        feats, slots, labels = [], [], []
        for i, req_id in enumerate(req_ids):
            f = self._last_features.get(req_id)
            n = num_draft_tokens[i] if i < len(num_draft_tokens) else 0
            if not f or n == 0 or i >= len(sampled) or not sampled[i]:
                continue
            accepted = len(sampled[i]) - 1
            for s in range(min(n, accepted + 1, len(f))):
                feats.append(f[s])
                slots.append(s)
                labels.append(1 if s < accepted else 0)
        if feats:
            self.online.observe(feats, slots, labels)
