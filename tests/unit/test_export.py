"""Export stage: vLLM checkpoint layout (spec §5), contract check, round trip, atomicity, Hub push.

Tiny real drafters (2 layers, H = T = 32, V = 128) run through the grid forward
(dense SDPA mask) so round trips compare real logits, not just tensors.
"""
from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from transformers import LlamaConfig

from peagle_train.core.atomic import write_json_atomic
from peagle_train.export.check import (
    ExportCheckError,
    assert_export_ok,
    check_export,
    expected_weights,
    vllm_architecture,
)
from peagle_train.export.hub import HubPushError, push_to_hub
from peagle_train.export.model_card import data_summary, simulated_acceptance_lengths
from peagle_train.export.writer import ExportError, build_vllm_config, export_speculators, export_vllm, load_exported
from peagle_train.kernels.attention import make_attn_spec
from peagle_train.model.drafter import Drafter, make_drafter_config
from peagle_train.peagle.grid import build_grid, cod_sample
from peagle_train.peagle.masks import GridMeta
from peagle_train.peagle.metrics import DepthStats

V, T, L = 128, 32, 8
MASK = 127
AUX = [1, 4, 5]
K = 4


def target_config(**extra) -> LlamaConfig:
    return LlamaConfig(hidden_size=T, intermediate_size=64, num_hidden_layers=L, num_attention_heads=4,
                       num_key_value_heads=2, head_dim=8, vocab_size=V, max_position_embeddings=256,
                       rope_theta=50000.0, architectures=["LlamaForCausalLM"], **extra)


def make_drafter(*, Vd: int = 64, parallel: bool = True, hidden_size: int | None = None, seed: int = 0) -> Drafter:
    """A 2-layer drafter with every parameter random (norms too), draft vocab = every other id."""
    torch.manual_seed(seed)
    cfg = make_drafter_config(target_config(), aux_layer_ids=AUX, draft_vocab_size=Vd, mask_token_id=MASK,
                              num_layers=2, parallel_drafting=parallel, K=K, hidden_size=hidden_size,
                              allow_hidden_size_mismatch=hidden_size not in (None, T))
    d = Drafter(cfg)
    with torch.no_grad():
        for p in d.parameters():
            p.copy_(torch.randn_like(p) * 0.1 + (1.0 if p.ndim == 1 else 0.0))
    if Vd < V:
        d.set_draft_vocab(torch.arange(0, 2 * Vd, 2))
    else:
        d.set_draft_vocab(torch.arange(V))
    return d.eval()


def make_tokenizer():
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import Whitespace
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(V - 2)} | {"<unk>": V - 2, "<mask>": MASK}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")


def grid_logits(drafter: Drafter, seed: int = 0) -> torch.Tensor:
    """Draft-vocab logits ``[E, Vd]`` of one packed 2-document sequence through the N×K grid."""
    g = torch.Generator().manual_seed(seed)
    N = 24
    input_ids = torch.randint(0, V - 2, (N,), generator=g)
    doc_ids = torch.tensor([0] * 14 + [1] * 10)
    loss_mask = torch.ones(N, dtype=torch.bool)
    Kd = K if drafter.config.parallel_drafting else 1
    kept = cod_sample(loss_mask, doc_ids, Kd, r=0.8, r_min=0.3, generator=g)
    grid = build_grid(input_ids, loss_mask, doc_ids, kept, MASK)
    aux = torch.randn(N, len(AUX) * T, generator=g)
    spec = make_attn_spec(GridMeta.of(grid), kind="sdpa")
    with torch.no_grad():
        hidden = drafter.grid_hidden(aux, grid.hidden_index)
        h, _ = drafter(grid.token_ids, hidden, grid.position_ids, spec)
        return drafter.logits(h)


@pytest.fixture
def exported(tmp_path):
    """Factory: export a drafter variant, return its directory."""

    def _make(name: str = "peagle", *, Vd: int = 64, parallel: bool = True, dtype=torch.bfloat16, **kw) -> Path:
        d = make_drafter(Vd=Vd, parallel=parallel, hidden_size=kw.pop("hidden_size", None))
        return export_vllm(d, tmp_path / name, target_name="tiny/target", target_config=target_config(),
                           dtype=dtype, **kw)

    return _make


