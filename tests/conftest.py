"""Shared fixtures: checkpoints the project generates itself, in the released format."""

from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os

import pytest
import torch

# vLLM's CPU build needs a KV cache budget; tests keep it small.
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

ACCEPTANCE_PROMPT_LENS = (17, 64, 200)


@pytest.fixture(scope="module")
def single_thread():
    """Small tensors: one intra-op thread is as fast, and immune to a busy host."""
    previous = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(previous)


def _shared_root(tmp_path_factory):
    """A folder every process of this test run sees: pytest-xdist's workers share the folder
    above their own temporary folders."""
    root = tmp_path_factory.getbasetemp()
    return root.parent if os.environ.get("PYTEST_XDIST_WORKER") else root


def _shared_checkpoint(tmp_path_factory, preset: str, **kwargs) -> str:
    """``preset`` at seed 0, made once per test run: the first worker to ask makes it under a lock."""
    from filelock import FileLock

    from deepinfer_vllm.tools.make_checkpoint import make_checkpoint

    root = _shared_root(tmp_path_factory)
    out = root / f"checkpoint-{preset}"
    done = root / f"checkpoint-{preset}.done"
    with FileLock(str(out) + ".lock"):
        if not done.exists():
            make_checkpoint(out, preset=preset, seed=0, **kwargs)
            done.touch()
    return str(out)


@pytest.fixture(scope="session")
def tiny_checkpoint(tmp_path_factory) -> str:
    return _shared_checkpoint(tmp_path_factory, "tiny")


@pytest.fixture(scope="session")
def tiny_dspark_checkpoint(tmp_path_factory) -> str:
    """``tiny`` (the same target weights) with a 5-token DSpark block and a trained draft. Trained for 60
    steps instead of the recipe's 100 (about 45 s of one core less in `make test`, which is at its time
    limit): the tests need drafts accepted on the fitted prompts (about 3.5 of 5 on the training batches at
    step 60), not the documented recipe's exact bytes (``benchmarks/dspark.py`` uses those)."""
    return _shared_checkpoint(tmp_path_factory, "tiny-dspark", draft_steps=60)


@pytest.fixture(scope="session")
def tiny_reference(tiny_checkpoint):
    from deepinfer_vllm.reference.model import ReferenceV41

    return ReferenceV41.from_pretrained(tiny_checkpoint, dtype=torch.float32, num_threads=1)


class SharedGreedy:
    """``tiny``'s reference greedy continuations (fp32), each computed once per test run:
    the first process to ask computes it under a lock of its own and leaves it in the shared
    folder; the others read it (several workers' tests need the same continuations).

    They are computed the way an engine computes them by default: vLLM's ``swa_bounded_replay``
    on, hence DeepInfer's compact prefill truncation (``KEEP = W + 12``) and a replay after every
    prefix hit (``admissions``: ``(hit, length)`` of each (re)admission, see
    ``ReferenceV41.greedy_generate``; ``replay_admissions`` reads them from an engine).
    ``full_prefill``: every layer on every prompt row, as for requests asking prompt logprobs
    (which never hit the prefix cache)."""

    def __init__(self, reference, folder) -> None:
        from deepinfer_vllm import envs

        self.reference = reference
        self.folder = folder
        folder.mkdir(exist_ok=True)
        self.mode, self.keep = envs.prefill_truncation_settings(reference.arch.sliding_window, "compact")

    def __call__(self, prompt, max_new_tokens: int, full_prefill: bool = False, admissions=()) -> list[int]:
        from filelock import FileLock

        prompt = [int(t) for t in prompt]
        mode, keep = ("off", 0) if full_prefill else (self.mode, self.keep)
        admissions = [[int(hit), int(at)] for hit, at in admissions]
        key = hashlib.sha1(json.dumps([prompt, max_new_tokens, mode, keep, admissions]).encode()).hexdigest()
        path = self.folder / f"{key}.json"
        with FileLock(str(path) + ".lock"):
            if not path.exists():
                tokens = self.reference.greedy_generate(
                    prompt, max_new_tokens, truncation_mode=mode, keep_tokens=keep, admissions=admissions
                )
                path.write_text(json.dumps(tokens))
            return json.loads(path.read_text())


def _replay_admissions(log, window: int) -> dict[str, list[tuple[int, int]]]:
    out: dict[str, list[tuple[int, int]]] = {}
    for rid, start, tokens in log:
        out.setdefault(rid.rsplit("-", 1)[0], []).append((start + window if start else 0, tokens))
    return out


@pytest.fixture(scope="session")
def replay_admissions(tiny_reference):
    """``replay_admissions(log)`` -> ``{request id: [(hit, length), ...]}`` from a worker's
    ``deepinfer_replay_log`` (``collective_rpc("deepinfer_replay_log")[0]``; the engine's request
    ids carry a suffix after the caller's: "3-1a2b3c4d"): a replay start ``s`` is a hit of
    ``s + W`` tokens, 0 an admission that recomputed everything. For ``tiny_greedy``."""
    window = tiny_reference.arch.sliding_window
    return lambda log: _replay_admissions(log, window)


