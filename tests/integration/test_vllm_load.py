"""Load our exports with vLLM's own code (spec §5, ../shared/design/VLLM_ON_CPU.md).

Skipped unless vLLM is importable. Set up the separate CPU venv with
``bash tests/vllm_env/setup.sh /work/vllm-venv`` and run
``PYTHONPATH=. /work/vllm-venv/bin/pytest -q tests/integration/test_vllm_load.py``.

What runs is vLLM 0.33's code: ``EngineArgs.create_engine_config`` (config
checks, ``EAGLEConfig`` wrapping, architecture resolution), the V1
``EagleProposer`` (mask-token lookup ``_init_parallel_drafting_params``), the
model runner's aux-layer lookup, model construction and
``Eagle3LlamaForCausalLM.load_weights`` through the default loader on a
world-size-1 gloo group, then ``combine_hidden_states`` and ``compute_logits``.
Forward/attention need compiled kernels and are not run; instead every tensor
vLLM holds after loading is compared with our drafter, and the pieces that run
on CPU (fc projection of the aux states and of ``mask_hidden``, final norm,
MLPs, logits with the d2t scatter) are compared numerically.

CPU shims (VLLM_ON_CPU.md): ``VLLM_TARGET_DEVICE=cpu``; vLLM's CPU GEMM dispatch
(AMX / oneDNN weight pre-packing needs the compiled ``_C`` ops) is replaced by
plain ``torch.nn.functional.linear``; ``torch.accelerator.empty_cache`` is a no-op.
"""
from __future__ import annotations

import json
import os
import socket
from pathlib import Path
from types import SimpleNamespace

import pytest

os.environ.setdefault("VLLM_TARGET_DEVICE", "cpu")
vllm = pytest.importorskip("vllm")

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402

from peagle_train.export.check import check_export  # noqa: E402
from peagle_train.export.writer import export_speculators, export_vllm  # noqa: E402

try:  # shared tiny-drafter helpers; `tests` is a package only when the repo root is on sys.path
    from tests.unit.test_export import AUX, MASK, K, T, V, make_drafter, target_config  # noqa: E402
except ImportError:  # pragma: no cover - plain `pytest` puts tests/ itself on sys.path
    from test_export import AUX, MASK, K, T, V, make_drafter, target_config  # noqa: E402

pytestmark = pytest.mark.vllm


@pytest.fixture(scope="module")
def vllm_cpu(tmp_path_factory):
    """Shims + one world-size-1 gloo process group for every model built in this module."""
    import vllm.model_executor.layers.utils as vllm_layer_utils
    from vllm.config import set_current_vllm_config
    from vllm.distributed import init_distributed_environment, initialize_model_parallel

    mp = pytest.MonkeyPatch()
    mp.setattr(torch.accelerator, "empty_cache", lambda: None)

    def plain_linear(layer, remove_weight):
        layer.cpu_linear = lambda x, weight, bias: torch.nn.functional.linear(x, weight, bias)

    mp.setattr(vllm_layer_utils, "dispatch_cpu_unquantized_gemm", plain_linear)
    target_dir = tmp_path_factory.mktemp("target")
    target_config().save_pretrained(str(target_dir))
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    from vllm.engine.arg_utils import EngineArgs

    bootstrap = EngineArgs(model=str(target_dir), skip_tokenizer_init=True, dtype="float32", max_model_len=128,
                           enforce_eager=True).create_engine_config()
    with set_current_vllm_config(bootstrap):
        init_distributed_environment(world_size=1, rank=0, distributed_init_method=f"tcp://127.0.0.1:{port}",
                                     local_rank=0, backend="gloo")
        initialize_model_parallel(1, 1)
    yield SimpleNamespace(target_dir=target_dir)
    mp.undo()