# --------------------------------------------------------------------------- round trip


@pytest.mark.parametrize("Vd,parallel", [(64, True), (V, True), (64, False)])
def test_round_trip_fp32_identical_logits(tmp_path, Vd, parallel):
    d = make_drafter(Vd=Vd, parallel=parallel)
    out = export_vllm(d, tmp_path / "x", target_name="tiny/target", target_config=target_config(),
                      dtype=torch.float32)
    back = load_exported(out)
    assert torch.equal(grid_logits(d), grid_logits(back))
    assert torch.equal(back.d2t, d.d2t) and torch.equal(back.t2d, d.t2d)
    ids = torch.arange(back.d2t.numel())
    assert torch.equal(back.draft_to_target(ids), d.draft_to_target(ids))
    if parallel:
        assert torch.equal(back.mask_hidden, d.mask_hidden)
        assert back.config.mask_token_id == MASK and back.config.num_parallel_depths == K


def test_round_trip_bf16_within_bf16_tolerance(tmp_path):
    d = make_drafter()
    out = export_vllm(d, tmp_path / "x", target_name="tiny/target", dtype=torch.bfloat16)
    back = load_exported(out)
    assert all(p.dtype == torch.float32 for p in back.parameters())
    # exactly the drafter with bf16-rounded weights ...
    rounded = copy.deepcopy(d)
    with torch.no_grad():
        for p in rounded.parameters():
            p.copy_(p.to(torch.bfloat16).float())
    assert torch.equal(grid_logits(back), grid_logits(rounded))
    # ... and close to the fp32 original
    ref, got = grid_logits(d), grid_logits(back)
    assert not torch.equal(ref, got)
    torch.testing.assert_close(got, ref, rtol=0.05, atol=0.05 * ref.abs().max().item())
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9


def test_round_trip_speculators_format(tmp_path):
    d = make_drafter()
    out = export_speculators(d, tmp_path / "spec", target_name="tiny/target", target_config=target_config(),
                             verifier_name_or_path="org/tiny-target", dtype=torch.float32)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["speculators_model_type"] == "peagle"
    assert cfg["mask_token_id"] == MASK and cfg["norm_before_residual"] is False
    assert cfg["speculators_config"]["proposal_methods"][0]["speculative_tokens"] == K
    assert cfg["speculators_config"]["verifier"] == {"name_or_path": "org/tiny-target",
                                                     "architectures": ["LlamaForCausalLM"]}
    tlc = cfg["transformer_layer_config"]
    assert tlc["model_type"] == "llama" and tlc["hidden_size"] == T and tlc["num_hidden_layers"] == 2
    assert check_export(out) == []
    assert torch.equal(grid_logits(load_exported(out)), grid_logits(d))
    with pytest.raises(ExportError, match="not a Hub repo id"):
        export_speculators(d, tmp_path / "local", target_name="tiny/target", verifier_name_or_path=str(tmp_path))
    assert not (tmp_path / "local").exists()


# --------------------------------------------------------------------------- layout


def test_config_json_fields_peagle(exported):
    cfg = json.loads((exported(Vd=64) / "config.json").read_text())
    assert cfg["model_type"] == "llama" and cfg["architectures"] == ["LlamaForCausalLMEagle3"]
    assert vllm_architecture(cfg["architectures"][0]) == "LlamaForCausalLMEagle3"
    for k, v in dict(hidden_size=T, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                     intermediate_size=64, vocab_size=V, draft_vocab_size=64, target_hidden_size=T,
                     max_position_embeddings=256, hidden_act="silu", attention_bias=False, mlp_bias=False,
                     tie_word_embeddings=False, norm_before_residual=False, rope_theta=50000.0,
                     eagle_aux_hidden_state_layer_ids=AUX, parallel_drafting=True, ptd_token_id=MASK,
                     pard_token=MASK, num_parallel_depths=K, dtype="bfloat16").items():
        assert cfg[k] == v, k
    assert cfg["eagle_config"] == {"use_aux_hidden_state": True, "eagle_aux_hidden_state_layer_ids": AUX}
    assert cfg["rope_parameters"]["rope_theta"] == 50000.0
    assert "mask_token_id" not in cfg and "allow_hidden_size_mismatch" not in cfg
    for k in ("layer_types", "sliding_window", "quantization_config", "logit_scale", "is_causal", "qkv_bias"):
        assert k not in cfg


