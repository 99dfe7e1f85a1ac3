"""Contract check of an exported drafter directory against what vLLM 0.33 loads (spec §5).

vLLM's ``Eagle3LlamaForCausalLM.load_weights``
(``vllm/model_executor/models/llama_eagle3.py``) raises on unexpected keys but
never reports *missing* ones: a checkpoint without ``norm.weight`` loads and
runs on uninitialised memory. So completeness, shapes, dtypes and the config
fields vLLM reads are verified here, before anything is served or pushed.

Everything expected is derived from ``config.json`` alone (no model code is
imported): with ``H`` hidden, ``T`` target hidden, ``A`` aux layers, ``V`` vocab,
``Vd`` draft vocab, ``nh``/``nkv`` heads, ``hd`` head dim, ``I`` MLP width and
``n`` layers, :func:`expected_weights` is the table of spec §5.

Both export formats are checked: a speculators-format ``config.json``
(``speculators_model_type``) is first flattened the way vLLM flattens it
(:func:`~peagle_train.export.check_speculators.flatten_speculators_config`), then held to the same rules.

With a target (``check_export(..., target=...)``, ``peagle-train check DIR --target TARGET``)
the export is also held against the target's own ``config.json``
(:func:`check_against_target`: aux layer ids inside the target, hidden size, vocab, bos/eos ids);
with a served K (``num_speculative_tokens``) a parallel-drafting export refuses K above the
trained K (``num_parallel_depths``), which vLLM never checks.

Public API: :func:`check_export` (list of problems, empty = ok),
:func:`assert_export_ok` (raises :class:`ExportCheckError`),
:func:`check_against_target`, :func:`read_target_config`, :func:`check_served_k`,
:func:`expected_weights`, :func:`vllm_architecture`.
"""
from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors import safe_open

from peagle_train.core.config import ConfigError
from peagle_train.core.dtypes import FLOAT_EXPORT_DTYPES, safetensors_name
from peagle_train.export.check_speculators import check_speculators, flatten_speculators_config
from peagle_train.export.contract import CONFIG_FILE, WEIGHTS_FILE, is_int, not_a_drafter_message

#: Target fields that must never reach a drafter config (spec §5): each changes
#: what vLLM builds (sliding-window layer 0, quantised weights, logit scaling...).
FORBIDDEN_CONFIG_FIELDS = ("layer_types", "sliding_window", "quantization_config", "logit_scale", "is_causal",
                           "qkv_bias")

#: Variants of ``llama_eagle3`` the drafter does not implement; vLLM reads them from
#: the config (``norm_before_fc``, ``fc_norm``, ``norm_output``) and would build extra modules.
UNSUPPORTED_TRUE_FIELDS = ("norm_before_fc", "fc_norm", "norm_output")

#: vLLM 0.33 registry names that resolve to ``llama_eagle3.Eagle3LlamaForCausalLM``
#: (``vllm/model_executor/models/registry.py``, ``_SPECULATIVE_DECODING_MODELS``).
VLLM_EAGLE3_LLAMA_NAMES = ("Eagle3LlamaForCausalLM", "LlamaForCausalLMEagle3")



class ExportCheckError(ValueError):
    """An export directory violates the vLLM contract; ``problems`` lists every violation."""

    def __init__(self, path: Path, problems: list[str]):
        self.path = Path(path)
        self.problems = list(problems)
        lines = "\n".join(f"  - {p}" for p in self.problems)
        super().__init__(f"export '{self.path}' fails the vLLM contract check (spec §5):\n{lines}")


def vllm_architecture(name: str) -> str:
    """The architecture vLLM 0.33 resolves for ``name`` under ``method: eagle3``.

    Mirrors ``EAGLEConfig.__init__`` (``vllm/transformers_utils/configs/eagle.py``):
    a name that starts or ends with ``Eagle3`` is kept, anything else gets the
    ``Eagle3`` prefix (``LlamaForCausalLM`` → ``Eagle3LlamaForCausalLM``).
    """
    return name if name.startswith("Eagle3") or name.endswith("Eagle3") else f"Eagle3{name}"


