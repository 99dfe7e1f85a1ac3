"""Memory planner for one training step: how many sequence partitions ``S`` (spec §3) and
whether activation checkpointing are needed for an ``N``-token sequence to fit a GPU.

Model (bytes; bf16 autocast, fp32 master weights, AdamW, as ``benchmarks/train_step.py``)::

    peak(N, S) = static + grads + workspace + inputs + ALPHA * act_bytes_per_element * E_seg + kept_logits
    static     = 12 * P_trainable            # fp32 weight + AdamW m, v
               + 4 * Vd * H                  # frozen fp32 lm_head (a trainable one: 8 more per param for m, v,
                                             # and 4 for its gradient where gradients are resident)
               + target_head_bytes * Vd * T  # frozen target head rows (bf16 in the benchmark)
    grads      = 4 * P_trainable if gradients are resident during the forward, else 0
                                             # (S > 1: the first segment's gradients are kept while
                                             # the next segment runs; likewise after the first of
                                             # several micro-batches, and always under DDP, whose
                                             # gradient buckets exist from the start). With S = 1 and one micro-batch
                                             # the peak comes before any gradient exists (the
                                             # optimizer's zero_grad sets them to None).
    workspace  = OMEGA * 4 * chunk * Vd      # one loss chunk's fp32 [chunk, Vd] buffers (train.compile: the
                                             # chunk body compiled); OMEGA_EAGER instead without compile
               + 2 * Vd * H                  # the head in bf16 for the chunk loop (fused: its copy; else
                                             # autocast's cached cast)
               + 4 * Vd * H                  # train.fused_loss with a trainable head: one chunk's head
                                             # gradient [Vd, H] float32 before it is added to the accumulator
    inputs     = N * (A + 1) * T * 2         # bf16 aux [N, A*T] + final hidden [N, T]
    E          = e_ratio * N,  e_ratio = sum_{d<K} max(r**d, r_min)   (3.373 for K=8, r=0.7, r_min=0.2)
    E_seg      = E / S + N * (S - 1) / S     # the largest (last) segment: its owned elements
                                             # plus every earlier depth-0 element as context
    act_bytes_per_element = L * (16 H + 8 I + 2 (nh + 2 nkv) hd + 4 nh hd) + 12 H
                                             # saved activations per grid element, no checkpointing
    with checkpointing: L * 2 H + 12 H + one layer's (16 H + 8 I + 2 (nh + 2 nkv) hd + 4 nh hd)
    selective (train.activation_checkpointing: selective): that + L * (2 (2 nh + 2 nkv) hd + 4 nh)
                                             # each layer's attention backward operands kept: q, k, v and the
                                             # output (bf16) and log-sum-exp (fp32). Counting the output and
                                             # log-sum-exp alone predicted 63.7 GiB for N = 131,072, S = 3 on an
                                             # H100 where 72.0 GiB was measured (3026d29,
                                             # docs/data/train_step_3026d29_h100_131072_selective.json): the
                                             # compiled layers keep the attention's inputs as well; with them
                                             # the model gives 71.1 GiB (-1.2 %)
    kept_logits = 0 with train.fused_loss (the default); 2 * Vd * E_seg without it (the
                                             # recompute path keeps every chunk's bf16 target logits);
                  with fused_loss and a trainable lm_head, 4 * Vd * H more (its gradient, summed over
                                             # the chunks in the forward)

``act_bytes_per_element`` counts, per decoder layer, the bf16/fp32 tensors autograd keeps
(two RMSNorms, q/k/v/o, the SwiGLU intermediates), plus the embedding, fc output and final
hidden state; it is 571,136 bytes for the GPT-OSS-20B shape. ``ALPHA`` and ``OMEGA`` are a
least-squares fit (relative error) to the peaks measured on one H200 in the eighth session
(``docs/benchmarks.md``; GPT-OSS-20B shape, Vd = 32,000, K = 8, r = 0.7, r_min = 0.2, chunk
8,192, lm_head frozen, ``train.compile``, the Triton chain kernels, ``train.fused_loss``)::

    N       S  measured GiB  model GiB  error
    2,048   1  17.2          17.1       -0.8 %
    4,096   1  20.6          20.7       +0.6 %
    8,192   1  26.6          26.7       +0.2 %
    16,384  1  38.9          39.0       +0.3 %
    32,768  1  63.6          63.7       +0.3 %
    65,536  2  83.3          82.6       -0.9 %
    65,536  1  112.9         113.2      +0.2 %
    8,192   1  27.6          28.3       +2.7 %   (fused_loss off; not in the fit)

(E_seg padded to a multiple of 1024.) giving ``ALPHA = 0.828`` (below 1: the chain kernels and
the fused loss keep less than the per-layer count; allocator rounding) and ``OMEGA = 2.618`` (2.812
before the ``2 Vd H`` head copy had its own term; refitted on the same points, the errors above unchanged
within 0.1 %).

Without ``train.compile`` the loss chunk body runs eagerly and keeps more at once: ``OMEGA_EAGER = 7.44``
fp32 ``[chunk, Vd]`` buffers, counted, not fitted. The eager body (``kernels.loss._fused_chunk``) holds at
its peak 6.44 of them: the log-probabilities, their exponent, the target's log-probabilities and
probabilities, the KL terms, the logit gradient and the bf16 logits. Its ``[Vd, H]`` head gradient is the
term above. The target's logits chunk beside it adds 1 (``tests/unit/test_planner.py`` counts the body's
live tensors on the CPU). First GPU point: the Llama-3.1-8B recipe's step on the cache (uncompiled, Vd = V =
128,256, head and embeddings trained, K = 10, S = 2, checkpointing, chunk 2,048, N = 3,788) measured
49.92 GB. The model without these terms predicted 41.48 GB (−16.9 %); with them it predicts 49.49 GB
(−0.9 %; docs/real_shapes.md).
Predictions on a 139.8 GiB H200 with the default ``headroom = 0.9`` (125.8 GiB): N = 65,536
fits at S = 1 (113.2 GiB); N = 131,072 needs S = 3 (124.6 GiB; not measured). The model is
calibrated on one shape; the per-element terms scale with the shape's widths, so other shapes
are an extrapolation (the ``headroom`` factor absorbs part of that).

Online features (``train.features: online``, :func:`predict_online_peak_bytes`): the frozen target runs in
the step, so its weights, its forward's transient and the features it returns join the drafter's step::

    peak_online = W_target + max(target phase, drafter phase)
    target phase  = static + grads + inputs + target_step    # train.prefetch: the next step's forward runs
                                                             # after this step's backward, before AdamW
    drafter phase = peak(N, S)                               # the model above (its inputs = this step's features)
    target_step   = largest forward transient (+ features of the micro-batch's earlier forwards):
                    attention M b ((A+3) T + (3 nh + 2 nkv) hd) + 3 scores + masks, scores = B nh n (n+1) b (eager)
                    mlp       M b ((A+4) T + k (T + 9 I)) + scores + masks   (mixture of experts; dense: 3 I)
                    head      M b (2A+1) T + (min(4096, M) + B) V b         (argmax chunk by chunk, target dtype)

(:func:`target_forward_peak_bytes`: M = B n padded tokens of one forward, b bytes per element of the target's
dtype.) Worked example: the GPT-OSS-20B recipe (``recipes/gpt-oss-20b.yaml``: drafter 4 layers, Vd = V =
201,088, lm_head and embeddings trainable, K = 10, S = 2, checkpointing, chunk 2,048) on a random-weight bf16
target (``gpt-oss-20b.json``: 20.91B parameters, eager attention, 2 mask kinds, k = 4) for one sequence of
N = n = 8,192 tokens: W = 38.96 GiB; static 17.84 + grads 5.23 + inputs 0.18 + target_step 24.72 (of which
3 x 8.0 GiB of eager scores) = 47.97 GiB; drafter phase 42.48 GiB (the recipe leaves ``train.compile`` off:
the loss chunk is eager; 35.08 compiled); peak 86.93 GiB (93.3 GB). At the
recipe's ``max_length`` of 12,288: 117.6 GiB, the eager scores alone 54 GiB. Not measured on a GPU yet.
"""
from __future__ import annotations