def test_config_json_eagle3_baseline_has_no_parallel_fields(exported):
    out = exported("e3", parallel=False)
    cfg = json.loads((out / "config.json").read_text())
    for k in ("parallel_drafting", "ptd_token_id", "pard_token", "mask_token_id", "num_parallel_depths"):
        assert k not in cfg
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        assert "mask_hidden" not in f.keys()
    assert check_export(out) == []


def test_target_fields_never_copied():
    tc = target_config(sliding_window=128, layer_types=["sliding_attention"] * L, attention_bias=True,
                       quantization_config={"quant_method": "mxfp4"}, logit_scale=2.0)
    d = make_drafter()
    cfg = build_vllm_config(d.config, target_config=tc)
    for k in ("sliding_window", "layer_types", "quantization_config", "logit_scale"):
        assert k not in cfg
    assert cfg["attention_bias"] is False and cfg["eos_token_id"] == tc.eos_token_id


def test_target_mismatch_is_refused():
    d = make_drafter()
    with pytest.raises(ExportError, match="vocab_size=128 but the target config has 256"):
        build_vllm_config(d.config, target_config=LlamaConfig(hidden_size=T, vocab_size=256,
                                                               max_position_embeddings=256))


@pytest.mark.parametrize("Vd", [64, V])
def test_safetensors_keys_and_dtypes(exported, Vd):
    out = exported(Vd=Vd)
    with safe_open(str(out / "model.safetensors"), "pt") as f:
        keys = set(f.keys())
        dtypes = {k: f.get_slice(k).get_dtype() for k in keys}
    cfg = json.loads((out / "config.json").read_text())
    required, _ = expected_weights(cfg)
    assert keys == set(required) | {"t2d"}
    assert {"embed_tokens.weight", "lm_head.weight", "mask_hidden", "layers.0.hidden_norm.weight"} <= keys
    assert ("d2t" in keys) == (Vd < V)
    assert not any(k.startswith("model.") or "rotary" in k or "inv_freq" in k for k in keys)
    assert dtypes["t2d"] == "BOOL" and dtypes.get("d2t", "I64") == "I64"
    assert {dt for k, dt in dtypes.items() if k not in ("t2d", "d2t")} == {"BF16"}
    t = load_file(str(out / "model.safetensors"))
    assert t["mask_hidden"].shape == (1, 1, 3 * T) and t["fc.weight"].shape == (T, 3 * T)
    assert t["layers.0.self_attn.q_proj.weight"].shape == (32, 2 * T)
    assert t["layers.1.self_attn.q_proj.weight"].shape == (32, T)


def test_tokenizer_and_card_written(tmp_path):
    from transformers import AutoTokenizer

    d = make_drafter()
    metrics = {"accuracy": [0.8, 0.6, 0.5, 0.4], "conditional_accuracy": [0.8, 0.7, 0.6, 0.5]}
    card = {"data": ["UltraChat (regenerated by the target)", "2,000 conversations"], "metrics": metrics,
            "eval": [{"dataset": "mt_bench", "K": 3, "acceptance_length": 2.75}], "license": "apache-2.0",
            "model_id": "me/tiny-peagle", "training": {"lr": 3e-4, "steps": 100}}
    out = export_vllm(d, tmp_path / "x", tokenizer=make_tokenizer(), target_name="tiny/target", card=card)
    tok = AutoTokenizer.from_pretrained(str(out))
    assert tok.convert_tokens_to_ids("<mask>") == MASK
    readme = (out / "README.md").read_text()
    cmd = ("vllm serve tiny/target --speculative-config '{\"method\": \"eagle3\", \"model\": \"me/tiny-peagle\", "
           "\"num_speculative_tokens\": 4, \"parallel_drafting\": true}'")
    assert cmd in readme
    assert "K trained (max servable `num_speculative_tokens`) | **4**" in readme
    assert "VLLM_USE_V2_MODEL_RUNNER=1" in readme and "disable_padded_drafter_batch" in readme
    assert "UltraChat (regenerated by the target)" in readme and "| mt_bench | 3 | 2.75 |" in readme
    als = simulated_acceptance_lengths(metrics["conditional_accuracy"])
    assert als[:2] == pytest.approx([1.8, 1.8 + 0.8 * 0.7])
    assert f"| 3 | 0.4 | 0.5 | {als[3]:.4g} |" in readme
    assert "H != T" not in readme
    assert json.loads((out / "config.json").read_text())["architectures"] == ["LlamaForCausalLMEagle3"]


