"""A whole recipe: typed, validated experiment configuration (sections in :mod:`peagle_train.core.config`).

A recipe is a YAML file whose top-level sections map one-to-one onto the models
below. ``load_config(path, overrides)`` is the single place where defaults,
YAML values and dotted command-line overrides (``train.lr=3e-4``) are merged;
every default lives in exactly one field below.

Errors: :class:`ConfigError` (a ``ValueError``) naming the recipe file and the
dotted key for unknown or misspelled keys, wrong types, and impossible
combinations. Checks that need the target (the drafter's shape against the target's
config: vocab size, layer count, hidden size, heads; the mask token present in the data) are in
:func:`validate_against_target` and :func:`validate_mask_token_absent`, run before any heavy work.

Draft-method rules: ``train.method`` must name a registered method
(:func:`peagle_train.methods.get_method`), and the method's own
:meth:`~peagle_train.methods.base.DraftMethod.validate_recipe` runs here, so an impossible
combination fails at load time whichever method it concerns.
"""
from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, Field, ValidationError, model_validator

from data_prep.config import DataConfig, RegenConfig, Section
from peagle_train.core.config import ConfigError, DrafterConfig, EvalConfig, ExportConfig, TargetConfig, TrainConfig
from peagle_train.methods import get_method


class RunConfig(Section):
    """A whole experiment: the sections of one recipe."""

    output_dir: str = "checkpoints/run"
    target: TargetConfig
    data: DataConfig = DataConfig()
    regen: RegenConfig = RegenConfig()
    drafter: DrafterConfig = DrafterConfig()
    train: TrainConfig = TrainConfig()
    export: ExportConfig = ExportConfig()
    eval: EvalConfig = EvalConfig()
    source_file: str | None = Field(None, description="Recipe path this config came from (set by the loader).")

    @model_validator(mode="after")
    def _cross(self) -> "RunConfig":
        if "heldout" in self.eval.datasets and self.train.eval_sequences < self.eval.num_prompts:
            raise ValueError(
                f"eval.datasets has 'heldout' with eval.num_prompts={self.eval.num_prompts} but train.eval_sequences="
                f"{self.train.eval_sequences}: the training log's eval_walk_al_heldout would cover fewer prompts than "
                "the eval stage measures; raise train.eval_sequences or lower eval.num_prompts")
        if self.train.eval_walk_sets and self.train.features != "online":
            raise ValueError(
                f"train.eval_walk_sets={list(self.train.eval_walk_sets)} needs train.features: online (the target "
                "answers the sets' prompts inside the trainer; a feature cache holds no features for them); "
                "set train.features=online or train.eval_walk_sets=[]")
        get_method(self.train.method).validate_recipe(self)  # ValueError: unknown method, or a rule of the method
        return self


def _set_dotted(tree: dict, key: str, value: Any, source: str) -> None:
    parts = key.split(".")
    node = tree
    for p in parts[:-1]:
        if p not in node or node[p] is None:
            node[p] = {}
        if not isinstance(node[p], dict):
            raise ConfigError(f"{source}: override '{key}': '{p}' is not a section")
        node = node[p]
    node[parts[-1]] = value


def parse_overrides(overrides: list[str] | None) -> list[tuple[str, Any]]:
    """Parse ``["train.lr=3e-4", ...]`` into ``[(key, value)]`` with YAML-typed values.

    Raises:
        ConfigError: for an item without ``=``.
    """
    out = []
    for item in overrides or []:
        if "=" not in item:
            raise ConfigError(f"override '{item}' must look like section.key=value")
        k, v = item.split("=", 1)
        out.append((k.strip(), yaml.safe_load(v)))
    return out


def load_config(path: str | Path, overrides: list[str] | None = None) -> RunConfig:
    """Load a YAML recipe, apply dotted overrides, validate.

    Args:
        path: recipe YAML file.
        overrides: ``["section.key=value", ...]``; values are parsed as YAML scalars.

    Returns:
        RunConfig with ``source_file`` set.

    Raises:
        ConfigError: file missing/unreadable, unknown key, wrong type or impossible
            combination; the message names the file and the dotted key.
    """
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"recipe '{path}' not found")
    try:
        raw = yaml.safe_load(path.read_text()) or {}
    except yaml.YAMLError as e:
        raise ConfigError(f"{path}: not valid YAML: {e}") from e
    if not isinstance(raw, dict):
        raise ConfigError(f"{path}: top level must be a mapping of sections")
    tree = copy.deepcopy(raw)
    given = {}
    for k, v in parse_overrides(overrides):
        _set_dotted(tree, k, v, str(path))
        given[k] = v
    tree["source_file"] = str(path)
    return config_from_dict(tree, str(path), overridden=given)


