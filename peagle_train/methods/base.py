"""The draft-method seam: what differs between drafting methods, behind one class and a registry.

A draft method (P-EAGLE, the EAGLE-3 baseline, a user's own) is one module that subclasses
:class:`DraftMethod` and registers it with :func:`register_method` under the name a recipe
gives as ``train.method``. The trainer, the exporter and the evaluator hold no method names:
they ask the method chosen by the recipe (:func:`get_method`) or the one a drafter config
describes (:func:`method_of_config`) for

* the recipe rules it adds (:meth:`DraftMethod.validate_recipe`);
* the drafter fields it sets (:meth:`DraftMethod.drafter_fields`);
* its training inputs: the COD sample and grid of a micro-batch (:meth:`DraftMethod.build_grid`,
  with :meth:`cod_rates` and :meth:`grid_mask_id`) and whether a sequence may be partitioned
  (:meth:`DraftMethod.segments`);
* its objective, an ``nn.Module`` whose ``forward`` returns ``(loss, draft_pred)``
  (:meth:`DraftMethod.build_objective`, :meth:`DraftMethod.objective_inputs`);
* its in-training acceptance walk (:meth:`DraftMethod.accepted_walk`);
* the fields its export writes (:meth:`DraftMethod.vllm_fields`,
  :meth:`DraftMethod.speculators_fields`, :meth:`DraftMethod.drafter_fields_from_export`);
* its inference proposer for the reference decoding loop (:meth:`DraftMethod.check_served_K`,
  :meth:`DraftMethod.draft_round`).

Defaults below are those of a chain drafter (EAGLE-3 style) where one exists; a method
overrides what it changes. ``tests/integration/test_methods.py`` registers a toy method in a few dozen
lines and trains it through the real trainer.
"""
from __future__ import annotations

from typing import Any, Callable, ClassVar

import torch

from peagle_train.core.dtypes import acc_dtype
from peagle_train.peagle.grid import Grid, build_grid, cod_sample
from peagle_train.peagle.spec_stats import walk_accepted

_REGISTRY: dict[str, "DraftMethod"] = {}


def config_field(config, key: str, default=None):
    """``key`` of a drafter config: an HF config object (attribute) or an exported ``config.json`` dict."""
    if isinstance(config, dict):
        return config.get(key, default)
    return getattr(config, key, default)