def test_card_accepts_depth_stats_and_rejects_unknown_keys(tmp_path):
    st = DepthStats(torch.tensor([8.0, 3.0]), torch.tensor([10.0, 10.0]), torch.tensor([8.0, 3.0]),
                    torch.tensor([10.0, 6.0]))
    out = export_vllm(make_drafter(), tmp_path / "a", target_name="t", card={"metrics": st})
    assert f"| 1 | 0.3 | 0.5 | {1 + 0.8 + 0.4:.4g} |" in (out / "README.md").read_text()
    with pytest.raises(ValueError, match="unknown model card keys"):
        export_vllm(make_drafter(), tmp_path / "b", target_name="t", card={"metric": st})
    assert not (tmp_path / "b").exists()


def test_card_from_pipeline_outputs(tmp_path):
    """The card dict peagle_train.stages.run_export builds: run_train's summary, data/meta.json, the recipe."""
    train = {"method": "peagle", "K": K, "steps": 50, "draft_vocab_size": 64,
             "final": {"eval_loss": 1.5, "eval_acc": [0.7, 0.5, 0.4, 0.3],
                       "eval_cond_acc": [0.7, 0.6, 0.5, 0.4], "eval_sim_al": {"1": 1.7}}}
    card = {"train": train, "data": {"source": "sharegpt", "splits": {"train": {"sequences": 90}}},
            "recipe": {"train": {"lr": 0.0003, "K": K}}}
    readme = (export_vllm(make_drafter(), tmp_path / "x", target_name="t", card=card) / "README.md").read_text()
    assert "- `steps`: 50" in readme and "- `method`: peagle" in readme
    assert '- `splits`: {"train": {"sequences": 90}}' in readme
    assert f"| 3 | 0.3 | 0.4 | {simulated_acceptance_lengths([0.7, 0.6, 0.5, 0.4])[3]:.4g} |" in readme
    assert "lr: 0.0003" in readme and "<summary>Resolved recipe</summary>" in readme


def test_metrics_files_are_strict_json_and_the_card_reads_nulls(tmp_path):
    """A conditional accuracy no chain reached is NaN in memory; the metrics file holds null (strict
    JSON), and the model card built from that file shows it as n/a."""
    train = {"method": "peagle", "K": K, "steps": 5,
             "final": {"eval_acc": [0.7, 0.0], "eval_cond_acc": [0.7, float("nan")], "x": (1.0, float("inf"))}}
    write_json_atomic(tmp_path / "m.json", train)
    text = (tmp_path / "m.json").read_text()
    assert "NaN" not in text and "Infinity" not in text
    loaded = json.loads(text, parse_constant=lambda c: pytest.fail(f"non-strict JSON constant {c}"))
    assert loaded["final"]["eval_cond_acc"] == [0.7, None] and loaded["final"]["x"] == [1.0, None]
    readme = (export_vllm(make_drafter(), tmp_path / "x", target_name="t", card={"train": loaded})
              / "README.md").read_text()
    assert "| 1 | 0 | n/a | n/a |" in readme


def test_hidden_size_mismatch_opt_in_recorded(exported):
    out = exported("h", hidden_size=16)
    cfg = json.loads((out / "config.json").read_text())
    assert cfg["hidden_size"] == 16 and cfg["target_hidden_size"] == T and cfg["allow_hidden_size_mismatch"]
    assert "H != T opt-in" in (out / "README.md").read_text()
    assert check_export(out) == []


# --------------------------------------------------------------------------- contract check


def _edit_config(out: Path, fn) -> None:
    cfg = json.loads((out / "config.json").read_text())
    fn(cfg)
    (out / "config.json").write_text(json.dumps(cfg))


def _edit_weights(out: Path, fn) -> None:
    t = load_file(str(out / "model.safetensors"))
    t = fn(t) or t
    save_file(t, str(out / "model.safetensors"))


