"""Chunked KL / cross-entropy over the draft vocab, and per-depth metrics (spec §3 "Loss and metrics").

Shape legend: ``E`` grid elements, ``c`` a chunk of elements, ``H`` drafter
hidden, ``T`` target hidden, ``Vd`` draft vocab, ``N`` tokens.

The ``[E, Vd]`` fp32 logits never exist at once. Two ways to get the gradients
(``chunked_loss(fused=...)``, ``train.fused_loss``):

* fused (default): each chunk's forward also computes the gradient of its loss with
  respect to its logits, ``w * (softmax(draft) * sum(p_t) - p_t)``, and from it the
  gradients of the normed hidden states and of the head (the "fused linear + loss" of
  issue #7). The backward only scales them: no lm_head recompute, no logits kept;
* recompute: each chunk's lm_head + loss runs under activation checkpointing and is
  recomputed in the backward (also the fallback for a head that is not a plain bias-free
  ``nn.Linear``, or whose weight is sharded by DeepSpeed ZeRO-3 or FSDP2 at loss time).
"""
from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F
from torch.autograd.function import once_differentiable
from torch.utils.checkpoint import checkpoint

from peagle_train.core.dtypes import acc_dtype


@dataclass
class TargetDist:
    """The target's next-token distribution at each token of a packed sequence.

    Attributes:
        last: ``[N, T]`` final hidden state after the target's final norm.
        head: ``[Vd, T]`` the target head's rows for the draft vocab (frozen).
        argmax: ``[N]`` int64 target greedy token over the *full* vocab.
    """

    last: torch.Tensor
    head: torch.Tensor
    argmax: torch.Tensor
    _head_as: dict = field(default_factory=dict, init=False, repr=False, compare=False)  # dtype → head cast

    def draft_logits(self, rows: torch.Tensor) -> torch.Tensor:
        """Target logits restricted to the draft vocab for the ``[c]`` int64 token ``rows``: ``[c, Vd]``.

        The matmul runs in the loss accumulation dtype (float32; float64 for float64 inputs), or, under
        autocast, in autocast's dtype: there autocast would cast float32 operands straight back, so
        the operands are not upcast first (same result, bitwise). The head is cast to that dtype once
        per :class:`TargetDist` (one per objective call), not once per chunk. The output dtype is the
        matmul's (bf16 under bf16 autocast).
        """
        dt = _matmul_dtype(self.last.device.type, acc_dtype(self.last.dtype))
        if dt not in self._head_as:
            self._head_as[dt] = self.head.to(dt)
        return self.last[rows].to(dt) @ self._head_as[dt].T


def _matmul_dtype(device_type: str, dtype: torch.dtype) -> torch.dtype:
    """The dtype a matmul of ``dtype`` operands runs in on ``device_type``: autocast's dtype where
    autocast is on (``torch.get_autocast_dtype``), else ``dtype``."""
    if torch.is_autocast_enabled(device_type):
        return torch.get_autocast_dtype(device_type)
    return dtype


def _chunk_loss(norm, lm_head, h, t_logits, weight, kind: str):
    logp = F.log_softmax(lm_head(norm(h)).to(acc_dtype(h.dtype)), dim=-1)
    if kind == "kl":
        tlogp = F.log_softmax(t_logits, dim=-1)
        per = (tlogp.exp() * (tlogp - logp)).sum(-1)
    else:
        per = -logp.gather(-1, t_logits.argmax(-1, keepdim=True)).squeeze(-1)
    return (per * weight).sum(), logp.argmax(-1)


