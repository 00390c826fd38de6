"""Expert-parallel load balancing (EPLB) of V4.1's routed experts while serving.

Where it is turned on (``eplb_settings``):

* vLLM's own spelling, ``enable_eplb=True`` and ``eplb_config={...}``, wherever vLLM accepts it
  (CUDA, ROCm, XPU). vLLM's ``EplbState`` then drives the model through the ``MixtureOfExperts``
  interface the model class implements (maps, load counters, expert weights).
* On the plugin's platforms (CPU, Ascend), where vLLM's config check refuses ``enable_eplb``, the
  same fields under ``additional_config``: ``additional_config={"enable_eplb": True, "eplb_config":
  {"window_size": ..., "step_interval": ..., "num_redundant_experts": ...}}`` (``--additional-config``
  on the command line). The plugin's runner drives the balancing with ``ExpertBalancer``.

Physical slots are ``n_routed_experts + num_redundant_experts``, split equally over the expert group
(``enable_expert_parallel`` is required). Every MoE layer routes its logical expert ids to physical
slots through a logical-to-physical map on the device (``ops.eplb.logical_to_physical``) and counts,
with ``scatter_add`` on the device and no host synchronisation, where this rank's own tokens went
(vLLM's convention: the sum over the group is what each physical expert received; a data-parallel
rank's dummy batches are its own, so it leaves them out).

``ExpertBalancer`` is stepped once per forward that vLLM's runner steps (``eplb_step``: real steps,
and dummy batches of idle data-parallel ranks, which run every MoE collective, so the expert group
steps in lockstep). It keeps the last ``window_size`` steps' loads; every ``step_interval`` steps it
marks a rebalance due, and the rebalance runs at the start of the model's next forward
(``run_pending``): vLLM steps an idle rank's state before its dummy draft step and a busy rank's
after its DSpark draft step, so only there do all ranks stand between the same collectives. The
rebalance sums the window over the expert group, computes DeepSeek's placement
(``ops.eplb.balance_experts``, the same on every rank), moves the expert weights that change slot
between ranks with point-to-point collectives on the expert group (gloo on CPU, the device group
elsewhere) and then swaps the maps.
Requests in flight are untouched: the move runs between two steps, and a replica holds the same bytes
as its expert, so outputs do not depend on the placement (``layers.v41_moe``).
"""

from __future__ import annotations

import logging
import math
import time
from typing import Any, NamedTuple

import torch
import torch.distributed as dist

from deepinfer_vllm.model_executor.layers.parallel import all_reduce
from deepinfer_vllm.ops.eplb import (
    ExpertMove,
    ExpertPlacement,
    balance_experts,
    imbalance,
    initial_placement,
    plan_moves,
    rank_loads,
)

logger = logging.getLogger(__name__)

__all__ = [
    "EplbSettings",
    "ExpertBalancer",
    "check_eplb",
    "eplb_settings",
    "expert_balancer",
    "move_expert_weights",
]

# vLLM's EPLBConfig fields the plugin's own balancer reads; ``policy`` only as vLLM's "default".
PLUGIN_FIELDS = ("window_size", "step_interval", "num_redundant_experts", "log_balancedness", "policy")


class EplbSettings(NamedTuple):
    """EPLB's settings, read from vLLM's config (``eplb_settings``)."""

    window_size: int
    step_interval: int
    num_redundant_experts: int
    log_balancedness: bool
    driver: str  # "vllm": vLLM's EplbState drives it; "deepinfer": the plugin's runner

    def summary(self) -> str:
        return (
            f"window_size={self.window_size}, step_interval={self.step_interval}, "
            f"num_redundant_experts={self.num_redundant_experts} ({self.driver})"
        )


def eplb_settings(vllm_config) -> EplbSettings | None:
    """EPLB's settings, or None when it is off: vLLM's ``enable_eplb``/``eplb_config`` where vLLM
    accepted them, else ``additional_config``'s ``enable_eplb``/``eplb_config`` (same field names).
    A bad field is a ``ValueError`` naming it."""
    par = vllm_config.parallel_config
    if getattr(par, "enable_eplb", False):
        cfg = par.eplb_config
        return EplbSettings(
            int(cfg.window_size),
            int(cfg.step_interval),
            int(cfg.num_redundant_experts),
            bool(cfg.log_balancedness),
            "vllm",
        )
    extra = getattr(vllm_config, "additional_config", None) or {}
    return _plugin_settings(extra)