@pytest.fixture(scope="session")
def tiny_greedy(tiny_reference, tmp_path_factory) -> SharedGreedy:
    """``tiny_greedy(prompt, n)``: the reference's greedy ``n``-token continuation of ``prompt``."""
    return SharedGreedy(tiny_reference, _shared_root(tmp_path_factory) / "greedy-tiny-fp32")


@pytest.fixture(scope="session")
def acceptance_prompts() -> list[list[int]]:
    """Token-id prompts of 17, 64 and 200 tokens (longer than the window and many groups)."""
    g = torch.Generator().manual_seed(0)
    return [torch.randint(3, 120000, (n,), generator=g).tolist() for n in ACCEPTANCE_PROMPT_LENS]


@pytest.fixture(scope="session")
def reference_greedy(tiny_greedy, acceptance_prompts) -> list[list[int]]:
    """The reference's greedy 16-token continuations of the acceptance prompts, as an engine
    computes them without prefix hits (compact prefill truncation, the default)."""
    return [tiny_greedy(p, 16) for p in acceptance_prompts]


@pytest.fixture(scope="session")
def reference_greedy_full_prefill(tiny_greedy, acceptance_prompts) -> list[list[int]]:
    """The same with every prompt row computed: what requests asking prompt logprobs get."""
    return [tiny_greedy(p, 16, full_prefill=True) for p in acceptance_prompts]


# ---------------------------------------------------------------- running side by side
# `make test` runs two pytest-xdist workers (`-n 2 --dist loadgroup`): a group of tests runs whole
# in one worker, so a module-scoped engine or server starts once. A test file is one group unless
# its tests name finer ones (one per engine, e.g. tests/e2e/test_parallel.py); shared servers name
# theirs (tests/e2e/conftest.py). Each worker's engines bind their OpenMP threads to a core of
# their own; two-worker engines (TP=2, DP=2) set "0|1" themselves.
_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if _WORKER and "VLLM_CPU_OMP_THREADS_BIND" not in os.environ:
    _cores = sorted(os.sched_getaffinity(0))
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = str(_cores[int(_WORKER.removeprefix("gw")) % len(_cores)])

# The longest groups start first (`make test` keeps this order: --no-loadscope-reorder), so
# that neither worker is left with a long one at the end: the first DSpark engine (it builds the
# tiny-dspark checkpoint, whose draft training takes about 2 minutes of one core), the installed
# wheel (a fresh environment), the README's server, then the engines that do not need tiny-dspark,
# so that the other worker has work of its own while the draft trains (a DSpark engine the second
# worker started early waited on the checkpoint: 254 s of setup in CI against 16 s alone), then
# every other engine.
FIRST = (
    "dspark-k1",
    "tests/e2e/test_installed_wheel.py",
    "readme_server",
    "test_simulated_npu_engine_matches_reference",
    "test_simulated_npu_catches_a_missing_host_to_device_copy",
    "npu_server",
    "dspark-",
    "test_simulated_npu",
    "tests/e2e/",
)


def _group(item) -> str:
    mark = item.get_closest_marker("xdist_group")
    return mark.args[0] if mark.args else mark.kwargs["name"]


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist reads the groups
def pytest_collection_modifyitems(config, items):
    for item in items:
        if item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(item.nodeid.split("::")[0]))

    def rank(item) -> int:
        group = _group(item)
        return next((i for i, prefix in enumerate(FIRST) if group.startswith(prefix)), len(FIRST))

    items.sort(key=rank)  # stable: the order within a rank is pytest's


def pytest_collection_finish(session):
    """Under `--dist loadgroup`, every test must carry its group in its node id (pytest-xdist tags
    it there); untagged, the groups are ignored and module engines and shared servers start in
    every worker (pytest 9 with pytest-xdist 3.8 did that)."""
    if os.environ.get("PYTEST_XDIST_WORKER") and session.config.getvalue("loadgroup"):
        untagged = [item.nodeid for item in session.items if "@" not in item.nodeid]
        if untagged:
            raise pytest.UsageError(f"pytest-xdist did not tag {len(untagged)} tests with their group, e.g. {untagged[0]}")


@pytest.fixture
def log_lines():
    """``with log_lines(name) as lines:`` collects the messages of logger ``name`` (and its
    children) at INFO and above through a handler of its own: pytest's caplog stops receiving
    them in a process that has already built a vLLM model in-process."""

    @contextlib.contextmanager
    def capture(name: str):
        lines: list[str] = []
        handler = logging.Handler(logging.INFO)
        handler.emit = lambda record: lines.append(record.getMessage())
        target = logging.getLogger(name)
        level = target.level
        target.addHandler(handler)
        target.setLevel(logging.INFO)
        try:
            yield lines
        finally:
            target.removeHandler(handler)
            target.setLevel(level)

    return capture