from dataclasses import dataclass

# the target forward's own memory model lives with regeneration's, which uses it too (data_prep does not import
# peagle_train); re-exported here, where the online step's prediction is assembled
from data_prep.target_memory import EAGER_SCORE_COPIES, TargetShape, target_forward_peak_bytes  # noqa: F401

ALPHA = 0.828
OMEGA = 2.618
#: fp32 [chunk, Vd] buffers of one loss chunk without train.compile: the eager chunk body's 6.44 at its peak
#: (counted from its live tensors, tests/unit/test_planner.py) + the target's logits chunk (module docstring)
OMEGA_EAGER = 7.44
GIB = 2**30


@dataclass(frozen=True)
class ShapeParams:
    """Drafter shape. ``aux_layers`` = A (3 tapped target layers); ``target_hidden_size`` = T."""

    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    draft_vocab_size: int
    target_hidden_size: int
    aux_layers: int = 3

    @classmethod
    def from_config(cls, cfg) -> "ShapeParams":
        """From a drafter ``LlamaConfig`` made by :func:`~peagle_train.model.drafter.make_drafter_config`."""
        return cls(cfg.hidden_size, cfg.intermediate_size, cfg.num_hidden_layers, cfg.num_attention_heads,
                   cfg.num_key_value_heads, cfg.head_dim, cfg.vocab_size, cfg.draft_vocab_size,
                   cfg.target_hidden_size, len(cfg.eagle_aux_hidden_state_layer_ids))

    def trainable_params(self, lm_head_trainable: bool = False) -> int:
        """Parameter count of the drafter except (by default) the lm_head; embeddings included."""
        H, I, hd = self.hidden_size, self.intermediate_size, self.head_dim
        q, kv = self.num_heads * hd, self.num_kv_heads * hd
        layer = lambda w, norms: w * (q + 2 * kv) + q * H + 3 * H * I + norms * H  # noqa: E731
        n = self.vocab_size * H + self.aux_layers * self.target_hidden_size * (H + 1)  # embed, fc, mask_hidden
        n += layer(2 * H, 3) + (self.num_layers - 1) * layer(H, 2) + H  # layers, final norm
        return n + (self.draft_vocab_size * H if lm_head_trainable else 0)

    def layer_act_bytes(self) -> int:
        """Saved activation bytes of one decoder layer per grid element (no checkpointing)."""
        H, I, hd = self.hidden_size, self.intermediate_size, self.head_dim
        return 16 * H + 8 * I + 2 * (self.num_heads + 2 * self.num_kv_heads) * hd + 4 * self.num_heads * hd

    def act_bytes_per_element(self, checkpointing: bool | str = False) -> int:
        """Saved activation bytes per grid element for the whole drafter (before ``ALPHA``); ``checkpointing``:
        ``train.activation_checkpointing`` (False, True or ``"selective"``: full checkpointing plus each layer's
        attention backward operands, q, k, v and the output in bf16 and the log-sum-exp in fp32, as measured on an
        H100 (module docstring); :mod:`peagle_train.kernels.selective_checkpoint`). Raises ValueError for another
        ``checkpointing``."""
        H, L = self.hidden_size, self.num_layers
        if checkpointing not in (False, True, "selective"):
            raise ValueError(f"checkpointing must be False, True or 'selective', got {checkpointing!r}")
        if checkpointing:  # selective: the kept bytes go through ALPHA too (module docstring: measured)
            full = L * 2 * H + 12 * H + self.layer_act_bytes()
            qkvo = 2 * (2 * self.num_heads + 2 * self.num_kv_heads) * self.head_dim
            kept = L * (qkvo + 4 * self.num_heads) if checkpointing == "selective" else 0
            return full + kept
        return L * self.layer_act_bytes() + 12 * H