def vllm_load(target_dir: Path, draft_dir: Path, *, num_speculative_tokens: int, parallel: bool,
              dtype: str = "float32"):
    """vLLM's engine config, proposer and loaded drafter for ``draft_dir`` (local target ``target_dir``)."""
    from vllm.config import set_current_vllm_config
    from vllm.engine.arg_utils import EngineArgs
    from vllm.v1.spec_decode.eagle import EagleProposer
    from vllm.v1.worker.gpu_model_runner import GPUModelRunner

    spec = {"method": "eagle3", "model": str(draft_dir), "num_speculative_tokens": num_speculative_tokens}
    if parallel:
        spec["parallel_drafting"] = True
    args = EngineArgs(model=str(target_dir), skip_tokenizer_init=True, dtype=dtype, max_model_len=128,
                      enforce_eager=True, speculative_config=spec)
    vc = args.create_engine_config()
    with set_current_vllm_config(vc):
        proposer = EagleProposer(vc, torch.device("cpu"), runner=None)
        model = proposer._get_model()
    aux = GPUModelRunner._get_eagle3_aux_layers_from_config(SimpleNamespace(speculative_config=vc.speculative_config))
    return SimpleNamespace(config=vc, proposer=proposer, model=model, aux_layers=aux)


def assert_vllm_holds_our_weights(model, drafter) -> None:
    """Every tensor vLLM loaded equals ours (q/k/v and gate/up are stacked by vLLM)."""
    ours = {k: v.float() for k, v in drafter.state_dict().items()}
    got = dict(model.named_parameters())
    got.update(dict(model.named_buffers()))
    checked = 0
    for i in range(drafter.config.num_hidden_layers):
        p, q = f"model.layers.{i}.", f"layers.{i}."
        pairs = {
            "self_attn.qkv_proj.weight": torch.cat([ours[q + f"self_attn.{n}_proj.weight"] for n in "qkv"]),
            "self_attn.o_proj.weight": ours[q + "self_attn.o_proj.weight"],
            "mlp.gate_up_proj.weight": torch.cat([ours[q + "mlp.gate_proj.weight"], ours[q + "mlp.up_proj.weight"]]),
            "mlp.down_proj.weight": ours[q + "mlp.down_proj.weight"],
            "input_layernorm.weight": ours[q + "input_layernorm.weight"],
            "post_attention_layernorm.weight": ours[q + "post_attention_layernorm.weight"],
        }
        if i == 0:
            pairs["hidden_norm.weight"] = ours[q + "hidden_norm.weight"]
        for name, want in pairs.items():
            torch.testing.assert_close(got[p + name].float(), want, rtol=0, atol=0, msg=p + name)
            checked += 1
    for name, key in (("model.fc.weight", "fc.weight"), ("model.norm.weight", "norm.weight"),
                      ("model.embed_tokens.weight", "embed_tokens.weight"), ("lm_head.weight", "lm_head.weight")):
        torch.testing.assert_close(got[name].float(), ours[key], rtol=0, atol=0, msg=name)
        checked += 1
    if drafter.config.draft_vocab_size < drafter.config.vocab_size:
        assert torch.equal(model.draft_id_to_target_id, drafter.d2t)
    else:
        assert model.draft_id_to_target_id is None
    if drafter.config.parallel_drafting:
        assert torch.equal(model.mask_hidden.float(), drafter.mask_hidden.view(1, -1).float())
    assert checked == 6 * drafter.config.num_hidden_layers + 1 + 4


def assert_same_computation(model, drafter, Vd: int) -> None:
    """The parts of vLLM's drafter that run on CPU compute what ours computes."""
    torch.manual_seed(0)
    aux = torch.randn(5, len(AUX) * T)
    x = torch.randn(5, drafter.config.hidden_size)
    with torch.no_grad():
        torch.testing.assert_close(model.combine_hidden_states(aux), drafter.project_aux(aux))
        if drafter.config.parallel_drafting:  # what the proposer feeds every mask slot
            torch.testing.assert_close(model.combine_hidden_states(model.mask_hidden.view(-1)),
                                       drafter.mask_hidden_projected())
        torch.testing.assert_close(model.model.norm(x), drafter.norm(x))
        for i, layer in enumerate(model.model.layers):
            torch.testing.assert_close(layer.mlp(x), drafter.layers[i].mlp(x))
        logits = model.compute_logits(x)  # [5, V] target-vocab logits, -inf outside the draft vocab
        ours = drafter.lm_head(x)
        tgt = drafter.draft_to_target(torch.arange(Vd))
        assert logits.shape == (5, V)
        torch.testing.assert_close(logits[:, tgt], ours)
        outside = torch.ones(V, dtype=torch.bool)
        outside[tgt] = False
        assert bool(torch.isneginf(logits[:, outside]).all())
        assert torch.equal(logits.argmax(-1), drafter.draft_to_target(ours.argmax(-1)))


