"""Drive the vLLM model class in-process, with caches paged the way vLLM pages them.

No engine, no scheduler: the harness builds the model under a real
``VllmConfig``, allocates every cache layer's ``[blocks, 1, states, bytes]``
tensor from its own KV cache spec, hands out blocks per request and group,
and builds the per-layer step metadata through the backend's own builder
from the common metadata vLLM's runner would hand it (device tensors, host
ints). Tests use it to compare the paged
model against the full-sequence reference at any chunking, cheaply.
"""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from safetensors import safe_open

from vllm.config import set_current_vllm_config
from vllm.engine.arg_utils import EngineArgs
from vllm.forward_context import set_forward_context
from vllm.utils.torch_utils import set_default_torch_dtype
from vllm.v1.attention.backend import CommonAttentionMetadata

from deepinfer_vllm.attention_backends.mla_swa import V41MetadataBuilder
from deepinfer_vllm.model_executor.models.deepseek_v41 import DeepseekV41ForCausalLM


def single_rank_groups() -> None:
    """vLLM's process groups for one rank (gloo), as a worker sets them up; once per process."""
    from vllm.distributed import parallel_state as ps

    if ps.model_parallel_is_initialized():
        return
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ps.init_distributed_environment(
        world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}", local_rank=0, backend="gloo"
    )
    ps.initialize_model_parallel(1, 1)


@dataclass
class _Request:
    tokens: list[int] = field(default_factory=list)
    blocks: dict[str, list[int]] = field(default_factory=dict)
    prompt_len: int | None = None  # what the runner passes as its prompt length (None: the length after each step)
    replay_start: int = 0  # SWA bounded replay: first position it holds window KV from


