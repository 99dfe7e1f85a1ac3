"""Reference timing of vLLM ``speculators`` 0.9.0's P-EAGLE training step (issue #7).

``run_reference`` builds speculators' own P-EAGLE drafter (``PEagleDraftModel``) with
the shape of one of ``benchmarks/train_step.py``'s ``SHAPES`` and times its full
training step on random inputs of real shapes, so each row of our benchmark can
carry a ratio to the reference library measured in the same run. Nothing of
speculators is copied here: the module imports the installed package and drives its
model exactly as its trainer does.

What one timed step is (speculators 0.9.0, ``speculators/train/trainer.py``,
``Trainer.train_epoch``)::

    with torch.autocast(device, dtype=bfloat16):           # hidden_states_dtype
        _, loss, metrics = model(**batch, **train_call_kwargs)
    # inside model.forward (speculators/models/peagle/core.py, torch.compile'd on CUDA):
    #   COD sampling          speculators/models/peagle/data.py  generate_cod_sample_indices
    #   flex block mask       speculators/models/peagle/attention.py + create_block_mask
    #   embed / fc / layers / norm / lm_head (frozen), verifier targets (frozen head)
    #   fused KL loss         speculators/losses/fused.py (Triton fwd + bwd kernels)
    optimizer.zero_grad(); loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
    optimizer.step(); scheduler.step()                      # linear warm-up schedule

Precision (as speculators trains on one GPU, ``train/config/schema.py``
``hidden_states_dtype``: "Model master weights are always kept in fp32"): fp32
parameters, master weights and optimizer state; bf16 autocast around the forward;
bf16 input hidden states. Optimizer: ``torch.optim.AdamW(lr=1e-3, weight_decay=0.01)``
(speculators' AdamW settings) with ``fused=True`` on CUDA by default, to match our
benchmark; ``optimizer="adamw"`` gives speculators' exact call (torch's default
foreach implementation) and ``optimizer="muon"`` its CLI default (Muon for 2D
matrices + AdamW for the rest, ``speculators/train/optimizers.py``).

Model settings (chosen to match ``train_step.py``'s drafter, stated in the result):
Llama decoder layers (``draft_arch="llama"``; speculators' CLI default for P-EAGLE
is qwen3, which adds per-head q/k norms), full attention on every layer
(``layer_types`` all ``full_attention``; speculators' CLI default is a 2048-token
sliding window), ``norm_before_fc`` / ``fc_norm`` / ``norm_output`` off (CLI defaults
for P-EAGLE), 3 auxiliary layers, target hidden size = hidden size, trainable
embeddings (``embed_requires_grad=True``, the P-EAGLE default), frozen
``lm_head`` / ``verifier_lm_head`` / ``verifier_norm``, no anchor cap
(``max_anchors=None``; the CLI default is 512), batch 1, one document, all
positions in the loss. ``lm_head``, ``verifier_lm_head`` and ``embed_tokens`` are
NaN until verifier weights are loaded, so they are filled with N(0, 0.02) here.

Inputs (random, real shapes; what ``speculators/models/eagle3/data.py`` ``shift_batch``
hands the model): ``hidden_states [1, N, 3*hidden]`` bf16 (the concatenated auxiliary
hidden states), ``verifier_last_hidden_states [1, N, hidden]`` bf16 (the verifier's
final hidden state: speculators builds the target distribution itself with the frozen
``verifier_norm`` + ``verifier_lm_head`` over the draft vocabulary), ``input_ids [1, N]``
int64, ``document_ids [1, N]`` int64 (zeros), ``loss_mask [1, N]`` bool (ones),
``position_ids [1, N]`` int64.

Fix applied at run time (torch 2.11): speculators decorates both fused-loss kernels
with ONE ``triton.autotune`` object, so ``loss_forward_kernel.configs`` and
``loss_backward_kernel.configs`` are the same list; Dynamo then fails the compiled
forward at the first step ("ListVariable ... already tracked for mutation").
``patch_fused_loss_autotune`` gives each kernel its own copy of the same configs
(no change to the math or to the autotune search space).

Import-only dependency shim: ``speculators/train/data.py`` (pulled in by
``speculators.models.eagle3``, which P-EAGLE subclasses) does
``from datasets import load_from_disk`` at module level, and
``speculators/train/vocab_mapping.py`` / ``data_generation`` import more of
``datasets``; none of it is used by the model or the timed step. ``datasets``
drags in pyarrow (~40 MB), so when (and only when) the real package is missing a
stub ``datasets`` module is put in ``sys.modules`` before speculators is imported;
calling anything on it raises ``ImportError``. Every other dependency is a real wheel.

GPU machine setup (no internet, no pydantic): the wheels that the import needs and
the device lacks live in ``.whl_spec/`` at the repository root (git-ignored through
``.git/info/exclude``)::

    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl_spec/*.whl
    PYTHONPATH=/tmp/site python3 benchmarks/speculators_ref.py --shape gpt-oss-20b --N 2048 8192

On CPU (smoke path only) speculators does not compile its forward, FlexAttention has no
backward, and Triton is absent, so the CPU run uses speculators' own fallbacks: eager
attention with a dense float mask (``speculators/models/attention.py`` ``create_float_mask``)
and the eager KL loss (``speculators/losses/eager.py``).

Checked on one H200 (torch 2.11, transformers 5.17), GPT-OSS-20B shape, Vd 32,000, K 8,
r 0.7 / 0.2, 10 steps after 3: N=2048 103 ms (6,897 grid positions, 20.2 GB peak),
8192 420 ms (31.5 GB), 16384 1,048 ms (46.5 GB), 32768 2,994 ms (76.6 GB), 65536 OOM;
the issue's figures were 109 / 439 ms.

Usage::

    python benchmarks/speculators_ref.py --shape gpt-oss-20b --N 2048 8192 16384 --out ref.json
    python benchmarks/speculators_ref.py --shape tiny --N 64 --steps 2 --warmup 1   # CPU smoke run
"""
from __future__ import annotations

