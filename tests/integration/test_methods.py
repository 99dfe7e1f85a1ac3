"""The draft-method seam is real: a toy method defined in this file, registered by name, trains two
steps of the tiny CPU drafter through the real :class:`~peagle_train.trainer.trainer.Trainer`
without any change to the package (``peagle_train/methods/base.py``).

The toy method, "next-token only", is the simplest drafter there is: depth 0 of the grid (no
chains, no mask token), the drafter's own loss on the target's next-token distribution. It owns
its grid (COD keeps only depth 0), its objective (one forward, chunked KL) and its export fields.
"""
import pytest
import torch
from torch import nn

from peagle_train.kernels.attention import make_attn_spec
from peagle_train.kernels.loss import TargetDist, chunked_loss
from peagle_train.methods import DraftMethod, get_method, method_names, method_of_config, register_method
from peagle_train.methods import unregister_method
from peagle_train.methods.base import config_field, loss_weights
from peagle_train.peagle.grid import build_grid, cod_sample
from peagle_train.peagle.masks import GridMeta
from peagle_train.trainer.trainer import Trainer
from tests.integration.test_train import _cached_inputs, _cfg, run_dir  # noqa: F401  (fixture)


class NextTokenObjective(nn.Module):
    """Depth-0 loss only: ``forward(grid, aux, last, argmax, normaliser) -> (loss, pred)``."""

    def __init__(self, drafter, target_head):
        super().__init__()
        self.drafter = drafter
        self.register_buffer("target_head", target_head, persistent=False)

    def forward(self, grid, aux, last, argmax, normaliser):
        hidden = self.drafter.grid_hidden(aux, grid.hidden_index)
        h, _ = self.drafter(grid.token_ids, hidden, grid.position_ids, make_attn_spec(GridMeta.of(grid), kind="sdpa"))
        return chunked_loss(self.drafter.norm, self.drafter.lm_head, h, grid.label_index,
                            loss_weights(grid.loss_weight, h) / normaliser, TargetDist(last, self.target_head, argmax))


class NextTokenOnly(DraftMethod):
    name = "toy_next_token"
    title = "next-token drafter (test)"

    def describes(self, config) -> bool:
        return config_field(config, "toy_next_token") is True

    def build_grid(self, tokens, cfg, generator=None, *, train=True):
        kept = cod_sample(tokens["loss_mask"], tokens["doc_ids"], 1, 1.0, 1.0)  # depth 0 only
        return build_grid(tokens["input_ids"], tokens["loss_mask"], tokens["doc_ids"], kept, 0)

    def build_objective(self, drafter, target_head, cfg, *, attention, chain_kernel, max_micro_tokens):
        drafter.config.toy_next_token = True
        return NextTokenObjective(drafter, target_head)

    def vllm_fields(self, config) -> dict:
        return {"num_speculative_tokens_hint": 1}


@pytest.fixture()
def toy_method():
    register_method(NextTokenOnly)
    yield get_method("toy_next_token")
    unregister_method("toy_next_token")


def test_a_toy_method_trains_through_the_real_trainer(run_dir, toy_method):  # noqa: F811
    data, feats, tconf = _cached_inputs(run_dir)
    cfg = _cfg(run_dir, method="toy_next_token", max_steps=2)
    trainer = Trainer(cfg, data, feats, tconf, [1, 3, 4])
    assert trainer.method is toy_method
    objective = trainer.acc.unwrap_model(trainer.model)
    assert isinstance(objective, NextTokenObjective)
    before = {k: v.detach().clone() for k, v in objective.drafter.named_parameters()}
    recs = [trainer.train_step() for _ in range(2)]
    assert trainer.step == 2 and all(torch.isfinite(torch.tensor(r["loss"])) and not r["skipped"] for r in recs)
    moved = [k for k, v in objective.drafter.named_parameters() if not torch.equal(v, before[k])]
    assert "fc.weight" in moved and any(k.startswith("layers.0.") for k in moved)
    # only depth 0 was trained: the per-depth accuracy has no depth >= 1 elements
    assert recs[-1]["acc"][0] == recs[-1]["acc"][0] and all(a != a for a in recs[-1]["acc"][1:])  # NaN beyond 0
    ev = trainer.evaluate()
    assert ev["eval_loss"] > 0
    # the exporter asks the method the drafter config describes
    assert method_of_config(objective.drafter.config) is toy_method
    assert toy_method.vllm_fields(objective.drafter.config) == {"num_speculative_tokens_hint": 1}


def test_registry_refuses_unknown_and_duplicate_names(toy_method):
    assert {"peagle", "eagle3", "toy_next_token"} <= set(method_names())
    with pytest.raises(ValueError, match="not a registered draft method; registered: .*peagle"):
        get_method("dflash")

    class Other(NextTokenOnly):
        pass

    with pytest.raises(ValueError, match="already registered by NextTokenOnly"):
        register_method(Other)


def test_recipe_with_an_unknown_method_fails_at_load(run_dir):  # noqa: F811
    from peagle_train.core.config import ConfigError

    with pytest.raises(ConfigError, match="'dflash' is not a registered draft method"):
        _cfg(run_dir, method="dflash")