def _fused_chunk(hn, head_w, t_logits, w, kind: str, need_h: bool, need_w: bool):
    """One chunk of the fused head + loss: loss, greedy ids and the loss's gradients, in one pass.

    Args:
        hn: ``[c, H]`` normed drafter states, in the matmul dtype. head_w: ``[Vd, H]``, same dtype.
        t_logits: ``[c, Vd]`` target logits over the draft vocab. w: ``[c]`` weights (accumulation dtype).
        kind: ``"kl"`` / ``"ce"``. need_h / need_w: return the gradient w.r.t. ``hn`` (trainable
            drafter or final norm) / ``head_w`` (a trainable head), else None.

    Returns:
        ``(loss_sum, pred [c] int64, grad_hn [c, H] or None, grad_head [Vd, H] or None)``; loss_sum in
        the accumulation dtype (float32; float64 for float64), the gradients those of ``loss_sum``
        in the matmul dtype, as autograd through the same matmul would give them. With
        ``L = sum_v p_t,v (log p_t,v - log softmax(z)_v)``, ``dL/dz = softmax(z) * sum(p_t) - p_t``
        (``sum(p_t)`` is 1 up to rounding, kept for exactness; CE: ``p_t`` is one-hot).
    """
    acc = acc_dtype(hn.dtype)
    logp = F.log_softmax(F.linear(hn, head_w).to(acc), dim=-1)  # the op lm_head runs
    p = logp.exp()
    if kind == "kl":
        tlogp = F.log_softmax(t_logits.to(acc), dim=-1)
        pt = tlogp.exp()
        per = (pt * (tlogp - logp)).sum(-1)
        grad_z = p * pt.sum(-1, keepdim=True) - pt
    else:
        tgt = t_logits.argmax(-1, keepdim=True)
        per = -logp.gather(-1, tgt).squeeze(-1)
        grad_z = p.scatter_add_(-1, tgt, torch.full(tgt.shape, -1.0, dtype=acc, device=p.device))
    grad_z = (grad_z * w[:, None]).to(hn.dtype)
    return ((per * w).sum(), logp.argmax(-1), grad_z @ head_w if need_h else None,
            grad_z.T @ hn if need_w else None)


class _GradFromForward(torch.autograd.Function):
    """``loss`` (a value) whose gradients w.r.t. ``hn`` and ``head_w`` were computed in the forward
    (``grad_hn``, ``grad_head``, None where not needed); the backward scales them by the incoming
    gradient. First-order only (``once_differentiable``)."""

    @staticmethod
    def forward(ctx, loss, hn, head_w, grad_hn, grad_head):
        ctx.save_for_backward(grad_hn, grad_head)
        ctx.dtypes = (hn.dtype, head_w.dtype)
        return loss.clone()

    @staticmethod
    @once_differentiable
    def backward(ctx, g):
        grad_hn, grad_head = ctx.saved_tensors
        gh = None if grad_hn is None else grad_hn.to(ctx.dtypes[0]) * g.to(ctx.dtypes[0])
        gw = None if grad_head is None else grad_head.to(ctx.dtypes[1]) * g.to(ctx.dtypes[1])
        return None, gh, gw, None, None


def _fusable(lm_head: torch.nn.Module) -> bool:
    """The fused path reads ``lm_head.weight`` instead of calling the module, which is only the same
    for a bias-free ``nn.Linear`` (not a subclass, wrapper or parametrized head) with no hooks of
    its own or global module hooks, whose weight is whole at loss time (not a ZeRO-3 partitioned
    parameter, ``ds_id``, nor an FSDP2 ``DTensor``)."""
    from torch.nn.modules import module as nn_module

    if type(lm_head) is not torch.nn.Linear or lm_head.bias is not None:
        return False
    own = (lm_head._forward_hooks, lm_head._forward_pre_hooks, lm_head._backward_hooks, lm_head._backward_pre_hooks)
    glob = (nn_module._global_forward_hooks, nn_module._global_forward_pre_hooks,
            nn_module._global_backward_hooks, nn_module._global_backward_pre_hooks)
    if any(own) or any(glob):
        return False
    w = lm_head.weight
    return not (hasattr(w, "ds_id") or hasattr(w, "full_tensor"))


_CHUNK_COMPILED: dict = {}