import argparse
import ast
import copy
import gc
import importlib
import importlib.machinery
import importlib.util
import json
import statistics
import sys
import time
import types
from pathlib import Path

import torch

REPO_ROOT = Path(__file__).resolve().parents[1]
WHEELS_DIR = REPO_ROOT / ".whl_spec"
SPECULATORS_VERSION = "0.9.0"
INSTALL_HINT = (
    f"python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site {WHEELS_DIR}/*.whl "
    "&& export PYTHONPATH=/tmp/site"
)
# Auxiliary (target) layer ids: only their count (3) matters to the drafter's shapes.
AUX_LAYER_IDS = [2, 18, 33]
SHAPE_KEYS = ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim", "intermediate_size",
              "vocab_size", "rms_norm_eps", "max_position_embeddings", "rope_theta")
RESULT_KEYS = ("step_ms_median", "step_ms_min", "step_ms_max", "grid_positions", "peak_alloc_gb", "first_step_s",
               "trainable_params", "status")

_shimmed: list[str] = []


class SpeculatorsUnavailableError(ImportError):
    """speculators (or a dependency of its import) is not importable; the message names ``.whl_spec``."""


def _install_datasets_shim() -> bool:
    """Put a stub ``datasets`` module in ``sys.modules`` when the real one is missing.

    ``datasets`` is an import-only dependency of speculators' P-EAGLE module (module-level
    ``from datasets import load_from_disk`` in ``speculators/train/data.py`` and friends),
    never used by the model or the timed step. The stub exposes any attribute as a
    callable / class that raises ``ImportError`` when used. Returns True when installed.
    """
    if "datasets" in sys.modules or importlib.util.find_spec("datasets") is not None:
        return False
    mod = types.ModuleType("datasets")
    mod.__doc__ = "benchmarks/speculators_ref.py import-only stub: the real `datasets` is not installed."
    # A spec keeps importlib.util.find_spec("datasets") from raising (transformers probes it);
    # importlib.metadata still reports the distribution as absent.
    mod.__spec__ = importlib.machinery.ModuleSpec("datasets", None)

    def _missing(name: str):
        def fn(*_a, **_k):
            raise ImportError(f"datasets.{name}: 'datasets' is not installed (import-only stub from "
                              "benchmarks/speculators_ref.py; not used by the timed step)")
        fn.__name__ = name
        return fn

    class Dataset:  # used as a type annotation / alias by speculators
        def __init__(self, *_a, **_k):
            raise ImportError("datasets.Dataset: 'datasets' is not installed (import-only stub)")

    def __getattr__(name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return _missing(name)

    mod.Dataset = Dataset
    mod.__getattr__ = __getattr__
    mod.__speculators_ref_stub__ = True
    sys.modules["datasets"] = mod
    _shimmed.append("datasets")
    return True


def import_speculators() -> types.SimpleNamespace:
    """Import the pieces of speculators the reference needs.

    Returns a namespace with ``PEagleDraftModel``, ``PEagleSpeculatorConfig``
    (``speculators/models/peagle/``), ``SpeculatorsConfig``, ``VerifierConfig``
    (``speculators/config.py``), ``GreedyTokenProposalConfig``
    (``speculators/proposals/greedy.py``), ``build_optimizers``
    (``speculators/train/optimizers.py``), ``version`` and ``shims`` (names of
    import-only stubs installed).

    Raises:
        SpeculatorsUnavailableError (an ``ImportError``): speculators or one of its
            import dependencies is missing; the message says how to install the wheels
            in ``.whl_spec/``.
    """
    _install_datasets_shim()
    try:
        spec = importlib.import_module("speculators")
        from speculators import SpeculatorsConfig, VerifierConfig
        from speculators.models.peagle import PEagleDraftModel, PEagleSpeculatorConfig
        from speculators.proposals.greedy import GreedyTokenProposalConfig
        from speculators.train.optimizers import build_optimizers
    except ImportError as e:
        raise SpeculatorsUnavailableError(
            f"speculators {SPECULATORS_VERSION} is not importable ({type(e).__name__}: {e}). "
            f"Install the wheels in {WHEELS_DIR} (speculators, pydantic, openai, hs-connectors, loguru, ...): "
            f"{INSTALL_HINT}") from e
    version = getattr(spec, "__version__", None)
    if version is None:
        try:
            from importlib.metadata import version as _v

            version = _v("speculators")
        except Exception:  # noqa: BLE001
            version = "unknown"
    return types.SimpleNamespace(
        PEagleDraftModel=PEagleDraftModel, PEagleSpeculatorConfig=PEagleSpeculatorConfig,
        SpeculatorsConfig=SpeculatorsConfig, VerifierConfig=VerifierConfig,
        GreedyTokenProposalConfig=GreedyTokenProposalConfig, build_optimizers=build_optimizers,
        version=version, shims=list(_shimmed))


def _copy_config(cfg):
    new = copy.copy(cfg)
    kw = getattr(cfg, "kwargs", None)
    if isinstance(kw, dict):
        new.kwargs = dict(kw)
    return new


def patch_fused_loss_autotune(fused_module=None) -> bool:
    """Give speculators' fused-loss forward and backward kernels separate autotune config lists.

    ``speculators/losses/fused.py`` builds one ``triton.autotune(configs=_tile_configs(), ...)``
    decorator and applies it to both ``loss_forward_kernel`` and ``loss_backward_kernel``,
    so their ``Autotuner.configs`` is one shared list; on torch 2.11 Dynamo then fails
    the compiled forward at the first step ("ListVariable ... already tracked for
    mutation"). This replaces each kernel's ``configs`` with its own list of copied
    ``triton.Config`` objects (same tiles, same order, same math).

    Args:
        fused_module: the module holding the two kernels; default
            ``speculators.losses.fused`` (needs Triton).

    Returns:
        True when the lists were shared and have been split; False when Triton /
        the module is unavailable, the kernels have no ``configs``, or they were
        already separate (idempotent).
    """
    if fused_module is None:
        try:
            fused_module = importlib.import_module("speculators.losses.fused")
        except ImportError:
            return False
    kernels = [getattr(fused_module, n, None) for n in ("loss_forward_kernel", "loss_backward_kernel")]
    if any(k is None or not isinstance(getattr(k, "configs", None), list) for k in kernels):
        return False
    if kernels[0].configs is not kernels[1].configs:
        return False
    for k in kernels:
        k.configs = [_copy_config(c) for c in k.configs]
    return True


def fused_loss_configs_split() -> bool | None:
    """True when speculators' two fused-loss kernels hold separate autotune config lists (the fix
    is in effect), False when they still share one, None when Triton / the module is unavailable."""
    try:
        fused = importlib.import_module("speculators.losses.fused")
    except ImportError:
        return None
    fwd, bwd = (getattr(fused, n, None) for n in ("loss_forward_kernel", "loss_backward_kernel"))
    return getattr(fwd, "configs", None) is not getattr(bwd, "configs", None)


def _layer_config(shape: dict, layers: int, draft_arch: str, sliding_window: int | None):
    from transformers import LlamaConfig
    from transformers.models.qwen3.configuration_qwen3 import Qwen3Config

    missing = [k for k in SHAPE_KEYS if k not in shape]
    if missing:
        raise ValueError(f"shape lacks {missing}")
    cls = {"llama": LlamaConfig, "qwen3": Qwen3Config}[draft_arch]
    kinds = ["sliding_attention" if sliding_window else "full_attention"] * layers
    tc = cls(num_hidden_layers=layers, hidden_act="silu", tie_word_embeddings=False, initializer_range=0.02,
             layer_types=kinds, sliding_window=sliding_window, use_sliding_window=bool(sliding_window),
             **{k: shape[k] for k in SHAPE_KEYS})
    return tc


def build_model(shape: dict, K: int, draft_vocab: int, layers: int = 4, device: str | torch.device = "cpu", *,
                draft_arch: str = "llama", sliding_window: int | None = None,
                attn_impl: str = "simple_flex_attention", seed: int = 0):
    """Build speculators' ``PEagleDraftModel`` (``speculators/models/peagle/core.py``) in fp32.

    Args:
        shape: dict with the ``SHAPES`` keys of ``benchmarks/train_step.py`` (``hidden_size``,
            ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ``intermediate_size``,
            ``vocab_size``, ``rms_norm_eps``, ``max_position_embeddings``, ``rope_theta``; extra
            keys ignored). Target hidden size = ``hidden_size``; 3 auxiliary layers.
        K: parallel depths (speculative tokens in the greedy proposal config).
        draft_vocab: draft vocabulary size ``Vd`` (``lm_head`` / ``verifier_lm_head`` ``[Vd, H]``).
        layers: decoder layers.
        device: where to build (``"meta"`` works for parameter counting).
        draft_arch: ``"llama"`` (matches our drafter) or ``"qwen3"`` (speculators' CLI default).
        sliding_window: None = full attention on every layer (ours); an int = speculators'
            CLI default style (all layers sliding, e.g. 2048).
        attn_impl: ``"simple_flex_attention"`` (speculators' default: flex attention with a
            ``create_block_mask`` block mask), ``"eager"`` or ``"sdpa"`` (dense masks).
        seed: RNG seed for the weight init.

    Returns:
        ``PEagleDraftModel`` with fp32 parameters, ``mask_token_id = vocab_size - 1``,
        embeddings trainable, ``lm_head`` / ``verifier_lm_head`` / ``verifier_norm`` frozen,
        the NaN-initialised verifier-owned weights filled with N(0, 0.02).

    Raises:
        SpeculatorsUnavailableError: speculators is not importable.
        ValueError: a shape key is missing.
    """
    sp = import_speculators()
    tc = _layer_config(shape, layers, draft_arch, sliding_window)
    tc._attn_implementation = attn_impl  # what from_training_args sets (draft_attn_impl)
    cfg = sp.PEagleSpeculatorConfig(
        transformer_layer_config=tc, draft_vocab_size=draft_vocab, norm_before_residual=False,
        norm_before_fc=False, fc_norm=False, norm_output=False, eagle_aux_hidden_state_layer_ids=list(AUX_LAYER_IDS),
        mask_token_id=shape["vocab_size"] - 1,
        speculators_config=sp.SpeculatorsConfig(
            algorithm="peagle", proposal_methods=[sp.GreedyTokenProposalConfig(speculative_tokens=K)],
            default_proposal_method="greedy",
            verifier=sp.VerifierConfig(name_or_path=None, architectures=[])))
    torch.manual_seed(seed)
    with torch.device(device):
        model = sp.PEagleDraftModel(cfg)
    with torch.no_grad():
        for w in (model.embed_tokens.weight, model.lm_head.weight, model.verifier_lm_head.weight):
            w.normal_(0.0, 0.02)
    model.embed_tokens.weight.requires_grad_(cfg.embed_requires_grad)
    for p in (model.lm_head.weight, model.verifier_lm_head.weight, model.verifier_norm.weight):
        p.requires_grad_(False)
    return model


def count_trainable_params(shape: dict, draft_vocab: int, layers: int = 4, K: int = 8, **kw) -> int:
    """Trainable parameters of speculators' P-EAGLE drafter for ``shape``, counted on the meta device
    (no memory). Keyword arguments go to :func:`build_model`."""
    model = build_model(shape, K, draft_vocab, layers, "meta", **kw)
    return sum(p.numel() for p in model.parameters() if p.requires_grad)


def make_batch(shape: dict, N: int, device: str | torch.device, seed: int = 0) -> dict:
    """Random batch of real shapes, as speculators' dataloader hands it to the model (batch 1).

    Returns ``hidden_states [1, N, 3H]`` bf16 (~N(0, 0.25)), ``verifier_last_hidden_states
    [1, N, H]`` bf16, ``input_ids [1, N]`` int64 in ``[0, vocab-1)``, ``document_ids [1, N]``
    int64 zeros (one document), ``loss_mask [1, N]`` bool ones, ``position_ids [1, N]`` int64.
    """
    H, V = shape["hidden_size"], shape["vocab_size"]
    g = torch.Generator(device="cpu").manual_seed(seed)
    return {
        "hidden_states": (torch.randn(1, N, len(AUX_LAYER_IDS) * H, generator=g) * 0.5).to(device, torch.bfloat16),
        "verifier_last_hidden_states": torch.randn(1, N, H, generator=g).to(device, torch.bfloat16),
        "input_ids": torch.randint(0, V - 1, (1, N), generator=g).to(device),
        "document_ids": torch.zeros(1, N, dtype=torch.long, device=device),
        "loss_mask": torch.ones(1, N, dtype=torch.bool, device=device),
        "position_ids": torch.arange(N, device=device).unsqueeze(0),
    }


def _raise_recompile_limit(n: int = 64) -> None:
    # A standalone copy of peagle_train.kernels.compiling.raise_recompile_limits: the reference harness imports
    # nothing of the project it is compared with. Unlike that one it leaves Dynamo's accumulated
    # (all code objects) limits at their defaults: speculators compiles one code object.
    # speculators compiles PEagleDraftModel.forward once at import; every new model
    # instance / N adds guards to the same code object, so a sweep could otherwise hit
    # Dynamo's default limit (8) and silently fall back to eager.
    import torch._dynamo

    cfg = torch._dynamo.config
    for name in ("recompile_limit", "cache_size_limit"):
        if hasattr(cfg, name) and getattr(cfg, name) < n:
            setattr(cfg, name, n)


def run_reference(shape: dict, N: int, K: int, r: float, r_min: float, steps: int, warmup: int, device: str,
                  draft_vocab: int, layers: int = 4, *, optimizer: str = "adamw_fused",
                  loss_implementation: str | None = None, draft_arch: str = "llama",
                  sliding_window: int | None = None, attn_impl: str | None = None,
                  lr: float = 1e-3, weight_decay: float = 0.01, seed: int = 0) -> dict:
    """Time speculators' full P-EAGLE training step (see the module docstring for what it includes).

    Args:
        shape: ``SHAPES`` entry of ``benchmarks/train_step.py`` (see :func:`build_model`).
        N: sequence length (tokens; batch 1, one document, all in the loss).
        K: parallel depths (``num_depths``).
        r, r_min: COD ``down_sample_ratio`` / ``down_sample_ratio_min``.
        steps: timed steps; warmup: untimed steps before them (the first step compiles).
        device: ``"cuda"`` / ``"cuda:0"`` (timed with CUDA events) or ``"cpu"`` (wall clock;
            speculators does not compile there and the eager loss is used: smoke path only).
        draft_vocab: draft vocabulary size.
        layers: decoder layers.
        optimizer: ``"adamw_fused"`` (default; ``fused=True`` on CUDA), ``"adamw"``
            (speculators' exact call, torch's default implementation) or ``"muon"``
            (speculators' CLI default, via ``speculators/train/optimizers.py``).
        loss_implementation: ``"fused"`` (Triton, default on CUDA) or ``"eager"`` (default on CPU).
        draft_arch, sliding_window, attn_impl: see :func:`build_model`; ``attn_impl`` defaults to
            ``"simple_flex_attention"`` on CUDA (speculators' default) and ``"eager"`` on CPU
            (speculators' dense-mask fallback: torch's FlexAttention has no CPU backward).
        lr, weight_decay: optimizer settings (speculators' defaults).
        seed: seed for weights, inputs and COD sampling.

    Returns:
        dict with ``step_ms_median``, ``step_ms_min``, ``step_ms_max`` (ms per step),
        ``grid_positions`` (elements of the flattened COD grid = ``total_sampled``, median over
        timed steps), ``peak_alloc_gb`` (``torch.cuda.max_memory_allocated`` / 2**30 over the
        timed steps, after a reset; None on CPU), ``first_step_s`` (wall seconds of the first
        step incl. compilation and Triton autotuning), ``trainable_params``, ``status``
        (``"ok"``, ``"oom"`` on ``torch.cuda.OutOfMemoryError`` anywhere, or ``"error: ..."``)
        and descriptive keys (``N``, ``K``, ``speculators``, ``precision``, ``optimizer``,
        ``loss_implementation``, ``autotune_patch``, ``shims``, ...). Unknown values are None.

    Raises:
        SpeculatorsUnavailableError (``ImportError``): speculators is not importable; the message
            names the ``.whl_spec`` wheels folder and the install command.
    """
    sp = import_speculators()  # raises a clear ImportError before anything else
    dev = torch.device(device)
    cuda = dev.type == "cuda"
    impl = loss_implementation or ("fused" if cuda else "eager")
    attn_impl = attn_impl or ("simple_flex_attention" if cuda else "eager")
    rec: dict = {k: None for k in RESULT_KEYS}
    rec.update({
        "N": N, "K": K, "r": r, "r_min": r_min, "draft_vocab": draft_vocab, "layers": layers,
        "steps": steps, "warmup": warmup, "device": str(dev),
        "speculators": sp.version, "torch": torch.__version__, "shims": sp.shims,
        "precision": "fp32 master weights + optimizer state, bf16 autocast forward, bf16 input hidden states",
        "optimizer": optimizer, "loss_implementation": impl, "draft_arch": draft_arch,
        "attention": f"{attn_impl}, " + (f"sliding window {sliding_window}" if sliding_window else "full"),
        "max_anchors": None, "compiled": cuda, "autotune_patch": None,
    })
    model = batch = opts = scheds = None
    try:
        if impl == "fused":
            patch_fused_loss_autotune()
            rec["autotune_patch"] = fused_loss_configs_split()
        if cuda:
            if dev.index is not None:
                torch.cuda.set_device(dev)
            _raise_recompile_limit()
        model = build_model(shape, K, draft_vocab, layers, dev, draft_arch=draft_arch, sliding_window=sliding_window,
                            attn_impl=attn_impl, seed=seed)
        model.train()
        rec["trainable_params"] = sum(p.numel() for p in model.parameters() if p.requires_grad)
        call_kwargs, _ = sp.PEagleDraftModel.get_trainer_kwargs(
            loss_fn="kl_div", loss_implementation=impl, max_anchors=None, num_depths=K, down_sample_ratio=r,
            down_sample_ratio_min=r_min)
        opts = _make_optimizers(sp, model, optimizer, lr, weight_decay, cuda)
        from transformers import get_linear_schedule_with_warmup

        total = warmup + steps
        scheds = [get_linear_schedule_with_warmup(o, num_warmup_steps=max(1, total // 100),
                                                  num_training_steps=max(total, 2)) for o in opts]
        batch = make_batch(shape, N, dev, seed)
        times, grid = [], []
        for it in range(total):
            if it == warmup and cuda:
                torch.cuda.synchronize()
                torch.cuda.reset_peak_memory_stats()
            torch.manual_seed(seed + it)  # COD sampling uses the global generator
            if cuda:
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda.synchronize()
                start.record()
            t0 = time.perf_counter()
            with torch.autocast(dev.type, dtype=torch.bfloat16):
                _draft, loss, metrics = model(**batch, **call_kwargs)
            for o in opts:
                o.zero_grad()
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            for o in opts:
                o.step()
            for s in scheds:
                s.step()
            if cuda:
                end.record()
                torch.cuda.synchronize()
                dt_ms = start.elapsed_time(end)
            else:
                dt_ms = (time.perf_counter() - t0) * 1e3
            if it == 0:
                rec["first_step_s"] = time.perf_counter() - t0
            if it >= warmup:
                times.append(dt_ms)
                grid.append(int(metrics["full_acc_total"].item()))  # = total_sampled (all positions in the loss)
            if not torch.isfinite(loss.detach()).item():
                raise FloatingPointError(f"non-finite loss at step {it}")
            del loss, metrics, _draft
        if times:
            rec.update(step_ms_median=statistics.median(times), step_ms_min=min(times), step_ms_max=max(times),
                       grid_positions=int(statistics.median(grid)))
        if cuda:
            rec["peak_alloc_gb"] = torch.cuda.max_memory_allocated(dev) / 2**30
        rec["status"] = "ok"
    except Exception as e:  # noqa: BLE001 -- report and let the sweep continue
        msg = str(e).strip().splitlines()
        first = msg[0][:300] if msg else ""
        if _is_oom(e):
            rec["status"], rec["error"] = "oom", first or "OutOfMemoryError"
        else:
            rec["status"] = f"error: {type(e).__name__}: {first}"
    finally:
        model = batch = opts = scheds = None  # noqa: F841
        gc.collect()
        if cuda:
            torch.cuda.empty_cache()
    return rec


def _is_oom(e: BaseException) -> bool:
    """``torch.cuda.OutOfMemoryError`` itself, or wrapped by Dynamo/Inductor/Triton (cause/context chain)."""
    seen = 0
    while e is not None and seen < 16:
        if isinstance(e, torch.cuda.OutOfMemoryError) or "CUDA out of memory" in str(e):
            return True
        e, seen = (e.__cause__ or e.__context__), seen + 1
    return False


def _make_optimizers(sp, model, optimizer: str, lr: float, weight_decay: float, cuda: bool) -> list:
    if optimizer == "adamw_fused":
        params = [p for p in model.parameters() if p.requires_grad]
        return [torch.optim.AdamW(params, lr=lr, weight_decay=weight_decay, fused=cuda)]
    if optimizer in ("adamw", "muon"):
        cfg = types.SimpleNamespace(optimizer=optimizer, lr=lr, weight_decay=weight_decay, muon_lr=lr,
                                    muon_momentum=0.95, muon_weight_decay=0.1, muon_ns_steps=5,
                                    muon_adjust_lr_fn="match_rms_adamw")
        return sp.build_optimizers(model, cfg)
    raise ValueError(f"unknown optimizer {optimizer!r} (adamw_fused, adamw, muon)")


def load_shapes(path: Path = REPO_ROOT / "benchmarks" / "train_step.py") -> dict:
    """``SHAPES`` of ``benchmarks/train_step.py``, read from its source (no import of peagle_train,
    so this module runs in an environment that has speculators but not our dependencies)."""
    tree = ast.parse(path.read_text())
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "SHAPES" for t in node.targets):
            return eval(compile(ast.Expression(node.value), str(path), "eval"), {"__builtins__": {}, "dict": dict})
    raise LookupError(f"no SHAPES in {path}")


def main(argv=None) -> list[dict]:
    """CLI: run :func:`run_reference` for each ``--N`` and print one JSON dict per line."""
    SHAPES = load_shapes()
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--shape", choices=sorted(SHAPES), default="gpt-oss-20b")
    ap.add_argument("--draft-vocab", type=int, default=None, help="Vd (default: the shape's)")
    ap.add_argument("--N", "--seq-len", dest="n", type=int, nargs="+", default=[2048])
    ap.add_argument("--K", type=int, default=8)
    ap.add_argument("--r", type=float, default=0.7)
    ap.add_argument("--r-min", type=float, default=0.2)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--steps", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--optimizer", choices=["adamw_fused", "adamw", "muon"], default="adamw_fused")
    ap.add_argument("--loss-implementation", choices=["fused", "eager"], default=None)
    ap.add_argument("--draft-arch", choices=["llama", "qwen3"], default="llama")
    ap.add_argument("--sliding-window", type=int, default=None)
    ap.add_argument("--count-params", action="store_true", help="only print trainable params (meta device)")
    ap.add_argument("--out", default=None, help="also write the list of dicts as JSON here")
    args = ap.parse_args(argv)
    shape = dict(SHAPES[args.shape])
    vd = args.draft_vocab or shape.get("draft_vocab") or shape["vocab_size"]
    if args.count_params:
        n = count_trainable_params(shape, vd, args.layers, args.K, draft_arch=args.draft_arch)
        print(json.dumps({"shape": args.shape, "draft_vocab": vd, "layers": args.layers, "trainable_params": n}))
        return []
    rows = []
    for N in args.n:
        row = run_reference(shape, N, args.K, args.r, args.r_min, args.steps, args.warmup, args.device, vd,
                            args.layers, optimizer=args.optimizer, loss_implementation=args.loss_implementation,
                            draft_arch=args.draft_arch, sliding_window=args.sliding_window)
        row["shape"] = args.shape
        print(json.dumps(row), flush=True)
        rows.append(row)
    if args.out:
        Path(args.out).write_text(json.dumps(rows, indent=1))
    return rows


if __name__ == "__main__":
    main()