@pytest.mark.parametrize("Vd,parallel", [(64, True), (V, True), (64, False)], ids=["peagle-pruned-vocab",
                                                                                  "peagle-full-vocab", "eagle3"])
def test_vllm_loads_our_export(vllm_cpu, tmp_path, Vd, parallel):
    drafter = make_drafter(Vd=Vd, parallel=parallel)
    out = export_vllm(drafter, tmp_path / "draft", target_name=str(vllm_cpu.target_dir),
                      target_config=target_config(), dtype=torch.float32)
    v = vllm_load(vllm_cpu.target_dir, out, num_speculative_tokens=K, parallel=parallel)
    hf = v.config.speculative_config.draft_model_config.hf_config
    assert v.config.speculative_config.draft_model_config.architectures == ["LlamaForCausalLMEagle3"]
    assert type(v.model).__name__ == "Eagle3LlamaForCausalLM"
    assert v.aux_layers == tuple(AUX)
    assert v.model.model.fc_input_size == len(AUX) * T
    assert getattr(hf, "norm_before_residual") is False
    assert getattr(hf, "sliding_window", None) is None and not getattr(hf, "attention_bias", False)
    assert v.config.speculative_config.parallel_drafting is parallel
    if parallel:
        assert v.proposer.parallel_drafting_token_id == MASK
    assert_vllm_holds_our_weights(v.model, drafter)
    assert_same_computation(v.model, drafter, Vd)


def test_vllm_loads_bf16_export(vllm_cpu, tmp_path):
    drafter = make_drafter()
    out = export_vllm(drafter, tmp_path / "draft", target_name="t", dtype=torch.bfloat16)
    v = vllm_load(vllm_cpu.target_dir, out, num_speculative_tokens=K, parallel=True, dtype="bfloat16")
    assert v.model.lm_head.weight.dtype == torch.bfloat16
    torch.testing.assert_close(v.model.lm_head.weight, drafter.lm_head.weight.to(torch.bfloat16), rtol=0, atol=0)
    torch.testing.assert_close(v.model.mask_hidden, drafter.mask_hidden.view(1, -1).to(torch.bfloat16),
                               rtol=0, atol=0)


def test_vllm_loads_speculators_export(vllm_cpu, tmp_path):
    from vllm.transformers_utils.config import maybe_override_with_speculators

    drafter = make_drafter()
    out = export_speculators(drafter, tmp_path / "spec", target_name="tiny/target", target_config=target_config(),
                             dtype=torch.float32)
    # `vllm serve DIR`: vLLM resolves method, K and the verifier from our config (no network needed for this)
    model, tokenizer, spec = maybe_override_with_speculators(model=str(out), tokenizer=None,
                                                             trust_remote_code=False)
    assert (model, tokenizer) == ("tiny/target", "tiny/target")
    assert spec == {"method": "eagle3", "num_speculative_tokens": K, "parallel_drafting": True, "model": str(out)}
    # a local target is passed explicitly (vLLM refuses local verifier paths inside the config)
    v = vllm_load(vllm_cpu.target_dir, out, num_speculative_tokens=K, parallel=True)
    sc = v.config.speculative_config
    hf = sc.draft_model_config.hf_config
    assert type(hf).__name__ == "SpeculatorsConfig" and type(v.model).__name__ == "Eagle3LlamaForCausalLM"
    assert v.proposer.parallel_drafting_token_id == MASK and v.aux_layers == tuple(AUX)
    assert getattr(hf, "norm_before_residual") is False
    assert_vllm_holds_our_weights(v.model, drafter)
    assert_same_computation(v.model, drafter, 64)