def loss_path(lm_head: torch.nn.Module, fused: bool, grads: bool = True) -> str:
    """The path :func:`chunked_loss` takes: ``"fused"`` (gradients computed in the forward),
    ``"recompute"`` (checkpoint + recompute; also where :func:`_fusable` refuses the head) or
    ``"no-grad"`` (no gradient needed: eval, ``torch.no_grad``).

    Args:
        lm_head: the drafter's head. fused: ``train.fused_loss``. grads: whether the call needs
            gradients (any of the hidden states, the head or the norm requires grad, grad mode on).
    """
    if not grads:
        return "no-grad"
    return "fused" if fused and _fusable(lm_head) else "recompute"


def compiled_chunk_loss(inductor_mode: str | None = None, fused: bool = False):
    """The compiled chunk body :func:`chunked_loss` runs: under
    ``torch.compile(fullgraph=True, dynamic=False)`` with the safe fallback of
    :class:`~peagle_train.kernels.compiling.SafeCompiled`, so the ``[c, Vd]`` elementwise work fuses.
    One shared instance per (body, mode): one graph per distinct chunk length and loss kind.

    Args:
        inductor_mode: compile mode label: None (Inductor's defaults) or ``"max-autotune"``
            (:func:`~peagle_train.kernels.compiling.compile_kwargs`).
        fused: False: the recompute path's body ``_chunk_loss`` (final norm → lm_head →
            log_softmax → KL/CE → weighted sum, argmax); True: the fused path's ``_fused_chunk``
            (lm_head → loss and its gradients in the forward, :func:`_fused_chunk`).

    Returns:
        a :class:`~peagle_train.kernels.compiling.SafeCompiled` callable with that body's signature; its
        ``mode`` says whether it compiled (``"pending"`` until first called).
    """
    return _compiled(_fused_chunk if fused else _chunk_loss, inductor_mode)


def _compiled(fn, inductor_mode: str | None):
    key = (fn.__name__, inductor_mode)
    if key not in _CHUNK_COMPILED:
        from peagle_train.kernels.compiling import SafeCompiled

        _CHUNK_COMPILED[key] = SafeCompiled(fn, f"loss.{fn.__name__}", inductor_mode=inductor_mode)
    return _CHUNK_COMPILED[key]


def chunked_loss(
    norm: torch.nn.Module,
    lm_head: torch.nn.Module,
    h: torch.Tensor,
    label_index: torch.Tensor,
    weight: torch.Tensor,
    target: TargetDist,
    kind: str = "kl",
    chunk_size: int = 2048,
    compile: bool | str = False,
    fused: bool = True,
):
    """Sum over elements of ``weight * loss`` and the drafter's greedy draft ids.

    Loss (spec §3 decision): forward ``KL(p_target || p_draft)`` over the draft vocab,
    the target distribution restricted to the draft vocab and renormalised; or
    cross-entropy on the target's greedy token within the draft vocab (``kind="ce"``).

    Args:
        norm, lm_head: the drafter's final norm and head (``H → Vd``).
        h: ``[E, H]`` pre-norm drafter outputs.
        label_index: ``[E]`` int64 rows of ``target``.
        weight: ``[E]`` float (already divided by the normaliser if wanted).
        target: :class:`TargetDist`.
        kind: ``"kl"`` or ``"ce"``. chunk_size: elements per chunk.
        compile: run the chunk body through :func:`compiled_chunk_loss` (``train.compile``: True, or
            ``"max-autotune"`` for Inductor's autotuning mode): the fused chunk, or the recompute
            path's chunk body, which ``torch.utils.checkpoint`` still wraps (it saves none of its
            activations and recomputes it in the backward).
        fused: when gradients are needed, compute them in the forward (:func:`_fused_chunk`; no
            lm_head recompute in the backward, no chunk logits kept) instead of checkpoint +
            recompute. Falls back to recompute where the head is not a plain bias-free ``nn.Linear``
            or its weight is sharded at loss time (ZeRO-3, FSDP2 ``DTensor``): :func:`_fusable`.
            Same loss and gradients (float64 tests, ``test_loss.py``).

    Returns:
        ``(loss_sum scalar float32 (float64 for float64 inputs), draft_pred [E] int64 draft-vocab ids)``.

    Raises:
        ValueError: unknown ``kind``.
    """
    if kind not in ("kl", "ce"):
        raise ValueError(f"unknown loss kind {kind!r}")
    from peagle_train.kernels.compiling import inductor_mode

    mode = inductor_mode(compile)
    grads = torch.is_grad_enabled() and (h.requires_grad or lm_head.weight.requires_grad
                                         or any(p.requires_grad for p in norm.parameters()))
    if loss_path(lm_head, fused, grads) == "fused":
        norm_fn = _compiled(_apply_norm, mode) if compile else _apply_norm
        # checkpointed: the norm keeps nothing of its own ([E, H] float32 under autocast) for the backward
        hn = checkpoint(norm_fn, norm, h, use_reentrant=False)
        return _fused_loss(hn, lm_head.weight, label_index, weight, target, kind, chunk_size,
                           compiled_chunk_loss(mode, fused=True) if compile else _fused_chunk)
    body = compiled_chunk_loss(mode) if compile else _chunk_loss
    total = h.new_zeros((), dtype=acc_dtype(h.dtype))
    preds = []
    for s in range(0, h.shape[0], chunk_size):
        sl = slice(s, s + chunk_size)
        with torch.no_grad():
            t_logits = target.draft_logits(label_index[sl])
        w = weight[sl].to(acc_dtype(h.dtype))
        if torch.is_grad_enabled() and h.requires_grad:
            part, pred = checkpoint(body, norm, lm_head, h[sl], t_logits, w, kind, use_reentrant=False)
        else:
            part, pred = body(norm, lm_head, h[sl], t_logits, w, kind)
        total = total + part
        preds.append(pred)
    return total, torch.cat(preds) if preds else h.new_zeros(0, dtype=torch.long)