def _dims(cfg: dict, problems: list[str]) -> dict | None:
    """Integer dimensions from config.json, or None (with problems recorded) if any is missing/invalid."""
    need = ("hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads", "head_dim",
            "intermediate_size", "vocab_size", "draft_vocab_size", "target_hidden_size", "max_position_embeddings")
    ok = True
    for k in need:
        v = cfg.get(k)
        if not is_int(v) or v <= 0:
            problems.append(f"{CONFIG_FILE}: '{k}' must be a positive integer (got {v!r}); write the drafter's "
                            f"value (spec §5 lists it as required)")
            ok = False
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    if not isinstance(ids, list) or not ids or not all(is_int(i) for i in ids):
        problems.append(f"{CONFIG_FILE}: 'eagle_aux_hidden_state_layer_ids' must be a non-empty list of ints "
                        f"(got {ids!r}); write the target layers the drafter was trained on")
        ok = False
    if not ok:
        return None
    return dict(H=cfg["hidden_size"], n=cfg["num_hidden_layers"], nh=cfg["num_attention_heads"],
                nkv=cfg["num_key_value_heads"], hd=cfg["head_dim"], I=cfg["intermediate_size"],
                V=cfg["vocab_size"], Vd=cfg["draft_vocab_size"], T=cfg["target_hidden_size"], A=len(ids))


def is_parallel(cfg: dict) -> bool:
    """Whether config.json describes a P-EAGLE (parallel-drafting) drafter: ``parallel_drafting: true``."""
    return cfg.get("parallel_drafting") is True


WeightTable = dict[str, tuple[tuple[int, ...], str]]  # key -> (shape, kind: "float" | "int64" | "bool")


def expected_weights(cfg: dict) -> tuple[WeightTable, WeightTable]:
    """The tensors vLLM expects for ``cfg`` (spec §5 table).

    Args:
        cfg: the parsed ``config.json`` of an export.

    Returns:
        ``(required, optional)``: each maps key → ``(shape, kind)`` with kind
        ``"float"``, ``"int64"`` or ``"bool"``. ``required`` has ``fc``, every layer
        (layer 0 with q/k/v input width ``2H`` and ``hidden_norm``), ``norm``,
        ``lm_head [Vd, H]``, ``embed_tokens [V, H]``, ``d2t [Vd]`` iff ``Vd < V``,
        ``mask_hidden [1, 1, A*T]`` iff parallel drafting, and biases iff
        ``attention_bias`` / ``mlp_bias``. ``optional``: ``t2d [V]`` and the unused
        ``layers.i.hidden_norm.weight`` (i ≥ 1) that vLLM creates.

    Raises:
        ValueError: config.json lacks a dimension (see :func:`check_export` for the message).
    """
    problems: list[str] = []
    d = _dims(cfg, problems)
    if d is None:
        raise ValueError("; ".join(problems))
    H, T, A, nh, nkv, hd, I, V, Vd = d["H"], d["T"], d["A"], d["nh"], d["nkv"], d["hd"], d["I"], d["V"], d["Vd"]
    attn_bias, mlp_bias = cfg.get("attention_bias") is True, cfg.get("mlp_bias") is True
    req: WeightTable = {"fc.weight": ((H, A * T), "float")}
    opt: WeightTable = {"t2d": ((V,), "bool")}
    for i in range(d["n"]):
        p = f"layers.{i}."
        w_in = 2 * H if i == 0 else H
        for name, out in (("q_proj", nh * hd), ("k_proj", nkv * hd), ("v_proj", nkv * hd)):
            req[f"{p}self_attn.{name}.weight"] = ((out, w_in), "float")
            if attn_bias:
                req[f"{p}self_attn.{name}.bias"] = ((out,), "float")
        req[f"{p}self_attn.o_proj.weight"] = ((H, nh * hd), "float")
        if attn_bias:
            req[f"{p}self_attn.o_proj.bias"] = ((H,), "float")
        req[f"{p}input_layernorm.weight"] = ((H,), "float")
        req[f"{p}post_attention_layernorm.weight"] = ((H,), "float")
        (req if i == 0 else opt)[f"{p}hidden_norm.weight"] = ((H,), "float")
        for name, shape in (("gate_proj", (I, H)), ("up_proj", (I, H)), ("down_proj", (H, I))):
            req[f"{p}mlp.{name}.weight"] = (shape, "float")
            if mlp_bias:
                req[f"{p}mlp.{name}.bias"] = ((shape[0],), "float")
    req["norm.weight"] = ((H,), "float")
    req["lm_head.weight"] = ((Vd, H), "float")
    req["embed_tokens.weight"] = ((V, H), "float")
    if Vd < V:
        req["d2t"] = ((Vd,), "int64")
    if is_parallel(cfg):
        req["mask_hidden"] = ((1, 1, A * T), "float")
    return req, opt