def _break(out: Path, fn) -> None:
    t = load_file(str(out / "model.safetensors"))
    fn(t)
    save_file(t, str(out / "model.safetensors"))


def test_what_our_check_rejects_vllm_rejects(vllm_cpu, tmp_path):
    """Spec §5 facts pinned against vLLM itself: d2t with Vd == V fails the load, a missing mask_hidden
    fails a parallel-drafting load, a 'model.' prefix is an unexpected key; all three fail our check too."""
    cases = {
        "d2t_full_vocab": (V, lambda t: t.update(d2t=torch.zeros(V, dtype=torch.int64)), "d2t",
                           "draft_id_to_target_id"),
        "no_mask_hidden": (64, lambda t: t.pop("mask_hidden"), "mask_hidden", "mask_hidden not found in weights"),
        "model_prefix": (64, lambda t: t.update({"model.norm.weight": t.pop("norm.weight")}), "model.",
                         "no module or parameter named 'model'"),
    }
    for name, (Vd, fn, ours, theirs) in cases.items():
        out = export_vllm(make_drafter(Vd=Vd), tmp_path / name, target_name="t", dtype=torch.float32)
        _break(out, fn)
        assert any(ours in p for p in check_export(out)), name
        with pytest.raises((ValueError, KeyError, RuntimeError, AttributeError)) as e:
            vllm_load(vllm_cpu.target_dir, out, num_speculative_tokens=K, parallel=True)
        assert theirs in str(e.value), (name, repr(e.value))


def test_missing_norm_loads_silently_in_vllm_but_fails_our_check(vllm_cpu, tmp_path):
    """vLLM does not report missing weights (spec §5): the contract check is the only guard."""
    out = export_vllm(make_drafter(), tmp_path / "d", target_name="t", dtype=torch.float32)
    _break(out, lambda t: t.pop("norm.weight"))
    assert any("missing 'norm.weight'" in p for p in check_export(out))
    v = vllm_load(vllm_cpu.target_dir, out, num_speculative_tokens=K, parallel=True)
    assert v.model.model.norm.weight.shape == (T,)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["parallel_drafting"] is True


@pytest.mark.parametrize("Vd", [1024, None], ids=["pruned-vocab", "full-vocab"])
def test_vllm_loads_a_gpt_oss_shaped_export(vllm_cpu, tmp_path, Vd):
    """The drafter ``recipes/gpt-oss-20b.yaml`` builds, at the tiny GPT-OSS configuration (mixture-of-experts
    target with sliding-window layers and attention sinks, the real 201,088-token vocabulary, mask token 201,020),
    exported and loaded by vLLM against a GPT-OSS target folder (issue 22: the export passes vLLM's loader). The
    drafter has 8 query heads to mirror the real shape (below). The target folder has no MXFP4
    ``quantization_config`` (``random_target_config`` drops it: random weights are not quantised), which would
    concern how vLLM runs the target's experts, not the drafter."""
    from peagle_train.features.target import random_target_config
    from peagle_train.model.drafter import Drafter, make_drafter_config

    tconf = random_target_config("pkg:peagle_train/gpt-oss-20b-tiny.json")  # (its reader drops the MXFP4 entry)
    target_dir = tmp_path / "gpt-oss-tiny"
    tconf.save_pretrained(str(target_dir))
    assert "quantization_config" not in json.loads((target_dir / "config.json").read_text())
    aux, mask = [2, 4, 5], 201020
    V, H = tconf.vocab_size, tconf.hidden_size
    torch.manual_seed(0)
    # 8 heads x 16 over a hidden of 64: the query width (128) exceeds the hidden size, as the real drafter's
    # 64 heads x 64 (4,096) exceed its 2,880 (the tiny target's own 4 x 16 would equal it)
    cfg = make_drafter_config(tconf, aux_layer_ids=aux, draft_vocab_size=Vd or V, mask_token_id=mask, num_layers=2,
                              num_attention_heads=8, parallel_drafting=True, K=K)
    assert (cfg.head_dim, cfg.num_attention_heads, cfg.hidden_size) == (16, 8, 64)
    drafter = Drafter(cfg)
    with torch.no_grad():
        for p in drafter.parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if p.ndim == 1 else 0.0))
    if Vd is not None:
        drafter.set_draft_vocab(torch.arange(0, 2 * Vd, 2))
    out = export_vllm(drafter, tmp_path / "draft", target_name=str(target_dir), target_config=tconf,
                      dtype=torch.float32)
    assert check_export(out, target=str(target_dir)) == []
    v = vllm_load(target_dir, out, num_speculative_tokens=K, parallel=True)
    assert v.config.model_config.hf_config.model_type == "gpt_oss"
    assert type(v.model).__name__ == "Eagle3LlamaForCausalLM" and v.aux_layers == tuple(aux)
    assert v.proposer.parallel_drafting_token_id == mask
    assert v.model.model.fc_input_size == len(aux) * H
    assert_vllm_holds_our_weights(v.model, drafter)
    x, feats = torch.randn(5, H), torch.randn(5, len(aux) * H)
    with torch.no_grad():
        torch.testing.assert_close(v.model.combine_hidden_states(feats), drafter.project_aux(feats))
        logits = v.model.compute_logits(x)  # [5, V] in the target's vocabulary
        tgt = drafter.draft_to_target(torch.arange(Vd or V))
        torch.testing.assert_close(logits[:, tgt], drafter.lm_head(x))
        assert torch.equal(logits.argmax(-1), drafter.draft_to_target(drafter.lm_head(x).argmax(-1)))


