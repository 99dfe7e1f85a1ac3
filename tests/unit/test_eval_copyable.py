"""The in-training eval's accuracy by depth split by copyable and fresh labels
(``InTrainingEval._depth_by_copyable``, issue 20): hand-made grids, every number checked by hand."""
from types import SimpleNamespace

import torch

from peagle_train.trainer.evaluation import InTrainingEval


class _Drafter:
    def __init__(self, vocab: int, out_of_vocab: tuple[int, ...] = ()):
        self.t2d = torch.ones(vocab, dtype=torch.bool)
        self.t2d[list(out_of_vocab)] = False

    def draft_to_target(self, pred):
        return pred  # draft ids are target ids here


def _trainer(ids, mask, drafter):
    model = object()
    acc = SimpleNamespace(unwrap_model=lambda m: SimpleNamespace(drafter=drafter))
    tr = SimpleNamespace(eval_ids=[ids], eval_masks=[mask], _copyable_cache={}, acc=acc, model=model)
    tr._copyable = lambda i: InTrainingEval._copyable(tr, i)
    return tr


def test_copyable_flags_of_an_eval_sequence_cover_its_supervised_tokens_only():
    # prompt 9 9 then 5 6 7 8 5 6 7 8 5: with n = 4, the token at 10 (5) follows 5 6 7 8 seen at 2..5 -> copyable;
    # position 6 (5) follows 9 5 6 7 ... not seen before -> fresh; the prompt is never flagged
    ids = [9, 9, 5, 6, 7, 8, 5, 6, 7, 8, 5]
    mask = [0, 0] + [1] * 9
    tr = _trainer(ids, mask, _Drafter(10))
    flags = InTrainingEval._copyable(tr, 0)
    assert flags.tolist() == [False] * 10 + [True]
    assert InTrainingEval._copyable(tr, 0) is flags  # cached


def test_first_depth_split_counts_right_and_all_per_class():
    ids = [9, 9, 5, 6, 7, 8, 5, 6, 7, 8, 5]
    mask = [0, 0] + [1] * 9
    drafter = _Drafter(10, out_of_vocab=(8,))
    tr = _trainer(ids, mask, drafter)
    # five elements: (depth, label_index, weight, prediction); the label is the token at label_index + 1
    depth = torch.tensor([0, 0, 0, 0, 1])
    label_index = torch.tensor([9, 8, 3, 4, 9])       # labels: ids[10]=5 (copyable), ids[9]=8, ids[4]=7, ids[5]=8
    weight = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0])  # the fourth is not supervised; the fifth is depth 2
    argmax = torch.tensor(ids[1:] + [0])              # the target's greedy token at each row: the next token
    pred = torch.tensor([5, 8, 6, 8, 5])              # right, right but out of the draft vocab, wrong, -, -
    grid = SimpleNamespace(depth=depth, label_index=label_index, loss_weight=weight)
    right = InTrainingEval._right(tr, {"argmax": argmax}, grid, pred)
    out = InTrainingEval._depth_by_copyable(tr, grid, right, 0, 3)
    # depth 1 -- copyable: 1 element (label at 10), right; fresh: 2 supervised elements (labels at 9 and 4), none right
    # (the one at 9 is the target's token but outside the draft vocab: the loop cannot propose it)
    assert out[:, 0].tolist() == [1.0, 1.0, 0.0, 2.0]
    # depth 2: the fifth element, label at 10 (copyable), right; depth 3: nothing
    assert out[:, 1].tolist() == [1.0, 1.0, 0.0, 0.0] and out[:, 2].tolist() == [0.0] * 4