def _pop(key):
    def drop(t):
        del t[key]

    return drop


BROKEN = {
    # name: (variant kwargs, config edit, weights edit, substring every run must report)
    "drop_norm": ({}, None, _pop("norm.weight"), "missing 'norm.weight'"),
    "drop_embed": ({}, None, _pop("embed_tokens.weight"), "missing 'embed_tokens.weight'"),
    "model_prefix": ({}, None, lambda t: {f"model.{k}": v for k, v in t.items()}, "start with 'model.'"),
    "no_mask_hidden": ({}, None, _pop("mask_hidden"), "missing 'mask_hidden'"),
    "layer0_width": ({}, None, lambda t: t.update({"layers.0.self_attn.k_proj.weight": torch.zeros(16, T)}),
                     "layer 0 is the fusion layer: q/k/v input width must be 2H = 64"),
    "fc_width": ({}, None, lambda t: t.update({"fc.weight": torch.zeros(T, 2 * T)}), "A*T = 3*32 = 96"),
    "mask_hidden_in_H_space": ({}, None, lambda t: t.update({"mask_hidden": torch.zeros(1, 1, T)}),
                               "pre-fc space"),
    "d2t_when_full_vocab": ({"Vd": V}, None, lambda t: t.update({"d2t": torch.zeros(V, dtype=torch.int64)}),
                            "'d2t' present although draft_vocab_size == vocab_size"),
    "no_d2t_when_pruned": ({}, None, _pop("d2t"), "missing 'd2t'"),
    "d2t_out_of_range": ({}, None, lambda t: t["d2t"].__setitem__(-1, 10_000), "outside [0, 128)"),
    "d2t_int32": ({}, None, lambda t: t.update({"d2t": t["d2t"].to(torch.int32)}), "expected int64"),
    "stray_tensor": ({}, None, lambda t: t.update({"extra_head.weight": torch.zeros(2, 2)}),
                     "unexpected key 'extra_head.weight'"),
    "rotary_buffer": ({}, None, lambda t: t.update({"rotary_emb.inv_freq": torch.zeros(4)}), "RoPE buffer"),
    "extra_layer": ({}, None, lambda t: t.update({"layers.2.input_layernorm.weight": torch.ones(T)}),
                    "unexpected key 'layers.2.input_layernorm.weight'"),
    "mixed_float_dtypes": ({}, None, lambda t: t.update({"norm.weight": t["norm.weight"].float()}),
                           "mix dtypes"),
    "nan_weight": ({}, None, lambda t: t["fc.weight"].__setitem__((0, 0), float("nan")), "NaN/Inf"),
    "no_ptd_token_id": ({}, lambda c: c.pop("ptd_token_id"), None, "'ptd_token_id' missing"),
    "null_pard_token": ({}, lambda c: c.update(pard_token=None), None, "'pard_token' is null"),
    "mask_token_disagrees": ({}, lambda c: c.update(mask_token_id=5), None, "top-level mask_token_id 5 disagrees"),
    "ptd_out_of_vocab": ({}, lambda c: c.update(ptd_token_id=V, pard_token=V), None, "outside the vocab"),
    "sliding_window": ({}, lambda c: c.update(sliding_window=128), None, "'sliding_window'"),
    "layer_types": ({}, lambda c: c.update(layer_types=["sliding_attention"] * 2), None, "'layer_types'"),
    "quantization_config": ({}, lambda c: c.update(quantization_config={"quant_method": "mxfp4"}), None,
                            "'quantization_config'"),
    "attention_bias": ({}, lambda c: c.update(attention_bias=True), None, "'attention_bias' is true"),
    "tied_embeddings": ({}, lambda c: c.update(tie_word_embeddings=True), None, "'tie_word_embeddings'"),
    "norm_before_residual": ({}, lambda c: c.update(norm_before_residual=True), None, "'norm_before_residual'"),
    "hidden_act": ({}, lambda c: c.update(hidden_act="gelu"), None, "'hidden_act' must be \"silu\""),
    "bad_architecture": ({}, lambda c: c.update(architectures=["PEagleDraftModel"]), None, "cannot map"),
    "aux_ids_not_in_eagle_config": ({}, lambda c: c.pop("eagle_config"), None, "'eagle_config' missing"),
    "aux_ids_disagree": ({}, lambda c: c["eagle_config"].update(eagle_aux_hidden_state_layer_ids=[1, 4]), None,
                         "must equal the top-level list"),
    "aux_ids_unsorted": ({}, lambda c: c.update(eagle_aux_hidden_state_layer_ids=[5, 1, 4]), None, "ascending"),
    "h_ne_t_without_opt_in": ({"hidden_size": 16}, lambda c: c.pop("allow_hidden_size_mismatch"), None,
                              "without the opt-in 'allow_hidden_size_mismatch: true'"),
    "no_trained_k": ({}, lambda c: c.pop("num_parallel_depths"), None, "'num_parallel_depths'"),
    "mrope": ({}, lambda c: c.update(rope_scaling={"rope_type": "default", "mrope_section": [2, 1, 1]}), None,
              "M-RoPE"),
    "eagle3_with_ptd": ({"parallel": False}, lambda c: c.update(ptd_token_id=MASK), None,
                        "must not carry parallel-drafting fields"),
    "missing_dimension": ({}, lambda c: c.pop("head_dim"), None, "'head_dim' must be a positive integer"),
}