def _check_config(cfg: dict, problems: list[str], tensor_keys: set[str]) -> None:
    P = problems.append
    f = CONFIG_FILE
    if cfg.get("model_type") != "llama":
        P(f"{f}: 'model_type' must be \"llama\" (got {cfg.get('model_type')!r}); vLLM wraps the drafter's own "
          f"Llama config in EAGLEConfig (spec §5)")
    arch = cfg.get("architectures")
    if not (isinstance(arch, list) and len(arch) == 1 and isinstance(arch[0], str)):
        P(f"{f}: 'architectures' must be a one-element list, expected [\"LlamaForCausalLMEagle3\"] (got {arch!r})")
    elif vllm_architecture(arch[0]) not in VLLM_EAGLE3_LLAMA_NAMES:
        P(f"{f}: architecture {arch[0]!r} resolves to {vllm_architecture(arch[0])!r} under method eagle3, which "
          f"vLLM 0.33 cannot map to Eagle3LlamaForCausalLM; write [\"LlamaForCausalLMEagle3\"] (spec §5)")
    if cfg.get("hidden_act") != "silu":
        P(f"{f}: 'hidden_act' must be \"silu\" (got {cfg.get('hidden_act')!r}); the drafter MLP is SwiGLU")
    eps = cfg.get("rms_norm_eps")
    if not isinstance(eps, (int, float)) or isinstance(eps, bool) or not eps > 0:
        P(f"{f}: 'rms_norm_eps' must be a positive number (got {eps!r})")
    if cfg.get("tie_word_embeddings") is not False:
        P(f"{f}: 'tie_word_embeddings' must be false (got {cfg.get('tie_word_embeddings')!r}); the drafter ships "
          f"its own lm_head [Vd, H]")
    if cfg.get("norm_before_residual") is not False:
        P(f"{f}: 'norm_before_residual' must be written as false (got {cfg.get('norm_before_residual')!r}); the "
          f"drafter's residual is fc(h), not hidden_norm(fc(h)) (spec §2), and speculators-format loaders default "
          f"it to true for eagle3")
    for k in UNSUPPORTED_TRUE_FIELDS:
        if cfg.get(k):
            P(f"{f}: '{k}' is {cfg[k]!r}; this drafter has no such norm, so vLLM would build and run an "
              f"uninitialised one. Remove the key or set it false")
    for k in FORBIDDEN_CONFIG_FIELDS:
        if k in cfg:
            P(f"{f}: target field '{k}' (= {cfg[k]!r}) must not be copied into the drafter config (spec §5: e.g. "
              f"sliding_window makes drafter layer 0 sliding-window, quantization_config quantises the drafter); "
              f"remove it")
    for k in ("attention_bias", "mlp_bias"):
        if k in cfg and not isinstance(cfg[k], bool):
            P(f"{f}: '{k}' must be a boolean (got {cfg[k]!r})")
    for k, where in (("attention_bias", ".self_attn."), ("mlp_bias", ".mlp.")):
        if cfg.get(k) is True and not any(t.endswith(".bias") and where in t for t in tensor_keys):
            P(f"{f}: '{k}' is true but the checkpoint has no such biases; vLLM would build them (for attention: "
              f"q/k/v AND o_proj) and leave them uninitialised. Never copy the target's value (GPT-OSS has "
              f"attention_bias: true, spec §5); set it false")
    # aux layers: top level and eagle_config (fc width comes from eagle_config, never the top-level list)
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    if isinstance(ids, list) and all(is_int(i) for i in ids):
        if ids != sorted(set(ids)) or (ids and ids[0] < 0):
            P(f"{f}: 'eagle_aux_hidden_state_layer_ids' {ids} must be distinct, ascending and >= 0: vLLM sorts and "
              f"de-duplicates them, so any other order feeds the drafter differently than in training")
    ec = cfg.get("eagle_config")
    if not isinstance(ec, dict):
        P(f"{f}: 'eagle_config' missing; write {{\"use_aux_hidden_state\": true, "
          f"\"eagle_aux_hidden_state_layer_ids\": {ids}}} (vLLM sizes fc from eagle_config, spec §5)")
    else:
        if ec.get("use_aux_hidden_state") is not True:
            P(f"{f}: eagle_config.use_aux_hidden_state must be true (got {ec.get('use_aux_hidden_state')!r}); "
              f"otherwise vLLM drops fc and ignores the aux states")
        if ec.get("eagle_aux_hidden_state_layer_ids") != ids:
            P(f"{f}: eagle_config.eagle_aux_hidden_state_layer_ids = {ec.get('eagle_aux_hidden_state_layer_ids')!r} "
              f"must equal the top-level list {ids!r}; vLLM takes the number of aux states (fc input width) from "
              f"eagle_config")
        for k in ("norm_before_fc",):
            if ec.get(k):
                P(f"{f}: eagle_config.{k} is true; this drafter has no such norm. Remove it")
    nas = cfg.get("num_aux_hidden_states")
    if nas is not None and isinstance(ids, list) and nas != len(ids):
        P(f"{f}: 'num_aux_hidden_states' = {nas!r} disagrees with {len(ids)} aux layer ids; vLLM sizes fc from it. "
          f"Remove it or make it {len(ids)}")
    H, T = cfg.get("hidden_size"), cfg.get("target_hidden_size")
    if is_int(H) and is_int(T) and H != T and cfg.get("allow_hidden_size_mismatch") is not True:
        P(f"{f}: hidden_size {H} != target_hidden_size {T} without the opt-in 'allow_hidden_size_mismatch: true' "
          f"(spec §5 decision: needs vLLM >= 0.33 and shipped embed_tokens); retrain with H == T or export with "
          f"drafter.allow_hidden_size_mismatch")
    V, Vd = cfg.get("vocab_size"), cfg.get("draft_vocab_size")
    if is_int(V) and is_int(Vd) and Vd > V:
        P(f"{f}: draft_vocab_size {Vd} exceeds vocab_size {V}")
    nh, nkv = cfg.get("num_attention_heads"), cfg.get("num_key_value_heads")
    if is_int(nh) and is_int(nkv) and nkv > 0 and nh % nkv:
        P(f"{f}: num_attention_heads {nh} is not a multiple of num_key_value_heads {nkv}")
    # rope: M-RoPE drafters are rejected by the V1 proposer (_raise_if_mrope)
    for k in ("rope_scaling", "rope_parameters"):
        r = cfg.get(k)
        if isinstance(r, dict) and ("mrope_section" in r or r.get("rope_type") == "mrope" or r.get("type") == "mrope"):
            P(f"{f}: '{k}' describes M-RoPE ({r}); vLLM rejects M-RoPE drafters for parallel drafting (spec §5)")
    rp = cfg.get("rope_parameters")
    if isinstance(rp, dict) and "rope_theta" in cfg and rp.get("rope_theta") not in (None, cfg["rope_theta"]):
        P(f"{f}: rope_theta {cfg['rope_theta']} disagrees with rope_parameters.rope_theta {rp.get('rope_theta')}")
    # parallel drafting fields (vllm/v1/spec_decode/llm_base_proposer.py _init_parallel_drafting_params)
    if "parallel_drafting" in cfg and not isinstance(cfg["parallel_drafting"], bool):
        P(f"{f}: 'parallel_drafting' must be a boolean (got {cfg['parallel_drafting']!r})")
    top_mask = cfg.get("mask_token_id")
    if is_parallel(cfg):
        vals = {}
        for k in ("ptd_token_id", "pard_token"):
            v = cfg.get(k)
            if k not in cfg or v is None:
                P(f"{f}: '{k}' {'missing' if k not in cfg else 'is null'}; a P-EAGLE export needs ptd_token_id AND "
                  f"pard_token = mask_token_id (vLLM looks them up with hasattr, spec §5)")
            elif not is_int(v):
                P(f"{f}: '{k}' must be an integer token id (got {v!r})")
            else:
                vals[k] = v
                if is_int(V) and not 0 <= v < V:
                    P(f"{f}: '{k}' = {v} is outside the vocab [0, {V}); the mask token must be an id of the "
                      f"target tokenizer (embed_tokens row)")
        if len(vals) == 2 and vals["ptd_token_id"] != vals["pard_token"]:
            P(f"{f}: ptd_token_id {vals['ptd_token_id']} != pard_token {vals['pard_token']}; both must be the "
              f"trained mask_token_id")
        if top_mask is not None and any(top_mask != v for v in vals.values()):
            P(f"{f}: top-level mask_token_id {top_mask!r} disagrees with ptd_token_id/pard_token {vals}; vLLM "
              f"prefers mask_token_id, so the drafter would get the wrong mask token. Remove it or make it equal")
        K = cfg.get("num_parallel_depths")
        if not is_int(K) or K < 1:
            P(f"{f}: 'num_parallel_depths' (the trained K = max servable num_speculative_tokens) must be an "
              f"integer >= 1 (got {K!r}); vLLM never checks K, so the export must record it")
    else:
        stray = [k for k in ("ptd_token_id", "pard_token") if k in cfg]
        if top_mask is not None:
            stray.append("mask_token_id")
        if stray:
            P(f"{f}: {stray} present but 'parallel_drafting' is not true; an EAGLE-3 export must not carry "
              f"parallel-drafting fields (set parallel_drafting: true for a P-EAGLE drafter, else remove them)")