def _field_names(loc: tuple) -> list[str]:
    """Valid keys of the section at ``loc`` (``()`` = the top level)."""
    model = RunConfig
    for part in loc:
        field = model.model_fields.get(str(part))
        ann = getattr(field, "annotation", None)
        if not (isinstance(ann, type) and issubclass(ann, BaseModel)):
            return []
        model = ann
    return list(model.model_fields)


def config_from_dict(tree: dict, source: str = "<dict>", overridden: dict | None = None) -> RunConfig:
    """Validate a nested dict as a :class:`RunConfig`; errors name ``source`` and keys.

    ``overridden``: dotted keys set on the command line (``{key: value}``); their errors say so.
    An unknown key gets the closest valid key of its section as a suggestion.
    """
    import difflib

    overridden = overridden or {}
    try:
        return RunConfig.model_validate(tree)
    except ValidationError as e:
        lines = []
        for err in e.errors():
            key = ".".join(str(p) for p in err["loc"]) or "<root>"
            msg = err["msg"]
            if err["type"] == "extra_forbidden":
                close = difflib.get_close_matches(str(err["loc"][-1]), _field_names(err["loc"][:-1]), n=1)
                msg = "unknown key (misspelled?" + (f" did you mean '{close[0]}'?)" if close else ")")
            # a union / list field reports under a longer location (train.compile.bool, eval.datasets.0)
            given = next((k for k in overridden if key == k or key.startswith(k + ".")), None)
            if given is not None:
                msg += f" [from the command line: {given}={overridden[given]}]"
            lines.append(f"  {key}: {msg}")
        raise ConfigError(f"{source}: invalid recipe\n" + "\n".join(lines)) from None


def dump_config(cfg: RunConfig, path: str | Path) -> None:
    """Write the resolved config as YAML (saved next to every checkpoint), atomically: a reader
    (another regeneration worker, a resumed run) sees the old file or the whole new one."""
    from peagle_train.core.atomic import write_text_atomic

    write_text_atomic(path, yaml.safe_dump(cfg.model_dump(mode="json"), sort_keys=False))