@pytest.mark.parametrize("name", sorted(BROKEN))
def test_check_names_the_problem(exported, name):
    kw, edit_cfg, edit_w, expect = BROKEN[name]
    out = exported(name, **kw)
    assert check_export(out) == []
    if edit_cfg:
        _edit_config(out, edit_cfg)
    if edit_w:
        _edit_weights(out, edit_w)
    problems = check_export(out)
    assert any(expect in p for p in problems), problems
    with pytest.raises(ExportCheckError) as e:
        assert_export_ok(out)
    assert expect in str(e.value)


def test_check_accepts_optional_unused_hidden_norm_and_reports_missing_files(exported, tmp_path):
    out = exported()
    _edit_weights(out, lambda t: t.update({"layers.1.hidden_norm.weight": torch.ones(T, dtype=torch.bfloat16)}))
    assert check_export(out) == []  # vLLM creates hidden_norm in every layer; shipping it is harmless
    (out / "model.safetensors").unlink()
    assert any("no *.safetensors file" in p for p in check_export(out))
    (out / "config.json").unlink()
    assert any("config.json: missing" in p for p in check_export(out))
    assert check_export(tmp_path / "nowhere") == [f"{tmp_path / 'nowhere'}: not a directory"]


def test_speculators_check_requires_structure(tmp_path):
    out = export_speculators(make_drafter(), tmp_path / "s", target_name="tiny/target")
    _edit_config(out, lambda c: (c.pop("mask_token_id"), c["speculators_config"].pop("verifier")))
    problems = check_export(out)
    assert any("top-level 'mask_token_id'" in p for p in problems), problems
    assert any("verifier.name_or_path missing" in p for p in problems), problems
    _edit_config(out, lambda c: c["speculators_config"].update(verifier={"name_or_path": str(tmp_path)}))
    assert any("refuses local verifier paths" in p for p in check_export(out))


# --------------------------------------------------------------------------- atomic export


def test_existing_non_empty_dir_is_refused(tmp_path):
    out = tmp_path / "x"
    out.mkdir()
    (out / "keep.txt").write_text("user data")
    with pytest.raises(FileExistsError, match="not empty"):
        export_vllm(make_drafter(), out, target_name="t")
    assert sorted(os.listdir(out)) == ["keep.txt"]
    export_vllm(make_drafter(), out, target_name="t", overwrite=True)
    assert "keep.txt" not in os.listdir(out) and check_export(out) == []
    assert [p.name for p in tmp_path.iterdir()] == ["x"]


def test_empty_existing_dir_is_accepted(tmp_path):
    (tmp_path / "x").mkdir()
    assert check_export(export_vllm(make_drafter(), tmp_path / "x", target_name="t")) == []


def test_failed_check_leaves_nothing_behind(tmp_path):
    d = make_drafter()
    with torch.no_grad():
        d.mask_hidden[0, 0, 0] = float("nan")
    with pytest.raises(ExportCheckError, match="'mask_hidden' contains NaN"):
        export_vllm(d, tmp_path / "x", target_name="t")
    assert list(tmp_path.iterdir()) == []