def test_vllm_loads_the_smollm2_gpu_recipes_drafter(vllm_cpu, tmp_path):
    """The drafter ``recipes/smollm2-135m-peagle-gpu.yaml`` trains (run 7 of docs/results.md: 4 layers of the
    target's shape, the whole 49,152-token vocabulary, mask token 16, K = 8, aux layers 2 / 15 / 27), at SmolLM2's
    real configuration (9 query heads, 3 key/value heads, hidden 576), exported as the trainer's export step writes
    it and loaded by vLLM against a SmolLM2 target folder: what serving run 7's drafter runs."""
    from peagle_train.features.target import default_aux_layer_ids, random_target_config
    from peagle_train.methods import get_method
    from peagle_train.model.drafter import Drafter, make_drafter_config
    from peagle_train.recipe import load_config, validate_against_target

    cfg = load_config(Path(__file__).resolve().parents[2] / "recipes" / "smollm2-135m-peagle-gpu.yaml")
    tconf = random_target_config("pkg:peagle_train/smollm2-135m-instruct.json")
    validate_against_target(cfg, tconf)
    target_dir = tmp_path / "smollm2"
    tconf.save_pretrained(str(target_dir))
    aux = default_aux_layer_ids(tconf.num_hidden_layers)
    assert aux == [2, 15, 27] and cfg.drafter.draft_vocab_size in (None, tconf.vocab_size)
    # as the trainer builds it (peagle_train.trainer.setup): the recipe's shape, K and the method's own fields
    dcfg = make_drafter_config(tconf, aux_layer_ids=aux, draft_vocab_size=tconf.vocab_size, K=cfg.train.K,
                               **cfg.drafter.shape_fields(), **get_method(cfg.train.method).drafter_fields(cfg))
    assert (dcfg.num_hidden_layers, dcfg.num_attention_heads, dcfg.num_key_value_heads, dcfg.hidden_size) == (4, 9, 3, 576)
    assert dcfg.parallel_drafting and dcfg.mask_token_id == 16
    torch.manual_seed(0)
    drafter = Drafter(dcfg)
    with torch.no_grad():
        for p in drafter.parameters():
            p.copy_(torch.randn_like(p) * 0.02 + (1.0 if p.ndim == 1 else 0.0))
    out = export_vllm(drafter, tmp_path / "draft", target_name=str(target_dir), target_config=tconf,
                      dtype=torch.float32)
    assert check_export(out, target=str(target_dir)) == []
    v = vllm_load(target_dir, out, num_speculative_tokens=cfg.train.K - 1, parallel=True)
    assert type(v.model).__name__ == "Eagle3LlamaForCausalLM" and v.aux_layers == tuple(aux)
    assert v.proposer.parallel_drafting_token_id == 16 and v.model.model.fc_input_size == 3 * 576
    assert_vllm_holds_our_weights(v.model, drafter)
    x, feats = torch.randn(5, 576), torch.randn(5, 3 * 576)
    with torch.no_grad():
        torch.testing.assert_close(v.model.combine_hidden_states(feats), drafter.project_aux(feats))
        torch.testing.assert_close(v.model.combine_hidden_states(v.model.mask_hidden.view(-1)),
                                   drafter.mask_hidden_projected())
        logits = v.model.compute_logits(x)
        torch.testing.assert_close(logits, drafter.lm_head(x))