def loss_weights(loss_weight: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """``[E]`` loss weights in the loss accumulation dtype of ``h`` (:func:`~peagle_train.core.dtypes.acc_dtype`:
    float64 stays exact; half types use float32)."""
    return loss_weight.to(acc_dtype(h.dtype))


class DraftMethod:
    """One drafting method. Subclass, set :attr:`name`, override what differs, and register it.

    Attributes:
        name: the registry name (``train.method``; also the ``method`` of eval reports).
        title: a human-readable name for reports and model cards.
        serves_above_trained_K: whether a drafter trained with ``train.K`` may serve more drafts per
            round (a chain drafter may; P-EAGLE's mask depths beyond trained K were never trained).
        memory_planned: whether :mod:`peagle_train.peagle.planner` models this method's training step (the
            N x K grid with sequence partitioning); the trainer records a predicted peak only then.
    """

    name: ClassVar[str] = ""
    title: ClassVar[str] = ""
    serves_above_trained_K: ClassVar[bool] = True
    memory_planned: ClassVar[bool] = False

    # -- recipe and drafter ------------------------------------------------------------------
    def validate_recipe(self, cfg) -> None:
        """Raise ``ValueError`` (message names the recipe key) for a recipe this method cannot run."""

    def drafter_fields(self, cfg) -> dict:
        """Keyword arguments of :func:`~peagle_train.model.drafter.make_drafter_config` this method
        sets (``mask_token_id``, ``parallel_drafting``)."""
        return {"mask_token_id": None, "parallel_drafting": False}

    def describes(self, config) -> bool:
        """Whether a drafter config (object or exported ``config.json`` dict) is of this method."""
        raise NotImplementedError

    # -- training inputs -----------------------------------------------------------------------
    def cod_rates(self, train_cfg) -> tuple[float, float]:
        """``(r, r_min)`` of the COD sample of training grids (spec §3); default: every depth kept."""
        return 1.0, 1.0

    def grid_mask_id(self, cfg) -> int:
        """Token id the grid puts at depths >= 1 (the objective may replace it)."""
        return 0

    def build_grid(self, tokens: dict, cfg, generator: torch.Generator | None = None, *, train: bool = True) -> Grid:
        """The grid of one packed micro-batch.

        Args:
            tokens: ``{"input_ids", "loss_mask", "doc_ids"}`` ``[N]`` tensors (:func:`~peagle_train.features.packing.pack_tokens`).
            cfg: the run's config. generator: CPU generator of the COD sample (training only).
            train: True: COD with :meth:`cod_rates` and ``train.max_anchors``; False (evaluation):
                every chain kept to depth ``K - 1`` (``r = r_min = 1``).

        Returns:
            the :class:`~peagle_train.peagle.grid.Grid` on the device of ``tokens``.
        """
        tc = cfg.train
        if train:
            r, r_min = self.cod_rates(tc)
            kept = cod_sample(tokens["loss_mask"], tokens["doc_ids"], tc.K, r, r_min, tc.max_anchors, generator)
        else:
            kept = cod_sample(tokens["loss_mask"], tokens["doc_ids"], tc.K, 1.0, 1.0)
        return build_grid(tokens["input_ids"], tokens["loss_mask"], tokens["doc_ids"], kept, self.grid_mask_id(cfg))

    def segments(self, host_grid: Grid, n_tokens: int, S: int) -> list | None:
        """Sequence-partition segments of a host grid (spec §3, Algorithm 1), or None where the
        method's objective takes the whole grid in one forward (no partitioning)."""
        return None

    # -- objective -----------------------------------------------------------------------------
    def build_objective(self, drafter, target_head: torch.Tensor, cfg, *, attention: str, chain_kernel: str,
                        max_micro_tokens: int) -> torch.nn.Module:
        """The training objective: an ``nn.Module`` holding ``drafter`` whose ``forward(grid, aux, last,
        argmax, normaliser, *objective_inputs(packed))`` returns ``(loss scalar, draft_pred [E] int64)``.

        Args:
            drafter: the :class:`~peagle_train.model.drafter.Drafter`. target_head: ``[Vd, T]`` float32
                draft-vocab rows of the target head. cfg: the run. attention / chain_kernel: resolved
                ``train.attention`` / ``train.chain_kernel``. max_micro_tokens: most tokens one
                micro-batch can hold (``micro_batch_size ×`` the longest sequence).
        """
        raise NotImplementedError

    def objective_inputs(self, packed: dict) -> tuple:
        """Extra positional inputs of the objective's ``forward`` from a packed micro-batch."""
        return ()

    # -- in-training acceptance walk -------------------------------------------------------------
    def accepted_walk(self, ok: torch.Tensor, sup: torch.Tensor, first: int, k: int, horizon: int | None) -> list[int]:
        """Accepted drafts per decoding round when serving ``k`` drafts, replayed from training
        predictions (:func:`~peagle_train.peagle.spec_stats.walk_accepted`; ``ok``/``sup`` from
        :func:`~peagle_train.peagle.spec_stats.chain_matrix`)."""
        return walk_accepted(ok, sup, first, k, horizon)

    # -- export --------------------------------------------------------------------------------
    def check_target(self, config, vocab_size: int) -> None:
        """Raise ``ValueError`` where a drafter config does not fit a target of ``vocab_size`` ids."""

    def vllm_fields(self, config) -> dict:
        """Fields of vLLM's ``config.json`` this method adds (spec §5); ``ValueError`` if it cannot."""
        return {}

    def speculators_fields(self, flat: dict, config) -> dict:
        """``{"kind", "architecture", "K", "extra"}`` of vLLM's speculators format for an export whose
        flat vLLM config is ``flat``."""
        raise NotImplementedError

    def drafter_fields_from_export(self, flat: dict) -> dict:
        """Drafter config attributes read back from an exported flat ``config.json``."""
        return {"mask_token_id": None, "parallel_drafting": False}

    # -- inference (reference decoding loop) ---------------------------------------------------------
    def check_served_K(self, drafter, K: int) -> None:
        """Raise ``ValueError`` where ``drafter`` cannot serve ``K`` drafts per round."""

    def draft_round(self, session, ctx_tokens: torch.Tensor, hidden: torch.Tensor, positions: torch.Tensor,
                    pick: Callable[[torch.Tensor], Any]) -> tuple[torch.Tensor, list]:
        """One round of ``session.K`` drafts after appending the new context slots.

        Args:
            session: the :class:`~peagle_train.decoding.speculative.DraftSession` (``drafter``, ``K``,
                ``kv``, ``num_cached``, ``forward(tokens, hidden, positions, past)``).
            ctx_tokens: ``[n]`` int64 new context tokens (the last is the bonus token).
            hidden: ``[n, H]`` their projected aux states. positions: ``[n]`` their positions.
            pick: ``logits [Vd] -> (target id, q or None)``; also ``logits [R, Vd] -> (ids [R], q [R, V] or
                None)``, the same as R calls row by row (a method whose drafts of a round come from one forward
                picks them in one call).

        Returns:
            ``(logits [K, Vd], picks)``; ``session.kv`` holds the committed context slots' KV.
        """
        raise NotImplementedError


def register_method(cls: type[DraftMethod]) -> type[DraftMethod]:
    """Class decorator: register ``cls()`` under ``cls.name`` (the ``train.method`` of recipes).

    Raises:
        ValueError: an empty name, or a name already registered by another class.
    """
    if not cls.name:
        raise ValueError(f"{cls.__name__}.name is empty: a draft method needs a registry name")
    old = _REGISTRY.get(cls.name)
    if old is not None and type(old) is not cls:
        raise ValueError(f"draft method {cls.name!r} is already registered by {type(old).__name__}")
    _REGISTRY[cls.name] = cls()
    return cls


def unregister_method(name: str) -> None:
    """Remove a registered method (tests and plugins that registered one for a while)."""
    _REGISTRY.pop(name, None)


def method_names() -> list[str]:
    """Registered method names, in registration order."""
    return list(_REGISTRY)


def get_method(name: str) -> DraftMethod:
    """The method registered as ``name``.

    Raises:
        ValueError: no method of that name (the message lists the registered ones).
    """
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"train.method {name!r} is not a registered draft method; registered: "
                         f"{', '.join(method_names())}") from None


def method_of_config(config) -> DraftMethod:
    """The method a drafter config (HF object or exported ``config.json`` dict) describes; the
    latest registration is asked first, so a method registered later may refine a built-in one.

    Raises:
        ValueError: no registered method describes it.
    """
    for m in reversed(list(_REGISTRY.values())):
        if m.describes(config):
            return m
    raise ValueError(f"no registered draft method ({', '.join(method_names())}) describes this drafter config")