def validate_against_target(cfg: RunConfig, target_config) -> None:
    """Every check that needs the target's shape, run before any heavy work (``prepare`` runs it
    on the target's config alone, before loading weights, data or tokenizer).

    It covers all that the target decides about the drafter and that would otherwise fail only
    in ``train`` or ``export``: the drafter's shape is resolved exactly as training builds it
    (:func:`~peagle_train.model.drafter.make_drafter_config`: ``None`` fields copied from the
    target) and checked.

    Args:
        target_config: the target's transformers config (``vocab_size``, ``num_hidden_layers``,
            ``hidden_size``, ``num_attention_heads``, ``num_key_value_heads``, ``head_dim``, ...).

    Raises:
        ConfigError: naming the recipe file, the key and the fix: mask token missing or outside
            ``[0, vocab_size)``; draft vocab larger than the vocab; an aux layer id outside
            ``[1, num_layers)``, or colliding default aux layers; ``drafter.hidden_size`` unlike
            the target's without ``drafter.allow_hidden_size_mismatch``; a hidden size that is not a
            multiple of the query heads, or query heads not a multiple of the key/value heads; an
            odd head dim; anything else the drafter's ``LlamaConfig`` refuses.
    """
    from peagle_train.features.target import default_aux_layer_ids
    from peagle_train.model.drafter import make_drafter_config

    src = cfg.source_file or "<recipe>"
    d = cfg.drafter
    vocab_size, num_layers, T = target_config.vocab_size, target_config.num_hidden_layers, target_config.hidden_size
    m = d.mask_token_id
    if m is None:
        raise ConfigError(f"{src}: drafter.mask_token_id is required (a reserved id the tokenizer never emits)")
    if not 0 <= m < vocab_size:
        raise ConfigError(f"{src}: drafter.mask_token_id={m} is outside the target vocab [0, {vocab_size})")
    vd = d.draft_vocab_size
    if vd is not None and vd > vocab_size:
        raise ConfigError(f"{src}: drafter.draft_vocab_size={vd} exceeds the target vocab {vocab_size}; "
                          f"lower it or set it to null (the full vocab)")
    ids = cfg.target.aux_layer_ids
    if ids is not None and max(ids) >= num_layers:
        raise ConfigError(f"{src}: target.aux_layer_ids={ids} must be < the target's {num_layers} layers")
    if ids is None:
        try:
            ids = default_aux_layer_ids(num_layers)
        except ValueError as e:
            msg = f"{src}: target.aux_layer_ids is null: {e} (3 ascending ids in [1, {num_layers}))"
            raise ConfigError(msg) from None
    H = d.hidden_size or T
    if H != T and not d.allow_hidden_size_mismatch:
        raise ConfigError(
            f"{src}: drafter.hidden_size={H} differs from the target's hidden size {T} ({cfg.target.name}); "
            f"set drafter.hidden_size: null (or {T}) to use the target's, or drafter.allow_hidden_size_mismatch: "
            "true to opt in to H != T (spec §5 decision: the export then needs vLLM >= 0.33)")
    # None fields resolved as make_drafter_config resolves them
    nh = d.num_attention_heads or target_config.num_attention_heads
    nkv = d.num_key_value_heads or getattr(target_config, "num_key_value_heads", None) or nh
    hd = d.head_dim or getattr(target_config, "head_dim", None) or T // target_config.num_attention_heads

    def given(key: str, value: int) -> str:  # "drafter.key=value", saying where a null key's value came from
        return f"drafter.{key}={value}" + ("" if getattr(d, key) is not None else
                                           f" (the target's; drafter.{key} is null)")

    if H % nh:
        raise ConfigError(
            f"{src}: {given('hidden_size', H)} is not a multiple of {given('num_attention_heads', nh)} (the Llama "
            "drafter config requires it, whatever drafter.head_dim is); choose drafter.num_attention_heads dividing it")
    if nh % nkv:
        raise ConfigError(
            f"{src}: {given('num_attention_heads', nh)} is not a multiple of {given('num_key_value_heads', nkv)}: "
            "grouped-query attention shares each key/value head among a whole number of query heads; set "
            "drafter.num_key_value_heads to a divisor of drafter.num_attention_heads")
    if hd % 2:
        raise ConfigError(f"{src}: {given('head_dim', hd)} is odd: rotary position embeddings rotate pairs of "
                          "channels; set drafter.head_dim to an even number")
    if d.init_layers == "target":  # the target's last layers must fit the drafter's, key for key
        theirs = {"hidden_size": T, "intermediate_size": getattr(target_config, "intermediate_size", None),
                  "num_attention_heads": target_config.num_attention_heads,
                  "num_key_value_heads": getattr(target_config, "num_key_value_heads", None) or target_config.num_attention_heads,
                  "head_dim": getattr(target_config, "head_dim", None) or T // target_config.num_attention_heads}
        ours = {"hidden_size": H, "intermediate_size": d.intermediate_size or theirs["intermediate_size"],
                "num_attention_heads": nh, "num_key_value_heads": nkv, "head_dim": hd}
        unlike = [k for k in ours if ours[k] != theirs[k]]
        experts = next((getattr(target_config, k) for k in ("num_local_experts", "num_experts", "n_routed_experts")
                        if getattr(target_config, k, None)), None)
        if unlike or experts or d.num_layers > num_layers:
            why = (f"{given(unlike[0], ours[unlike[0]])} but the target's is {theirs[unlike[0]]}" if unlike else
                   f"the target's layers are mixtures of {experts} experts, not dense Llama layers" if experts else
                   f"drafter.num_layers={d.num_layers} exceeds the target's {num_layers} layers")
            raise ConfigError(f"{src}: drafter.init_layers: target starts the drafter's layers from the target's last "
                              f"{d.num_layers}, which needs the same layer shape: {why}; use drafter.init_layers: random")
    try:  # whatever else the drafter's config refuses, refused now rather than in train
        make_drafter_config(target_config, aux_layer_ids=ids, draft_vocab_size=vd or vocab_size, mask_token_id=m,
                            **d.shape_fields())
    except Exception as e:  # noqa: BLE001 -- transformers' config validators raise several types
        raise ConfigError(f"{src}: the drafter section does not make a valid drafter for target "
                          f"{cfg.target.name}: {e}") from e


def validate_mask_token_absent(cfg: RunConfig, token_counts_nonzero: bool, where: str) -> None:
    """Refuse a mask token that occurs in training data (spec §2 decision).

    Raises:
        ConfigError: naming the recipe key and where the token was found.
    """
    if token_counts_nonzero:
        raise ConfigError(
            f"{cfg.source_file or '<recipe>'}: drafter.mask_token_id={cfg.drafter.mask_token_id} occurs in the "
            f"training data ({where}); choose a reserved/unused token id"
        )
