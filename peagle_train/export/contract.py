"""Names and value rules both export checkers share (vLLM's layout, ``check.py``; speculators'
layout, ``check_speculators.py``): the files of an export directory and what counts as an integer
field of ``config.json``."""
from __future__ import annotations

#: the export directory's config and weights files (what vLLM reads, spec §5).
CONFIG_FILE = "config.json"
WEIGHTS_FILE = "model.safetensors"


def is_int(x) -> bool:
    """A JSON integer: ``int`` but not ``bool`` (``True`` is an ``int`` in Python, never a size in a config)."""
    return isinstance(x, int) and not isinstance(x, bool)

#: ``config.json`` fields every drafter has and a plain (target / base) model never has: the drafter
#: folder ``peagle-train train`` writes and the vLLM-format export both carry them.
DRAFTER_FIELDS = ("target_hidden_size", "draft_vocab_size", "eagle_aux_hidden_state_layer_ids")


def missing_drafter_fields(cfg: dict) -> list[str]:
    """The :data:`DRAFTER_FIELDS` ``cfg`` lacks (a folder lacking all of them is not one of our drafters)."""
    return [k for k in DRAFTER_FIELDS if k not in cfg]


def not_a_drafter_message(where, cfg: dict) -> str | None:
    """A one-sentence explanation when ``cfg`` (the ``config.json`` of folder ``where``) has none of
    :data:`DRAFTER_FIELDS`, i.e. it is some other model (a target, a base model); None otherwise."""
    missing = missing_drafter_fields(cfg)
    if len(missing) < len(DRAFTER_FIELDS):
        return None
    arch = cfg.get("architectures")
    return (f"{where}: not a drafter folder of peagle_train: {CONFIG_FILE} has none of the drafter fields "
            f"{list(missing)} (architectures {arch!r}, model_type {cfg.get('model_type')!r}: a target or base "
            f"model?). Point the command at the folder peagle-train wrote (<output_dir>/drafter for export, "
            f"<output_dir>/export for check and push)")