def _plugin_settings(extra: dict[str, Any]) -> EplbSettings | None:
    enabled = extra.get("enable_eplb", False)
    fields = extra.get("eplb_config", {})
    where = "additional_config"
    if not isinstance(enabled, bool):
        raise TypeError(f"{where}['enable_eplb'] must be true or false, got {enabled!r}")
    if not isinstance(fields, dict):
        raise TypeError(f"{where}['eplb_config'] must be an object of EPLB fields, got {fields!r}")
    if not enabled:
        if fields:
            raise ValueError(
                f"{where}['eplb_config'] is set but {where}['enable_eplb'] is not true; "
                "set enable_eplb to turn expert load balancing on"
            )
        return None
    unknown = sorted(set(fields) - set(PLUGIN_FIELDS))
    if unknown:
        raise ValueError(
            f"{where}['eplb_config'] has fields DeepInfer's balancer does not read: {unknown}; "
            f"it reads {list(PLUGIN_FIELDS)} (vLLM's names)"
        )

    def positive(name: str, default: int, minimum: int) -> int:
        value = fields.get(name, default)
        if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
            raise ValueError(f"{where}['eplb_config']['{name}'] must be an int >= {minimum}, got {value!r}")
        return value

    policy = fields.get("policy", "default")
    if policy != "default":
        raise ValueError(
            f"{where}['eplb_config']['policy']={policy!r}: DeepInfer's balancer has one policy, "
            "'default' (DeepSeek's EPLB)"
        )
    log = fields.get("log_balancedness", False)
    if not isinstance(log, bool):
        raise TypeError(f"{where}['eplb_config']['log_balancedness'] must be true or false, got {log!r}")
    return EplbSettings(
        positive("window_size", 1000, 1),
        positive("step_interval", 3000, 1),
        positive("num_redundant_experts", 0, 0),
        log,
        "deepinfer",
    )


def check_eplb(settings: EplbSettings, n_routed_experts: int, parallel_config) -> None:
    """Refuse EPLB settings the model cannot be split by, naming the setting."""
    ranks = parallel_config.tensor_parallel_size * parallel_config.data_parallel_size
    if not parallel_config.enable_expert_parallel or ranks < 2:
        raise ValueError(
            "expert load balancing (enable_eplb) needs enable_expert_parallel over at least two ranks "
            f"(data_parallel_size x tensor_parallel_size = {ranks})"
        )
    physical = n_routed_experts + settings.num_redundant_experts
    if physical % ranks:
        raise ValueError(
            f"eplb_config num_redundant_experts={settings.num_redundant_experts}: n_routed_experts="
            f"{n_routed_experts} + redundant = {physical} physical experts do not split equally over "
            f"{ranks} expert-parallel ranks"
        )


def expert_balancer(model, vllm_config) -> ExpertBalancer | None:
    """The plugin's balancer for a loaded model, where the plugin drives EPLB (None elsewhere)."""
    settings = getattr(model, "eplb", None)
    if settings is None or settings.driver != "deepinfer" or not getattr(model, "num_moe_layers", 0):
        return None
    from vllm.distributed import get_ep_group

    balancer = ExpertBalancer(model, settings, get_ep_group())
    logger.info("DeepInfer EPLB on: %s", settings.summary())
    return balancer


def _process_group(group, device: torch.device):
    return group.cpu_group if device.type == "cpu" else group.device_group