def _apply_norm(norm, h):
    """``norm(h)``: the final norm as a function, so that ``train.compile`` can compile it (fused path)."""
    return norm(h)


def _fused_loss(hn, head_w, label_index, weight, target: TargetDist, kind: str, chunk_size: int, body):
    """:func:`chunked_loss` with ``fused=True``, given the normed states ``hn [E, H]`` (autograd as usual).

    The chunk loop runs without autograd, collecting each chunk's gradients (:func:`_fused_chunk`);
    :class:`_GradFromForward` hands them to autograd at ``hn`` and at the head weight. The head
    matmuls run in autocast's dtype under autocast, else in ``promote(hn, head_w)`` (bf16 for a bf16
    model, as ``lm_head(hn)`` would). Kept for the backward: ``grad_hn [E, H]`` in that dtype and,
    for a trainable head, ``grad_head [Vd, H]`` in the accumulation dtype. ``weight`` gets no gradient.

    Returns:
        ``(loss_sum scalar, float32 or float64 for float64 inputs; draft_pred [E] int64)``.
    """
    dt = _matmul_dtype(hn.device.type, torch.promote_types(hn.dtype, head_w.dtype))
    acc = acc_dtype(hn.dtype)
    need_h, need_w = hn.requires_grad, head_w.requires_grad
    total = hn.new_zeros((), dtype=acc)
    preds = []
    grad_hn = torch.empty(hn.shape, dtype=dt, device=hn.device) if need_h else None
    grad_head = torch.zeros(head_w.shape, dtype=acc, device=head_w.device) if need_w else None
    with torch.no_grad():
        hd, wd = hn.detach().to(dt), head_w.detach().to(dt)
        for s in range(0, hn.shape[0], chunk_size):
            sl = slice(s, s + chunk_size)
            t_logits = target.draft_logits(label_index[sl])
            part, pred, gh, gw = body(hd[sl], wd, t_logits, weight[sl].to(acc), kind, need_h, need_w)
            total = total + part
            preds.append(pred)
            if need_h:
                grad_hn[sl] = gh
            if need_w:
                grad_head += gw
    loss = _GradFromForward.apply(total, hn, head_w, grad_hn, grad_head)
    return loss, torch.cat(preds) if preds else hn.new_zeros(0, dtype=torch.long)