def _read_config(d: Path, problems: list[str]) -> dict | None:
    p = d / CONFIG_FILE
    if not p.is_file():
        problems.append(f"{p}: missing; export with peagle_train.export.writer.export_vllm")
        return None
    try:
        cfg = json.loads(p.read_text())
    except (OSError, json.JSONDecodeError) as e:
        problems.append(f"{p}: not valid JSON ({e})")
        return None
    if not isinstance(cfg, dict):
        problems.append(f"{p}: top level must be a JSON object")
        return None
    return cfg


def _read_tensor_index(d: Path, problems: list[str]) -> dict[str, tuple[tuple[int, ...], str, Path]] | None:
    """``key -> (shape, safetensors dtype string, file)`` over every ``*.safetensors`` file (vLLM loads them all)."""
    files = sorted(d.glob("*.safetensors"))
    if not files:
        problems.append(f"{d / WEIGHTS_FILE}: missing; no *.safetensors file in the export")
        return None
    out: dict[str, tuple[tuple[int, ...], str, Path]] = {}
    for fp in files:
        try:
            with safe_open(str(fp), framework="pt") as fh:
                for k in fh.keys():
                    sl = fh.get_slice(k)
                    if k in out:
                        problems.append(f"{fp.name}: key '{k}' also in {out[k][2].name}; ship each tensor once")
                    out[k] = (tuple(sl.get_shape()), sl.get_dtype(), fp)
        except Exception as e:  # noqa: BLE001 - any unreadable file is a problem to report, not a crash
            problems.append(f"{fp}: unreadable safetensors file ({type(e).__name__}: {e})")
    return out