def move_expert_weights(
    weights: list[torch.Tensor], moves: list[ExpertMove], rank: int, per_rank: int, group
) -> int:
    """Carry out one layer's ``moves`` on this rank's slot tensors ``weights`` (each ``[per_rank,
    ...]``, slot ``rank * per_rank + j`` in row ``j``) with point-to-point sends over the vLLM group
    coordinator ``group`` (its gloo group for CPU tensors). Sources are copied aside first, so a slot
    may both send its old expert and receive a new one. Every rank calls this with the same ``moves``.
    Returns the number of slots this rank wrote."""
    lo = rank * per_rank

    def mine(slot: int) -> bool:
        return slot // per_rank == rank

    sources = sorted({m.src for m in moves if mine(m.src)})
    saved = {s: [w[s - lo].clone() for w in weights] for s in sources}
    ops = []
    if any(mine(m.src) != mine(m.dst) for m in moves):
        pg = _process_group(group, weights[0].device)
        for i, m in enumerate(moves):
            src_rank, dst_rank = m.src // per_rank, m.dst // per_rank
            if src_rank == dst_rank or rank not in (src_rank, dst_rank):
                continue
            for t, w in enumerate(weights):
                tag = i * len(weights) + t
                if src_rank == rank:
                    tensor = saved[m.src][t].view(torch.uint8)
                    ops.append(dist.P2POp(dist.isend, tensor, dist.get_global_rank(pg, dst_rank), pg, tag))
                else:
                    tensor = w[m.dst - lo].view(torch.uint8)
                    ops.append(dist.P2POp(dist.irecv, tensor, dist.get_global_rank(pg, src_rank), pg, tag))
    if ops:
        for req in dist.batch_isend_irecv(ops):
            req.wait()
    written = 0
    for m in moves:
        if mine(m.dst):
            written += 1
            if mine(m.src):
                for w, old in zip(weights, saved[m.src]):
                    w[m.dst - lo].copy_(old)
    return written