@pytest.mark.skipif(not os.environ.get("PEAGLE_VLLM_EXPORT"),
                    reason="set PEAGLE_VLLM_EXPORT=DIR (a trained drafter's export) to load it in vLLM")
def test_vllm_loads_a_trained_export(vllm_cpu, tmp_path):
    """A trained drafter's export as it came back from the GPU machine (``PEAGLE_VLLM_EXPORT=DIR``, e.g. joined by
    ``benchmarks/ferry.py join``; ``PEAGLE_VLLM_TARGET_CONFIG``: the target's configuration, default SmolLM2's): our
    contract check passes against that target, vLLM loads it as it serves it (dtype of the export, its trained K,
    parallel drafting when the export says so) and holds every weight bit for bit; the aux projection, the mask
    slots' hidden state and the logits compute what ours compute. What issue 20 asks of the final drafter's export."""
    from peagle_train.export.writer import load_exported
    from peagle_train.features.target import random_target_config

    out = Path(os.environ["PEAGLE_VLLM_EXPORT"])
    tconf = random_target_config(os.environ.get("PEAGLE_VLLM_TARGET_CONFIG",
                                                "pkg:peagle_train/smollm2-135m-instruct.json"))
    target_dir = tmp_path / "target"
    tconf.save_pretrained(str(target_dir))
    assert check_export(out, target=str(target_dir)) == []
    raw = json.loads((out / "config.json").read_text())
    parallel = raw.get("parallel_drafting") is True
    dtype = str(raw.get("torch_dtype") or raw.get("dtype") or "float32").replace("torch.", "")
    drafter = load_exported(out)
    K = drafter.config.num_parallel_depths if parallel else 3
    v = vllm_load(target_dir, out, num_speculative_tokens=max(1, K - 1) if parallel else K, parallel=parallel,
                  dtype=dtype)
    assert type(v.model).__name__ == "Eagle3LlamaForCausalLM"
    aux = list(drafter.config.eagle_aux_hidden_state_layer_ids)
    assert v.aux_layers == tuple(aux)
    if parallel:
        assert v.proposer.parallel_drafting_token_id == drafter.mask_token_id
    assert_vllm_holds_our_weights(v.model, drafter)
    feats = torch.randn(5, len(aux) * tconf.hidden_size)
    x = torch.randn(5, drafter.config.hidden_size)
    tol = {} if dtype == "float32" else dict(rtol=2e-2, atol=2e-2)  # bf16: vLLM computes in bf16, ours in fp32
    with torch.no_grad():
        cast = next(v.model.parameters()).dtype
        torch.testing.assert_close(v.model.combine_hidden_states(feats.to(cast)).float(),
                                   drafter.project_aux(feats.to(cast).float()), **tol)
        logits = v.model.compute_logits(x.to(cast)).float()
        ours = drafter.lm_head(x.to(cast).float())
        tgt = drafter.draft_to_target(torch.arange(drafter.config.draft_vocab_size))
        torch.testing.assert_close(logits[:, tgt], ours, **tol)