def _load(fp: Path, key: str) -> torch.Tensor:
    with safe_open(str(fp), framework="pt") as fh:
        return fh.get_tensor(key)


def _check_weights(cfg: dict, tensors: dict, problems: list[str], check_values: bool) -> None:
    P = problems.append
    d = _dims(cfg, [])
    H, T, A, V, Vd = d["H"], d["T"], d["A"], d["V"], d["Vd"]
    req, opt = expected_weights(cfg)
    prefixed = sorted(k for k in tensors if k.startswith("model."))
    if prefixed:
        P(f"{WEIGHTS_FILE}: {len(prefixed)} key(s) start with 'model.' (e.g. {prefixed[:3]}); vLLM prepends "
          f"'model.' itself and raises on 'model.model.*'. Strip the prefix")
    float_dtypes = {}
    for key, (shape, kind) in req.items():
        if key not in tensors:
            why = {
                "norm.weight": "vLLM does not report missing weights and would run on an uninitialised norm",
                "embed_tokens.weight": "without it vLLM silently uses the target's embeddings, whose mask row "
                                       "was never trained (spec §5)",
                "lm_head.weight": "without it vLLM uses the target's head when Vd == V and crashes when Vd < V",
                "d2t": f"draft_vocab_size {Vd} < vocab_size {V}: without d2t vLLM keeps zeros and maps draft ids to "
                       f"the wrong target ids, silently",
                "mask_hidden": "parallel_drafting is true and vLLM raises 'mask_hidden not found in weights'",
            }.get(key, "vLLM does not report missing weights; it would run on uninitialised values")
            if f"model.{key}" in tensors:
                continue  # reported as a prefix problem above
            if key.endswith(".bias") and not any(t.endswith(".bias") for t in tensors):
                continue  # reported once as a config problem (attention_bias / mlp_bias true)
            P(f"{WEIGHTS_FILE}: missing '{key}' (expected shape {list(shape)}, {kind}); {why}. Re-export the "
              f"full drafter state_dict")
            continue
        got_shape, got_dtype, _ = tensors[key]
        if got_shape != shape:
            hint = ""
            if key.startswith("layers.0.self_attn.") and key.endswith("_proj.weight") and "o_proj" not in key:
                hint = (f" (layer 0 is the fusion layer: q/k/v input width must be 2H = {2 * H}, "
                        f"cat(input_layernorm(emb), hidden_norm(fc(h))), spec §2)")
            elif key == "fc.weight":
                hint = f" (fc maps A*T = {A}*{T} = {A * T} concatenated aux states to H = {H})"
            elif key == "mask_hidden":
                hint = f" (mask_hidden lives in the pre-fc space: [1, 1, A*T] = [1, 1, {A * T}], vLLM >= 0.33)"
            P(f"{WEIGHTS_FILE}: '{key}' has shape {list(got_shape)}, expected {list(shape)}{hint}; the tensor "
              f"does not match config.json")
        if kind == "float":
            if got_dtype not in FLOAT_EXPORT_DTYPES:
                P(f"{WEIGHTS_FILE}: '{key}' has dtype {safetensors_name(got_dtype)}, expected a "
                  f"floating type (bfloat16 for serving)")
            else:
                float_dtypes.setdefault(got_dtype, []).append(key)
        elif kind == "int64" and got_dtype != "I64":
            P(f"{WEIGHTS_FILE}: '{key}' has dtype {safetensors_name(got_dtype)}, expected int64 "
              f"(vLLM's draft_id_to_target_id is torch.long)")
    if len(float_dtypes) > 1:
        summary = {safetensors_name(k): len(v) for k, v in float_dtypes.items()}
        P(f"{WEIGHTS_FILE}: floating tensors mix dtypes {summary}; export every float in one dtype (bfloat16)")
    for key, (shape, _kind) in opt.items():
        if key != "t2d" and key in tensors and tensors[key][0] != shape:
            P(f"{WEIGHTS_FILE}: '{key}' has shape {list(tensors[key][0])}, expected {list(shape)}")
    if "t2d" in tensors:
        got_shape, got_dtype, _ = tensors["t2d"]
        if got_shape != (V,) or got_dtype != "BOOL":
            P(f"{WEIGHTS_FILE}: 't2d' is {list(got_shape)} {safetensors_name(got_dtype)}, expected "
              f"[{V}] bool")
    # what vLLM would reject or silently drop
    for key in sorted(set(tensors) - set(req) - set(opt)):
        if key.startswith("model."):
            continue
        if key == "d2t" and Vd == V:
            P(f"{WEIGHTS_FILE}: 'd2t' present although draft_vocab_size == vocab_size == {V}; vLLM 0.33 then has "
              f"no draft_id_to_target_id parameter and the load fails. Omit d2t when Vd == V (spec §5)")
        elif key == "mask_hidden":
            P(f"{WEIGHTS_FILE}: 'mask_hidden' present but config.json has no 'parallel_drafting: true'; the export "
              f"is inconsistent (P-EAGLE weights with an EAGLE-3 config). Fix the config or drop mask_hidden")
        elif key.endswith(".bias"):
            P(f"{WEIGHTS_FILE}: '{key}' is a bias but config.json disables it (attention_bias/mlp_bias false); vLLM "
              f"drops it silently, so the served drafter differs from the trained one")
        elif "rotary_emb" in key or "inv_freq" in key:
            P(f"{WEIGHTS_FILE}: '{key}' is a RoPE buffer; vLLM computes RoPE itself and raises on the unexpected "
              f"key. Do not export rotary buffers")
        else:
            P(f"{WEIGHTS_FILE}: unexpected key '{key}' {list(tensors[key][0])}; vLLM's load_weights raises on "
              f"unknown keys (only '.bias', t2d and mask_hidden are tolerated). Remove it")
    # d2t mapping must stay inside the target vocab and be strictly increasing (spec §2)
    if "d2t" in tensors and "d2t" in req and tensors["d2t"][0] == (Vd,):
        d2t = _load(tensors["d2t"][2], "d2t").to(torch.int64)
        tgt = d2t + torch.arange(Vd)
        bad = ((tgt < 0) | (tgt >= V)).nonzero().flatten()
        if bad.numel():
            i = int(bad[0])
            P(f"{WEIGHTS_FILE}: d2t maps draft id {i} to target id {int(tgt[i])}, outside [0, {V}) "
              f"({bad.numel()} such ids); d2t[i] must be draft_ids[i] - i")
        elif Vd > 1 and bool((tgt[1:] <= tgt[:-1]).any()):
            P(f"{WEIGHTS_FILE}: d2t does not map draft ids to strictly increasing target ids; the draft vocab must "
              f"be sorted by target id (spec §2)")
        elif "t2d" in tensors and tensors["t2d"][0] == (V,) and tensors["t2d"][1] == "BOOL":
            t2d = _load(tensors["t2d"][2], "t2d")
            if int(t2d.sum()) != Vd or not bool(t2d[tgt].all()):
                P(f"{WEIGHTS_FILE}: t2d disagrees with d2t (t2d marks {int(t2d.sum())} ids, d2t maps {Vd}); "
                  f"re-export both from the same draft vocab")
    if check_values:
        for key, (shape, dt, fp) in sorted(tensors.items()):
            if dt in FLOAT_EXPORT_DTYPES and (key in req or key in opt):
                t = _load(fp, key)
                if not bool(torch.isfinite(t).all()):
                    P(f"{WEIGHTS_FILE}: '{key}' contains NaN/Inf; the trained weights are broken (check the "
                      f"training run)")