class PagedHarness:
    def __init__(
        self,
        model_dir: str,
        dtype: str = "float32",
        block_size: int = 16,
        num_blocks: int = 256,
        speculative_config: dict | None = None,
        device: str = "cpu",
        max_model_len: int = 1024,
        load_weights: bool = True,
        ring_blocks: int | None = None,
        init_groups: Callable | None = None,
        **engine_args,
    ):
        """``load_weights=False`` leaves the parameters uninitialised (benchmarks fill them);
        ``ring_blocks``: blocks of the compressor-ring caches (one per request; default
        ``num_blocks``); ``engine_args`` go to vLLM's ``EngineArgs`` (e.g. ``max_num_seqs``).
        vLLM's ``swa_bounded_replay`` is off unless asked for (``swa_bounded_replay=True``):
        every layer then runs every prompt row, the reference's default.
        ``init_groups(cfg)``: sets up vLLM's process groups under the harness's config (made
        current) before the model is built, in place of ``single_rank_groups()``; a multi-rank
        caller passes its parallel engine args (``data_parallel_size``,
        ``enable_expert_parallel``) here too (``multi_rank_harness.py``)."""
        import deepinfer_vllm

        deepinfer_vllm.register()
        engine_args.setdefault("swa_bounded_replay", False)
        args = EngineArgs(
            model=model_dir,
            dtype=dtype,
            max_model_len=max_model_len,
            block_size=block_size,
            speculative_config=speculative_config,
            **engine_args,
        )
        self.cfg = args.create_engine_config()
        self.device = torch.device(device)
        # As vLLM's loader does: the model dtype (and device) are torch's defaults while building.
        with (
            set_current_vllm_config(self.cfg),
            set_default_torch_dtype(self.cfg.model_config.dtype),
            self.device,
        ):
            if init_groups is None:
                single_rank_groups()
            else:
                init_groups(self.cfg)
            self.model = DeepseekV41ForCausalLM(vllm_config=self.cfg)
            if load_weights:
                self.model.load_weights(self._weights(model_dir))
        self.block_size = self.cfg.cache_config.block_size
        self.num_blocks = num_blocks
        self.ring_blocks = ring_blocks or num_blocks
        for layer in self.model.cache_layers.values():
            spec = layer.get_kv_cache_spec(self.cfg)
            cache = torch.zeros(
                self.ring_blocks if layer.kind == "ring" else num_blocks,
                1,
                spec.num_states,
                spec.state_content_size_bytes,
                dtype=torch.uint8,
                device=self.device,
            )
            if spec.dtype != torch.uint8:
                cache = cache.view(spec.dtype)
            layer.bind_kv_cache(cache)
        # One block counter per cache (block 0 is vLLM's null block).
        self.reset()
        self._builders: dict[str, V41MetadataBuilder] = {}

    def reset(self) -> None:
        """Forget every request and hand out blocks from the start again (caches keep their bytes)."""
        self._next_block = defaultdict(lambda: itertools.count(1))
        self.requests: dict[str, _Request] = {}

    def prefix_hit(self, rid: str, source: str, hit: int, prompt_len: int | None = None) -> list[int]:
        """Admit ``rid`` as vLLM's scheduler does after a prefix-cache hit of ``hit`` tokens on
        ``source``'s blocks under SWA bounded replay: the prefix-cacheable caches take
        ``source``'s blocks covering the hit (a block the hit ends inside is copied, as
        copy-on-write would), the others (window KV, compressor ring) start empty, and the
        request holds its first ``hit - W`` tokens with window KV from ``hit - W`` on.
        Returns the tokens to replay (the hit's last ``W``)."""
        src = self.requests[source]
        start = hit - self.model.arch.sliding_window
        req = _Request(tokens=src.tokens[:start], prompt_len=prompt_len, replay_start=start)
        whole, partial = divmod(hit, self.block_size)
        for name, layer in self.model.cache_layers.items():
            if not layer.get_kv_cache_spec(self.cfg).prefix_cacheable:
                continue
            blocks = src.blocks[name][:whole]
            if partial:
                copy = next(self._next_block[name])
                layer.kv_cache[copy] = layer.kv_cache[src.blocks[name][whole]]
                blocks = blocks + [copy]
            req.blocks[name] = blocks
        self.requests[rid] = req
        return src.tokens[start:hit]

    def add_context(self, rid: str, length: int, token: int = 3) -> None:
        """A request whose first ``length`` tokens count as cached (whatever the cache holds)."""
        self.requests[rid] = _Request(tokens=[token] * length)

    @staticmethod
    def _weights(model_dir: str):
        with safe_open(f"{model_dir}/model.safetensors", framework="pt") as f:
            for name in f.keys():
                yield name, f.get_tensor(name)

    def _blocks_for(self, req: _Request, name: str, length: int, ring: bool) -> list[int]:
        blocks = req.blocks.setdefault(name, [])
        needed = 1 if ring else -(-length // self.block_size)
        while len(blocks) < needed:
            blocks.append(next(self._next_block[name]))
            assert blocks[-1] < (self.ring_blocks if ring else self.num_blocks), "harness ran out of blocks"
        return blocks

    def step(self, chunks: list[tuple[str, list[int]]], prompt_lens: list[int] | None = None) -> torch.Tensor:
        """Run one step; ``chunks`` = [(request id, new token ids)]. Returns logits [T, V].

        ``prompt_lens`` (per chunk) is what DeepInfer's runner passes; default: the request's
        ``prompt_len`` where set, else its length after this step."""
        return self.run(self.prepare(chunks, prompt_lens))

    def run(self, prepared: tuple) -> torch.Tensor:
        """The device part of a step (the model's forward and logits) on prepared inputs."""
        ids, positions, metadata = prepared
        # With data parallelism vLLM's forward context agrees on the ranks' token counts (a
        # collective over the DP group), as its runner does before every forward.
        dp = self.cfg.parallel_config.data_parallel_size > 1
        with set_forward_context(metadata, self.cfg, num_tokens=ids.shape[0] if dp else None):
            hidden = self.model(ids, positions)
        return self.model.compute_logits(hidden)

    def prepare(
        self,
        chunks: list[tuple[str, list[int]]],
        prompt_lens: list[int] | None = None,
        table_width: int | None = None,
    ) -> tuple:
        """The host part of a step, as vLLM's runner does it before the forward: block
        tables, inputs and metadata on the device. Returns ``(ids, positions, metadata)``.
        ``table_width``: block-table columns (default: the widest request's blocks)."""
        ids, positions, qsl, seq_lens, ctx_lens, own_prompt_lens, replay = [], [], [0], [], [], [], []
        window = self.model.arch.sliding_window
        for rid, new in chunks:
            req = self.requests.setdefault(rid, _Request())
            start = len(req.tokens)
            # As DeepInfer's runner: a replay start only while the request is inside its replay.
            replay.append(req.replay_start if start < req.replay_start + window else 0)
            req.tokens.extend(new)
            ids.extend(new)
            positions.extend(range(start, start + len(new)))
            qsl.append(qsl[-1] + len(new))
            seq_lens.append(len(req.tokens))
            ctx_lens.append(start)
            own_prompt_lens.append(req.prompt_len if req.prompt_len is not None else len(req.tokens))
        dev = self.device
        positions_t = torch.tensor(positions, dtype=torch.int64, device=dev)
        qsl_cpu = torch.tensor(qsl, dtype=torch.int32)
        seq_lens_cpu = torch.tensor(seq_lens, dtype=torch.int32)
        prompt_lens_t = torch.tensor(prompt_lens if prompt_lens is not None else own_prompt_lens, device=dev)
        replay_t = torch.tensor(replay, dtype=torch.int64, device=dev) if any(replay) else None
        metadata = {}
        for name, layer in self.model.cache_layers.items():
            ring = layer.kind == "ring"
            tables = [
                self._blocks_for(self.requests[rid], name, len(self.requests[rid].tokens), ring)
                for rid, _ in chunks
            ]
            width = table_width or max(len(t) for t in tables)
            table = torch.zeros(len(chunks), width, dtype=torch.int32)
            for i, t in enumerate(tables):
                table[i, : len(t)] = torch.tensor(t)
            common = CommonAttentionMetadata(
                query_start_loc=qsl_cpu.to(dev),
                query_start_loc_cpu=qsl_cpu,
                seq_lens=seq_lens_cpu.to(dev),
                num_reqs=len(chunks),
                num_actual_tokens=len(ids),
                max_query_len=max(len(c[1]) for c in chunks),
                max_seq_len=max(seq_lens),
                block_table_tensor=table.to(dev),
                slot_mapping=torch.zeros(len(ids), dtype=torch.int64, device=dev),
                positions=positions_t,
            )
            builder = self._builders.get(name)
            if builder is None:  # one per cache, kept across steps as vLLM keeps its builders
                builder = V41MetadataBuilder(layer.get_kv_cache_spec(self.cfg), [name], self.cfg, dev)
                self._builders[name] = builder
            metadata[name] = builder.build(0, common)
            metadata[name].prompt_lens = prompt_lens_t
            metadata[name].replay_start = replay_t
        self.last_metadata = metadata
        self.last_request_ids = [rid for rid, _ in chunks]
        return torch.tensor(ids, device=dev), positions_t, metadata

    def draft_block(self, rids: list[str], bonus: list[int], k: int):
        """DSpark's parallel draft forward for requests of the last step (anchored at
        each request's last token): ``hh [R*k, D]`` and base logits ``[R*k, V]``."""
        from deepinfer_vllm.model_executor.layers.step_state import StepState

        state = StepState.from_metadata(self.last_metadata, next(iter(self.last_metadata)))
        rows = torch.tensor([self.last_request_ids.index(r) for r in rids])
        anchor = torch.tensor([len(self.requests[r].tokens) - 1 for r in rids])
        with torch.no_grad():
            return self.model.draft_block(torch.tensor(bonus), anchor, rows, k, state)