class ExpertBalancer:
    """The plugin's EPLB driver for one model (``MixtureOfExperts``): owns the load window and the
    maps the model's MoE layers read, and rebalances every ``step_interval`` steps (module docstring).
    ``group`` is vLLM's expert-parallel group coordinator (``get_ep_group()``)."""

    def __init__(self, model, settings: EplbSettings, group):
        self.model = model
        self.settings = settings
        self.group = group
        layers = model.moe_layers
        self.num_layers = len(layers)
        self.logical = model.num_logical_experts
        self.physical = model.num_physical_experts
        self.ranks = group.world_size
        self.rank = group.rank_in_group
        self.per_rank = self.physical // self.ranks
        device = layers[0].w13.device
        self.device = device
        width = settings.num_redundant_experts + 1
        self.placement: ExpertPlacement = initial_placement(self.num_layers, self.logical, self.physical)
        self.load_pass = torch.zeros(self.num_layers, self.physical, dtype=torch.int64, device=device)
        self.window = torch.zeros(
            settings.window_size, self.num_layers, self.physical, dtype=torch.int64, device=device
        )
        self.logical_to_physical_map = torch.full(
            (self.num_layers, self.logical, width), -1, dtype=torch.int64, device=device
        )
        self.logical_replica_count = torch.zeros(
            self.num_layers, self.logical, dtype=torch.int64, device=device
        )
        self._commit(self.placement)
        model.set_eplb_state(self.load_pass, self.logical_to_physical_map, self.logical_replica_count)
        self.steps = 0
        self.pending = False
        # The model calls it at the start of every forward (``DeepseekV41ForCausalLM.forward``).
        model.eplb_before_forward = self.run_pending
        self.window_steps = 0
        self.rebalances = 0
        self.moved_rebalances = 0
        # Per-step max/mean tokens per rank since the last rebalance (``log_balancedness``).
        self._balancedness: list[float] = []

    # ------------------------------------------------------------------ steps
    def step(self, is_dummy: bool = False, is_profile: bool = False) -> None:
        """After a forward: record its loads (a dummy batch's are dropped, as vLLM's ``EplbState`` does),
        and mark a rebalance due at the period. Profile runs are not steps."""
        if is_profile:
            self.load_pass.zero_()
            return
        if not is_dummy:
            if self.settings.log_balancedness:
                self._balancedness.append(self._step_imbalance())
            self.window[self.window_steps % self.settings.window_size].copy_(self.load_pass)
            self.window_steps += 1
        self.load_pass.zero_()
        self.steps += 1
        if self.steps % self.settings.step_interval == 0:
            self.pending = True

    def run_pending(self) -> None:
        """Rebalance if a period ended since the last forward (every rank calls it at the start of the
        same forward)."""
        if self.pending:
            self.pending = False
            self.rebalance()

    def _step_imbalance(self) -> float:
        """This step's max/mean tokens per rank (summed over layers; one small all-reduce)."""
        counts = all_reduce(self.group, self.load_pass.clone())
        per_rank = counts.view(self.num_layers, self.ranks, self.per_rank).sum((0, 2))
        return float(imbalance(per_rank)) if int(per_rank.sum()) else float("nan")

    # -------------------------------------------------------------- rebalance
    def window_loads(self) -> torch.Tensor:
        """Tokens per logical expert over the window, summed over the expert group ``[layers, logical]``
        (host tensor)."""
        per_slot = self.window.sum(0)
        phy_to_log = self.placement.phy_to_log.to(self.device)
        logical = torch.zeros(self.num_layers, self.logical, dtype=torch.int64, device=self.device)
        logical.scatter_add_(1, phy_to_log, per_slot)
        return all_reduce(self.group, logical).cpu()

    def rebalance(self) -> int:
        """Compute the new placement from the window, move the weights that change slot, swap the maps.
        Every rank of the group calls it at the same step. Returns the number of slots that changed."""
        t0 = time.perf_counter()
        self.rebalances += 1
        loads = self.window_loads()
        self.window.zero_()
        self.window_steps = 0
        measured = [x for x in self._balancedness if not math.isnan(x)]
        self._balancedness = []
        if int(loads.sum()) == 0:
            if self.rank == 0:
                logger.info(
                    "DeepInfer EPLB rebalance %d at step %d: no tokens in the window, placement kept",
                    self.rebalances,
                    self.steps,
                )
            return 0
        # V4.1 routes without expert groups (n_group = 1): the global placement, as vLLM's policy
        # falls back to when the groups do not divide over the nodes.
        new = balance_experts(loads, self.physical, self.ranks)
        old = self.placement
        changed = 0
        for layer, weights in enumerate(self._layer_weights()):
            moves = plan_moves(old.phy_to_log[layer], new.phy_to_log[layer], self.ranks)
            changed += len(moves)
            move_expert_weights(weights, moves, self.rank, self.per_rank, self.group)
        if changed:
            self.moved_rebalances += 1
            self.placement = new
            self._commit(new)
        self._log("map changed" if changed else "map unchanged", changed, loads, old, t0, measured, new)
        return changed

    def _layer_weights(self) -> list[list[torch.Tensor]]:
        return [layer.get_expert_weights() for layer in self.model.moe_layers]

    def _commit(self, placement: ExpertPlacement) -> None:
        """Copy a placement's maps into the device tensors the layers read (same storage: the layers
        and any captured graph see the new maps)."""
        l2p = placement.log_to_phys
        width = self.logical_to_physical_map.shape[-1]
        padded = torch.full((self.num_layers, self.logical, width), -1, dtype=torch.int64)
        padded[..., : l2p.shape[-1]] = l2p
        self.logical_to_physical_map.copy_(padded)
        self.logical_replica_count.copy_(placement.replica_count)
        for layer, row in zip(self.model.moe_layers, placement.phy_to_log):
            layer.physical_to_logical.copy_(row)

    def _log(self, what, changed, loads, old, t0, measured, new) -> None:
        if self.rank != 0:
            return
        before = float(imbalance(rank_loads(old.phy_to_log, loads.double(), self.ranks)).nanmean())
        after = float(imbalance(rank_loads(new.phy_to_log, loads.double(), self.ranks)).nanmean())
        step_note = ""
        if measured:
            mean = sum(measured) / len(measured)
            step_note = f"; measured per step since the last rebalance: max/mean {mean:.3f}"
        logger.info(
            "DeepInfer EPLB rebalance %d at step %d: %s, %d of %d slots moved over %d layers; window "
            "max/mean tokens per rank %.3f under the old placement, %.3f under the new (%.3f s)%s",
            self.rebalances,
            self.steps,
            what,
            changed,
            self.physical * self.num_layers,
            self.num_layers,
            before,
            after,
            time.perf_counter() - t0,
            step_note,
        )