def read_target_config(target: str | Path) -> dict:
    """The target's ``config.json`` as a dict, read alone (no weights, no model code).

    Args:
        target: a local Hugging Face model directory (holding ``config.json``) or the path of
            a ``config.json`` file.

    Raises:
        FileNotFoundError: neither a directory with ``config.json`` nor a file.
        ConfigError: the file is not a JSON object (the CLI maps both to exit 2).
    """
    p = Path(target)
    f = p / CONFIG_FILE if p.is_dir() else p
    if not f.is_file():
        raise FileNotFoundError(f"target '{target}': no {CONFIG_FILE} there; pass a local Hugging Face model "
                                f"directory or the path of its {CONFIG_FILE}")
    try:
        cfg = json.loads(f.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ConfigError(f"target config '{f}' is not readable JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ConfigError(f"target config '{f}': the top level must be a JSON object")
    return cfg


def _target_field(target_cfg: dict, key: str):
    """``target_cfg[key]``, or the same field of its ``text_config`` (multimodal targets nest the LM there)."""
    if target_cfg.get(key) is not None:
        return target_cfg[key]
    text = target_cfg.get("text_config")
    return text.get(key) if isinstance(text, dict) else None


def check_against_target(cfg: dict, target_cfg: dict) -> list[str]:
    """What the export's (flat, vLLM-layout) ``config.json`` must share with its target's config.

    Checks every aux layer id ``< num_hidden_layers`` of the target (vLLM taps the input residual
    of those target layers), ``target_hidden_size == hidden_size``, ``vocab_size`` equal, and the
    ``bos_token_id`` / ``eos_token_id`` the export records equal to the target's. A field the
    target config lacks is not checked.

    Args:
        cfg: the export's config (a speculators-format one flattened first).
        target_cfg: the target's ``config.json`` dict (:func:`read_target_config`, or
            ``PretrainedConfig.to_dict()``).

    Returns:
        Problems naming the field and both values; empty when they agree.
    """
    problems: list[str] = []
    P = problems.append
    f = CONFIG_FILE
    L = _target_field(target_cfg, "num_hidden_layers")
    ids = cfg.get("eagle_aux_hidden_state_layer_ids")
    if is_int(L) and isinstance(ids, list):
        bad = [i for i in ids if is_int(i) and not 0 <= i < L]
        if bad:
            P(f"{f}: eagle_aux_hidden_state_layer_ids {ids} has {bad} outside the target's num_hidden_layers = "
              f"{L} (valid ids 0..{L - 1}); the drafter was trained on another target. Export the drafter "
              f"trained for this target")
    for ours, theirs in (("target_hidden_size", "hidden_size"), ("vocab_size", "vocab_size")):
        a, b = cfg.get(ours), _target_field(target_cfg, theirs)
        if a is not None and b is not None and a != b:
            P(f"{f}: {ours}={a!r} but the target config has {b!r} ({theirs}); the drafter was built for "
              f"another target (spec §5: these must equal the target's)")
    for k in ("bos_token_id", "eos_token_id"):
        a, b = cfg.get(k), _target_field(target_cfg, k)
        if a is not None and b is not None and a != b:
            P(f"{f}: {k}={a!r} but the target config has {b!r} ({k}); re-export with the target's config")
    return problems


def check_served_k(cfg: dict, num_speculative_tokens: int) -> list[str]:
    """Problems of serving this export with ``num_speculative_tokens`` (the served K).

    A parallel-drafting (P-EAGLE) export predicts depths ``0..K-1`` of the trained K
    (``num_parallel_depths``); vLLM never compares the served K with it, so a larger K drafts
    depths the model never learned. An EAGLE-3 export drafts autoregressively: any K >= 1.
    """
    f = CONFIG_FILE
    k = num_speculative_tokens
    if not is_int(k) or k < 1:
        return [f"num_speculative_tokens must be an integer >= 1 (got {k!r})"]
    trained = cfg.get("num_parallel_depths")
    if is_parallel(cfg) and is_int(trained) and k > trained:
        return [f"{f}: num_speculative_tokens = {k} exceeds the trained K (num_parallel_depths) = {trained} of "
                f"this parallel-drafting export; vLLM does not check it and would draft depths the model never "
                f"learned. Serve with num_speculative_tokens <= {trained}"]
    return []


def check_export(path: str | Path, *, check_values: bool = True, target: str | Path | dict | None = None,
                 num_speculative_tokens: int | None = None) -> list[str]:
    """Check an export directory against the vLLM 0.33 contract (spec §5).

    Verifies ``config.json`` (model_type, architectures vLLM can map, drafter
    Llama fields, ``norm_before_residual: false``, aux ids at top level and in
    ``eagle_config``, ``ptd_token_id``/``pard_token`` for P-EAGLE, H vs T opt-in,
    no forbidden target fields, no biases, no M-RoPE) and every ``*.safetensors``
    file (every key of :func:`expected_weights` present with its shape and dtype,
    one float dtype, no ``model.`` prefix, no unexpected key, ``d2t`` present iff
    ``Vd < V`` and mapping into ``[0, V)`` strictly increasing, ``t2d``
    consistent, finite values if ``check_values``).

    Args:
        path: the export directory.
        check_values: also load every float tensor and check it is finite.
        target: the target the export is served with: a local model directory, a
            ``config.json`` path (:func:`read_target_config`) or the config dict itself;
            adds :func:`check_against_target`.
        num_speculative_tokens: the K it will be served with; adds :func:`check_served_k`.

    Returns:
        Problems, one sentence each naming the file/key, what was expected, what
        was found and what to do. Empty when the export is loadable as trained. A folder
        whose ``config.json`` has none of the drafter fields (a target model, say) gives one
        problem saying so.

    Raises:
        FileNotFoundError, ConfigError: ``target`` cannot be read (:func:`read_target_config`).
    """
    d = Path(path)
    target_cfg = read_target_config(target) if isinstance(target, (str, Path)) else target
    problems: list[str] = []
    if not d.is_dir():
        return [f"{d}: not a directory"]
    cfg = _read_config(d, problems)
    if cfg is None:
        return problems
    if "speculators_model_type" not in cfg and (msg := not_a_drafter_message(d, cfg)):
        return [msg]
    if "speculators_model_type" in cfg:
        n_before = len(problems)

        check_speculators(cfg, problems)
        if len(problems) > n_before and cfg.get("speculators_model_type") not in ("peagle", "eagle3"):
            return problems
        cfg = flatten_speculators_config(cfg)
    tensors = _read_tensor_index(d, problems)
    _check_config(cfg, problems, set(tensors or ()))
    if target_cfg is not None:
        problems += check_against_target(cfg, target_cfg)
    if num_speculative_tokens is not None:
        problems += check_served_k(cfg, num_speculative_tokens)
    if _dims(cfg, problems) is None or tensors is None:
        return problems
    _check_weights(cfg, tensors, problems, check_values)
    return problems


def assert_export_ok(path: str | Path, *, check_values: bool = True, target: str | Path | dict | None = None) -> None:
    """Raise :class:`ExportCheckError` listing every problem :func:`check_export` finds (``target`` as there).

    Raises:
        ExportCheckError: the export would not load in vLLM, or would load wrong.
    """
    problems = check_export(path, check_values=check_values, target=target)
    if problems:
        raise ExportCheckError(Path(path), problems)


__all__ = ["CONFIG_FILE", "WEIGHTS_FILE", "FORBIDDEN_CONFIG_FIELDS", "VLLM_EAGLE3_LLAMA_NAMES", "ExportCheckError",
           "WeightTable", "assert_export_ok", "check_against_target", "check_export", "check_served_k",
           "expected_weights", "read_target_config",
           "is_parallel", "vllm_architecture"]