@dataclass(frozen=True)
class Plan:
    """A step plan. Unpacks as ``S, checkpointing = plan``.

    Attributes:
        partitions: S. checkpointing: activation checkpointing of the decoder layers.
        predicted_peak_bytes: model peak of the plan. budget_bytes: what it had to fit under.
    """

    partitions: int
    checkpointing: bool | str
    predicted_peak_bytes: int
    budget_bytes: int

    def __iter__(self):
        return iter((self.partitions, self.checkpointing))


def expected_elements(N: int, K: int, r: float, r_min: float, max_anchors: int | None = None) -> float:
    """Expected grid elements for ``N`` loss-valid tokens: ``N * sum_{d<K} max(r**d, r_min)`` (COD, spec §3),
    each depth >= 1 capped at ``max_anchors``."""
    from peagle_train.peagle.grid import cod_fraction

    total = float(N)
    for d in range(1, K):
        c = N * cod_fraction(d, r, r_min)  # the expectation: no floor, unlike grid.cod_keep_counts
        total += min(c, max_anchors) if max_anchors is not None else c
    return total


def segment_elements(N: int, S: int, E: float, pad_multiple: int = 1024) -> int:
    """Expected elements of the largest segment (the last): ``E/S`` owned + ``N (S-1)/S`` context, padded."""
    e = E / S + N * (S - 1) / S
    return int(-(-e // pad_multiple) * pad_multiple)


def static_bytes(shape: ShapeParams, lm_head_trainable: bool = False, target_head_bytes: int = 2) -> int:
    """The drafter's step-long bytes (module docstring ``static``): ``12 * P_trainable`` (fp32 weights, AdamW
    m and v) + a frozen fp32 lm_head ``4 * Vd * H`` + the frozen target head rows ``target_head_bytes * Vd * T``."""
    H, T, Vd = shape.hidden_size, shape.target_hidden_size, shape.draft_vocab_size
    frozen_head = 0 if lm_head_trainable else 4 * Vd * H  # a trainable head is among the 12-byte params
    return 12 * shape.trainable_params(lm_head_trainable) + frozen_head + target_head_bytes * Vd * T


def input_bytes(N: int, shape: ShapeParams) -> int:
    """One packed micro-batch's features on the device (module docstring ``inputs``): bf16 ``aux [N, A*T]``
    and ``last [N, T]``, ``N * (A + 1) * T * 2`` bytes."""
    return N * (shape.aux_layers + 1) * shape.target_hidden_size * 2


def predict_peak_bytes(N: int, S: int, shape: ShapeParams, K: int = 8, r: float = 0.7, r_min: float = 0.2, *,
                       checkpointing: bool | str = False, chunk: int = 8192, lm_head_trainable: bool = False,
                       target_head_bytes: int = 2, max_anchors: int | None = None, fused_loss: bool = True,
                       grads_resident: bool | None = None, compiled_loss: bool = True) -> int:
    """Predicted peak allocated bytes of one step (module docstring model).

    Args:
        N: tokens in the sequence (all loss-valid: the worst case). S: partitions.
        shape: the drafter's :class:`ShapeParams`. K, r, r_min, max_anchors: COD settings.
        checkpointing: activation checkpointing of the decoder layers (False, True or ``"selective"``).
            chunk: loss chunk (elements).
        lm_head_trainable: whether the lm_head gets grads and AdamW state.
        target_head_bytes: bytes per element of the frozen target head rows (2 bf16, 4 fp32).
        fused_loss: ``train.fused_loss`` (False adds the recompute path's kept target logits).
        grads_resident: whether gradients already exist while the peak segment runs (None:
            exactly when ``S > 1``; pass True when one step has several micro-batches).
        compiled_loss: the loss chunk body is compiled (``train.compile``): ``OMEGA`` buffers per chunk,
            else ``OMEGA_EAGER``.

    Returns:
        bytes (int).
    """
    E = expected_elements(N, K, r, r_min, max_anchors)
    H, Vd = shape.hidden_size, shape.draft_vocab_size
    static = static_bytes(shape, lm_head_trainable, target_head_bytes)
    resident = S > 1 if grads_resident is None else grads_resident
    grads = 4 * shape.trainable_params(lm_head_trainable) if resident else 0
    workspace = (OMEGA if compiled_loss else OMEGA_EAGER) * 4 * min(chunk, E) * Vd
    # the head in bf16 for the chunk loop (the fused loop's copy, or autocast's cached cast on the recompute path),
    # and on the fused path a trainable head's per-chunk gradient before it is summed
    workspace += 2 * Vd * H + (4 * Vd * H if fused_loss and lm_head_trainable else 0)
    inputs = input_bytes(N, shape)
    E_seg = segment_elements(N, S, E)
    act = ALPHA * shape.act_bytes_per_element(checkpointing) * E_seg
    kept_logits = 0 if fused_loss else 2 * Vd * E_seg
    head_grad = 4 * Vd * H if (fused_loss and lm_head_trainable) else 0  # the fused path's head-gradient buffer
    return int(static + grads + workspace + inputs + act + kept_logits + head_grad)


def online_feature_bytes(M: int, t: TargetShape) -> int:
    """Bytes of the features a target forward of ``M`` padded tokens returns and the trainer holds: ``aux
    [M, A*T]`` and ``last [M, T]`` in the target's dtype, ``argmax [M]`` int64: ``M ((A + 1) T b + 8)``
    (a sequence's features are views of its padded forward's outputs, so the padding is held too)."""
    return M * ((t.aux_layers + 1) * t.hidden_size * t.dtype_bytes + 8)


def target_forwards(lengths: list[int], batch_tokens: int) -> tuple[tuple[int, int], ...]:
    """``(rows B, padded length n)`` of each target forward :class:`~peagle_train.features.online.OnlineFeatures`
    runs for a micro-batch of sequences of ``lengths`` (:func:`~peagle_train.features.online.length_batches`
    with ``batch_tokens``), in the order it runs them.

    Example: ``target_forwards([5, 100, 7, 90], 200)`` → ``((2, 100), (2, 7))``.
    """
    from peagle_train.features.online import length_batches

    return tuple((len(b), lengths[b[0]]) for b in length_batches(lengths, batch_tokens))


def target_step_peak_bytes(forwards, t: TargetShape, head_chunk: int | None = 4096) -> int:
    """Peak bytes of one micro-batch's online features (weights not included): the forwards run one after
    the other, each while the features of the earlier ones are held (``OnlineFeatures.get``)::

        max_j  target_forward_peak_bytes(B_j, n_j) + online_feature_bytes(sum_{i<j} B_i n_i)

    Args:
        forwards: ``(B, n)`` per forward (:func:`target_forwards`). t: the target. head_chunk: as
            :func:`target_forward_peak_bytes`.
    """
    peak, held = 0, 0
    for B, n in forwards:
        peak = max(peak, target_forward_peak_bytes(B, n, t, head_chunk) + held)
        held += online_feature_bytes(B * n, t)
    return peak


@dataclass(frozen=True)
class OnlineStep:
    """How the online target runs in an optimizer step, for :func:`predict_online_peak_bytes`.

    Attributes:
        target: the :class:`TargetShape`. forwards: ``(B, n)`` of each target forward of the micro-batch
            (:func:`target_forwards`). prefetch: the next step's forward runs right after this step's backward
            (``train.prefetch`` with one micro-batch per step: ``Trainer._launch_online_features``); False: each
            step's forwards run at its start. micro_batches: per optimizer step (``grad_accum``; prefetch needs
            1). head_chunk: positions per head matmul (``Target.greedy_tokens``; None: a sharded head).
    """

    target: TargetShape
    forwards: tuple[tuple[int, int], ...]
    prefetch: bool = True
    micro_batches: int = 1
    head_chunk: int | None = 4096


def predict_online_peak_bytes(N: int, S: int, shape: ShapeParams, online: OnlineStep, K: int = 8, r: float = 0.7,
                              r_min: float = 0.2, *, checkpointing: bool | str = False, chunk: int = 8192,
                              lm_head_trainable: bool = False, target_head_bytes: int = 2,
                              max_anchors: int | None = None, fused_loss: bool = True,
                              grads_resident: bool | None = None, compiled_loss: bool = True) -> int:
    """Predicted peak allocated bytes of one optimizer step with online features: the target's weights plus
    the larger of the step's two phases (bytes)::

        peak     = weight_bytes + max(target, drafter)
        target   = static + grads + inputs + target_step       with prefetch (after the backward, before AdamW)
                 = static + grads? + (G - 1) inputs + target_step   without (the step's start; grads only where
                                                                     grads_resident is True, e.g. DDP)
        drafter  = predict_peak_bytes(N, S, ...) + (G - 1) inputs
        target_step = target_step_peak_bytes(online.forwards)   (forward transients + earlier forwards' features)

    ``static`` = :func:`static_bytes`, ``grads`` = ``4 P_trainable``, ``inputs`` = :func:`input_bytes` (one
    micro-batch's packed features), ``G`` = ``online.micro_batches`` (the trainer computes every micro-batch's
    features before the first forward and holds them through the step). With prefetch the features of the next
    step are computed while this step's packed features, gradients and AdamW state are alive; the drafter
    phase holds only this step's features (the prefetched ones are taken before its forward and packed).

    Approximations: the drafter phase is :func:`predict_peak_bytes` (fitted, module docstring); the target
    phase pairs a micro-batch's own forwards with its inputs (the prefetched forward is the next step's:
    the max over a run's steps differs by at most one step's ``inputs``); the fused AdamW step and the
    gradient clipping allocate no full-size buffers and are left out.

    Args:
        N, S, shape, K, r, r_min, checkpointing, chunk, lm_head_trainable, target_head_bytes, max_anchors,
            fused_loss, grads_resident, compiled_loss: as :func:`predict_peak_bytes` (the drafter step).
        online: :class:`OnlineStep`.

    Returns:
        bytes (int).

    Raises:
        ValueError: ``online.prefetch`` with several micro-batches (the trainer prefetches only with one).
    """
    if online.prefetch and online.micro_batches > 1:
        raise ValueError(f"prefetch needs one micro-batch per step (got {online.micro_batches})")
    drafter = predict_peak_bytes(N, S, shape, K, r, r_min, checkpointing=checkpointing, chunk=chunk,
                                 lm_head_trainable=lm_head_trainable, target_head_bytes=target_head_bytes,
                                 max_anchors=max_anchors, fused_loss=fused_loss, grads_resident=grads_resident,
                                 compiled_loss=compiled_loss)
    others = (online.micro_batches - 1) * input_bytes(N, shape)  # the step's other micro-batches' features
    grads = 4 * shape.trainable_params(lm_head_trainable)
    if online.prefetch:  # after this step's backward: its gradients and packed features are alive
        held = grads + input_bytes(N, shape)
    else:  # at the step's start: the gradients were freed by zero_grad unless kept (DDP's buckets)
        held = grads if grads_resident else 0
    held += static_bytes(shape, lm_head_trainable, target_head_bytes) + others
    target = held + target_step_peak_bytes(online.forwards, online.target, online.head_chunk)
    return online.target.weight_bytes + max(target, drafter + others)


def plan_step(N: int, K: int, r: float, r_min: float, shape: ShapeParams, gpu_bytes: int, *, chunk: int = 8192,
              max_partitions: int = 8, allow_checkpointing: bool = True, headroom: float = 0.9,
              lm_head_trainable: bool = False, target_head_bytes: int = 2, max_anchors: int | None = None,
              fused_loss: bool = True, grads_resident: bool | None = None, online: OnlineStep | None = None,
              compiled_loss: bool = True, checkpointing: bool | str | None = None) -> Plan:
    """The fewest partitions ``S`` whose predicted peak fits ``headroom * gpu_bytes``.

    Tries ``S = 1..max_partitions`` without checkpointing first; only if none fits, the same
    with activation checkpointing (if allowed). ``checkpointing`` True, False or ``"selective"`` instead plans with that setting
    only (the recipe's ``train.activation_checkpointing`` decided already). With ``online`` (features computed by the target in the
    step) the peak is :func:`predict_online_peak_bytes`, the target's weights included; otherwise
    :func:`predict_peak_bytes`.

    Args:
        N: tokens per sequence. K, r, r_min, max_anchors: COD settings. shape: :class:`ShapeParams`.
        gpu_bytes: device memory in bytes (e.g. ``torch.cuda.get_device_properties(0).total_memory``).
        chunk: loss chunk. max_partitions: largest S tried (capped at N). allow_checkpointing: may
            fall back to checkpointing (ignored when ``checkpointing`` is given). headroom: usable fraction of ``gpu_bytes`` (allocator
            fragmentation, CUDA context, model error). lm_head_trainable, target_head_bytes,
            fused_loss, grads_resident, compiled_loss: as :func:`predict_peak_bytes`. online: :class:`OnlineStep`
            or None. checkpointing: None (off, then on if allowed) or the one setting to plan with.

    Returns:
        :class:`Plan` (unpacks as ``S, checkpointing``).

    Raises:
        ValueError: ``N < 1``, ``gpu_bytes <= 0`` or ``headroom`` outside ``(0, 1]``; or no plan fits
            (the message gives the smallest predicted peak and the budget).
    """
    if N < 1 or gpu_bytes <= 0 or not 0 < headroom <= 1:
        raise ValueError(f"plan_step needs N >= 1, gpu_bytes > 0, 0 < headroom <= 1 (got {N}, {gpu_bytes}, {headroom})")
    budget = int(headroom * gpu_bytes)
    s_max = max(1, min(max_partitions, N))
    best = None
    modes = [checkpointing] if checkpointing is not None else ([False, True] if allow_checkpointing else [False])
    for ckpt in modes:
        for S in range(1, s_max + 1):
            kw = dict(checkpointing=ckpt, chunk=chunk, lm_head_trainable=lm_head_trainable,
                      target_head_bytes=target_head_bytes, max_anchors=max_anchors, fused_loss=fused_loss,
                      grads_resident=grads_resident, compiled_loss=compiled_loss)
            peak = (predict_peak_bytes(N, S, shape, K, r, r_min, **kw) if online is None
                    else predict_online_peak_bytes(N, S, shape, online, K, r, r_min, **kw))
            if peak <= budget:
                return Plan(S, ckpt, peak, budget)
            best = peak if best is None else min(best, peak)
    if True in modes:
        tried, advice = "checkpointing", ""
    elif "selective" in modes:
        tried = "selective checkpointing"
        advice = "set train.activation_checkpointing: true (less memory than selective), "
    else:
        tried, advice = "no checkpointing", "turn on activation checkpointing, "
    raise ValueError(
        f"no plan fits N={N}: the smallest predicted peak ({best / GIB:.1f} GiB with S <= {s_max}, {tried}) "
        f"exceeds the budget {budget / GIB:.1f} GiB ({headroom:.0%} of {gpu_bytes / GIB:.1f} GiB); raise "
        f"max_partitions, {advice}shorten the sequence or use more memory")


def partitions_for(N: int, K: int, r: float, r_min: float, shape: ShapeParams, gpu_bytes: int | None, *,
                   chunk: int = 8192, max_anchors: int | None = None, headroom: float = 0.9,
                   fused_loss: bool = True, grads_resident: bool | None = None, lm_head_trainable: bool = False,
                   target_head_bytes: int = 2, online: OnlineStep | None = None, compiled_loss: bool = True,
                   checkpointing: bool | str = False) -> int:
    """``train.partitions: auto`` for one micro-batch of ``N`` packed tokens: the fewest segments
    :func:`plan_step` predicts to fit ``gpu_bytes`` with activation checkpointing as the recipe sets it
    (``checkpointing``: ``train.activation_checkpointing``; it never turns checkpointing on by itself).
    ``gpu_bytes`` None (no GPU) → 1.
    ``fused_loss``, ``grads_resident``, ``lm_head_trainable``, ``target_head_bytes``, ``compiled_loss``: as
    :func:`predict_peak_bytes` (the trainer passes ``grads_resident=True`` when a step has several
    micro-batches or several processes); ``online``: the online target (:class:`OnlineStep`; its
    weights, forward and features are then inside the prediction, so ``gpu_bytes`` is the whole GPU).

    Raises:
        ValueError: from :func:`plan_step` when even 8 segments do not fit (the message gives the
            predicted peak and the budget).
    """
    if gpu_bytes is None:
        return 1
    return plan_step(N, K, r, r_min, shape, gpu_bytes, chunk=chunk, checkpointing=checkpointing,
                     max_anchors=max_anchors, headroom=headroom, fused_loss=fused_loss,
                     grads_resident=grads_resident, lm_head_trainable=lm_head_trainable,
                     target_head_bytes=target_head_bytes, online=online, compiled_loss=compiled_loss).partitions