def test_parallel_drafter_without_mask_token_is_refused(tmp_path):
    d = make_drafter()
    d.config.mask_token_id = None
    with pytest.raises(ExportError, match="needs config.mask_token_id"):
        export_vllm(d, tmp_path / "x", target_name="t")
    assert list(tmp_path.iterdir()) == []


# --------------------------------------------------------------------------- hub


FAKE_TOKEN = "hf_FAKEsecret1234567890"


class _Recorder:
    def __init__(self):
        self.calls = []


@pytest.fixture
def fake_hub(monkeypatch):
    import huggingface_hub

    rec = _Recorder()

    def create_repo(self, repo_id, **kw):
        rec.calls.append(("create_repo", self.token, repo_id, kw))
        return f"https://huggingface.co/{repo_id}"

    def upload_folder(self, **kw):
        rec.calls.append(("upload_folder", self.token, kw))
        return "commit"

    monkeypatch.setattr(huggingface_hub.HfApi, "create_repo", create_repo)
    monkeypatch.setattr(huggingface_hub.HfApi, "upload_folder", upload_folder)
    return rec


def test_hub_dry_run_lists_files_without_token(exported, monkeypatch, fake_hub, capsys):
    monkeypatch.delenv("HF_TOKEN", raising=False)
    out = exported()
    (out / ".cache").mkdir()
    (out / ".cache" / "junk").write_text("x")
    files = push_to_hub(out, "me/tiny-peagle", dry_run=True)
    assert files == ["README.md", "config.json", "model.safetensors"]
    printed = capsys.readouterr().out
    for f in files:
        size = (out / f).stat().st_size
        assert f in printed
        assert (f"{size} B" if size < 1024 else f"{size / 1024:.1f} KiB") in printed
    assert ".cache" not in printed
    assert fake_hub.calls == []


def test_hub_push_uses_private_repo_and_never_prints_token(exported, monkeypatch, fake_hub, capsys, caplog):
    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)
    out = exported()
    files = push_to_hub(out, "me/tiny-peagle")
    assert [c[0] for c in fake_hub.calls] == ["create_repo", "upload_folder"]
    _, tok, repo, kw = fake_hub.calls[0]
    assert tok == FAKE_TOKEN and repo == "me/tiny-peagle"
    assert kw["private"] is True and kw["repo_type"] == "model" and kw["exist_ok"] is True
    _, tok, kw = fake_hub.calls[1]
    assert tok == FAKE_TOKEN and kw["folder_path"] == str(out) and kw["repo_id"] == "me/tiny-peagle"
    assert sorted(kw["allow_patterns"]) == files == ["README.md", "config.json", "model.safetensors"]
    cap = capsys.readouterr()
    assert FAKE_TOKEN not in cap.out + cap.err + caplog.text
    assert "me/tiny-peagle" in cap.out


def test_hub_refuses_broken_export_and_missing_token(exported, monkeypatch, fake_hub):
    out = exported()
    monkeypatch.delenv("HF_TOKEN", raising=False)
    with pytest.raises(HubPushError, match="HF_TOKEN is not set"):
        push_to_hub(out, "me/x")
    monkeypatch.setenv("HF_TOKEN", FAKE_TOKEN)
    _edit_weights(out, _pop("norm.weight"))
    with pytest.raises(ExportCheckError, match="missing 'norm.weight'"):
        push_to_hub(out, "me/x")
    with pytest.raises(HubPushError, match="owner/name"):
        push_to_hub(out, "no-owner")
    assert fake_hub.calls == []


# --------------------------------------------------------------------------- drafter.embeddings: frozen


def _frozen_pair():
    """A trainable-embeddings drafter and a frozen-embeddings twin with the same weights."""
    d = make_drafter()
    cfg = make_drafter_config(target_config(), aux_layer_ids=AUX, draft_vocab_size=64, mask_token_id=MASK,
                              num_layers=2, K=K, embeddings="frozen")
    f = Drafter(cfg)
    f.load_state_dict(d.state_dict() | {"mask_embedding": d.embed_tokens.weight[MASK].detach().clone()})
    return d, f.eval()


def test_frozen_embeddings_train_only_the_mask_row():
    """drafter.embeddings: frozen: the table has no gradient and is not a trainable parameter; the mask row
    is the parameter ``mask_embedding`` (initialised to the table's row), used where the input is the mask
    token, so a fresh frozen drafter computes what the trainable one does; its gradient is the table
    gradient's mask row."""
    d, f = _frozen_pair()
    assert not f.embed_tokens.weight.requires_grad and f.mask_embedding.requires_grad
    assert {n for n, p in f.named_parameters() if p.requires_grad} == \
        {n for n, p in d.named_parameters() if p.requires_grad} - {"embed_tokens.weight"} | {"mask_embedding"}
    assert torch.equal(grid_logits(f), grid_logits(d))
    for m in (d, f):
        m.train()
        g = torch.Generator().manual_seed(0)
        N = 24
        input_ids = torch.randint(0, V - 2, (N,), generator=g)
        doc_ids = torch.tensor([0] * 14 + [1] * 10)
        loss_mask = torch.ones(N, dtype=torch.bool)
        grid = build_grid(input_ids, loss_mask, doc_ids, cod_sample(loss_mask, doc_ids, K, 0.8, 0.3, generator=g), MASK)
        aux = torch.randn(N, len(AUX) * T, generator=g)
        h, _ = m(grid.token_ids, m.grid_hidden(aux, grid.hidden_index), grid.position_ids,
                 make_attn_spec(GridMeta.of(grid), kind="sdpa"))
        m.logits(h).square().mean().backward()
    assert f.embed_tokens.weight.grad is None
    torch.testing.assert_close(f.mask_embedding.grad, d.embed_tokens.weight.grad[MASK], rtol=1e-5, atol=1e-7)
    assert f.mask_embedding.grad.abs().sum() > 0


def test_frozen_embeddings_export_ships_the_trained_mask_row(tmp_path):
    """The export of a frozen-embeddings drafter ships ``embed_tokens`` with the trained mask row in place
    (no ``mask_embedding`` key: vLLM's layout) and loads back to the same logits."""
    _, f = _frozen_pair()
    with torch.no_grad():
        f.mask_embedding.add_(0.5)  # "trained"
    out = export_vllm(f, tmp_path / "x", target_name="tiny/target", target_config=target_config(),
                      dtype=torch.float32)
    from safetensors.torch import load_file

    sd = load_file(str(out / "model.safetensors"))
    assert "mask_embedding" not in sd and "frozen_embeddings" not in json.loads((out / "config.json").read_text())
    assert torch.equal(sd["embed_tokens.weight"][MASK], f.mask_embedding.detach())
    assert torch.equal(sd["embed_tokens.weight"][:MASK], f.embed_tokens.weight[:MASK].detach())
    back = load_exported(out)
    assert torch.equal(grid_logits(back), grid_logits(f))


def test_frozen_embeddings_and_head_need_the_targets_width():
    for key in ("embeddings", "lm_head"):
        with pytest.raises(ValueError, match=f"{key}: frozen"):
            make_drafter_config(target_config(), aux_layer_ids=AUX, draft_vocab_size=64, mask_token_id=MASK,
                                hidden_size=2 * T, allow_hidden_size_mismatch=True, **{key: "frozen"})


def test_card_data_names_every_mixed_source_with_its_counts_and_no_local_folder():
    """``data.mix``: the card's training data names each source (a local file by its file name only) with the
    numbers of its own load report; strings of the report (paths) never reach the card."""
    meta = {"source": {"source": "sharegpt", "path": "/home/me/secret/sg.json", "kept": 10, "mix": [
        {"source": "jsonl", "path": "/home/me/secret/extra.jsonl", "kept": 5, "repeats_of_earlier_sources": 1,
         "train": 4, "eval": 0}]}, "splits": {"train": {"sequences": 13}}}
    card = data_summary(meta, "sharegpt", "/home/me/secret/sg.json", [("jsonl", "/home/me/secret/extra.jsonl")])
    assert card["mixed_with"] == {"1. jsonl: extra.jsonl (local file)": {
        "kept": 5, "repeats_of_earlier_sources": 1, "train": 4, "eval": 0}}
    assert "secret" not in json.dumps(card) and card["source"]["kept"] == 10
    assert "mixed_with" not in data_summary({"source": {"kept": 3}}, "jsonl", None)
