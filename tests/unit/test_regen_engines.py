"""The HF backend's regeneration engines (issue 19): continuous batching (``regen.engine: continuous``,
``data_prep/regenerate_cb.py``) and ``generate`` with a static cache (``regen.engine: static``) are
token-identical to plain ``generate`` on the real SmolLM2-135M in float32 on CPU; its sampling settings are honoured or refused; the engine choice; the memory check
(``data_prep/regen_memory.py``) with a fake free-memory figure, and prepare refusing before any shard
is generated.
"""
from __future__ import annotations

import copy
from pathlib import Path

import pytest
from conftest import need_smollm2

from data_prep.config import RegenConfig
from data_prep.regen_memory import (PAGE_TOKENS, RegenMemoryError, fit_regen_memory, kv_bytes_per_token,
                                   prefill_bytes_per_row)

pytestmark = pytest.mark.usefixtures("torch_single_thread")  # tiny CPU matmuls: one thread is faster under load

RECIPE = Path(__file__).resolve().parents[2] / "recipes" / "smollm2-135m.yaml"
QUESTIONS = [  # varied prompt lengths; some answers end before the cap, some are cut by it
    "Hi",
    "2+2?",
    "What is the capital of France? Answer in one word.",
    "List three prime numbers.",
    "Write a haiku about the sea and the moon and explain it in detail.",
    "Explain how a transformer neural network works, step by step, including attention, residual connections, "
    "layer normalisation, the feed-forward blocks and how the output distribution over the vocabulary is formed.",
]


@pytest.fixture(scope="module")
def smollm2():
    need_smollm2()
    from peagle_train.features.target import load_target
    from peagle_train.recipe import load_config

    cfg = load_config(str(RECIPE), [])
    return cfg, load_target(cfg.target)


def _jobs(tokenizer):
    from data_prep.template import build_prompt_ids

    return [(k, 0, [], build_prompt_ids(tokenizer, [{"role": "user", "content": q}])) for k, q in enumerate(QUESTIONS)]


def _run(target, regen: RegenConfig, jobs):
    from data_prep.regenerate import hf_engine

    complete, engine = hf_engine(target.model, target.tokenizer, regen)
    return engine, dict(complete(jobs))


def test_continuous_batching_and_static_cache_are_token_identical_to_generate(smollm2):
    cfg, target = smollm2
    jobs = _jobs(target.tokenizer)
    regen = cfg.regen.model_copy(update={"max_new_tokens": 32, "do_sample": False})
    # the reference: plain generate as prepare runs it (one left-padded batch); and, for the two short
    # answers (a few steps each on a loaded 2-core box), one prompt at a time: no padding, nothing else in the batch
    _, ref_all = _run(target, regen.model_copy(update={"engine": "generate", "batch_size": len(jobs)}), jobs)
    _, alone = _run(target, regen.model_copy(update={"engine": "generate", "batch_size": 1}), jobs[:2])
    engine, cont = _run(target, regen.model_copy(update={"engine": "continuous", "batch_size": len(jobs)}), jobs)
    assert engine == "continuous"
    assert target.model.config._attn_implementation == "sdpa"  # given back after the engine ran
    # static cache: prompts left-padded to a multiple of 128 tokens (more padding than generate's), two batches
    engine, static = _run(target, regen.model_copy(update={"engine": "static", "batch_size": 3}), jobs)
    assert engine == "static"
    assert [static[i].token_ids for i in range(len(jobs))] == [ref_all[i].token_ids for i in range(len(jobs))]
    assert [alone[i].token_ids for i in range(2)] == [ref_all[i].token_ids for i in range(2)]
    # static cache in segments of 8 tokens, 4 rows at a time: finished rows leave, waiting prompts join
    engine, segmented = _run(target, regen.model_copy(update={"engine": "static", "batch_size": 4,
                                                              "segment_tokens": 8}), jobs)
    assert engine == "static"
    for i in range(len(jobs)):
        assert (segmented[i].token_ids, segmented[i].finished) == (ref_all[i].token_ids, ref_all[i].finished), i
    # and with regen.refill_at: a call of 16 tokens ends once half its rows are done, the free places refilled
    _, refilled = _run(target, regen.model_copy(update={"engine": "static", "batch_size": 4, "segment_tokens": 16,
                                                        "refill_at": 0.5}), jobs)
    for i in range(len(jobs)):
        assert (refilled[i].token_ids, refilled[i].finished) == (ref_all[i].token_ids, ref_all[i].finished), i
    # and with regen.keep_kv: rows that go on keep their KV cache, only new rows are prefilled (data_prep/kv_carry.py)
    _, kept = _run(target, regen.model_copy(update={"engine": "static", "batch_size": 4, "segment_tokens": 8,
                                                    "keep_kv": True}), jobs)
    for i in range(len(jobs)):
        assert (kept[i].token_ids, kept[i].finished) == (ref_all[i].token_ids, ref_all[i].finished), i
    for i, (k, _, _, prompt) in enumerate(jobs):
        ref = ref_all[i]
        assert cont[i].token_ids == ref.token_ids, (f"prompt {k} ({len(prompt)} tokens): continuous batching "
                                                    f"{cont[i].token_ids} != generate {ref.token_ids}")
        assert (cont[i].text, cont[i].tokens, cont[i].finished) == (ref.text, ref.tokens, ref.finished)
    finished = [c.finished for c in cont.values()]
    assert any(finished) and not all(finished)  # both an end-of-turn stop and a cut at the cap were compared
    eot = target.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert all(c.token_ids[-1] == eot for c in cont.values() if c.finished)  # the end-of-turn token is counted


def test_continuous_sampling_is_seeded_and_unsupported_processors_are_refused(smollm2):
    from data_prep.regenerate_cb import generation_config

    cfg, target = smollm2
    jobs = _jobs(target.tokenizer)[:2]
    regen = cfg.regen.model_copy(update={"engine": "continuous", "max_new_tokens": 6, "do_sample": True,
                                         "temperature": 0.8, "top_p": 0.9, "seed": 3})
    gc = generation_config(target.model, regen, [2], 2)
    assert (gc.do_sample, gc.temperature, gc.top_p, gc.top_k, gc.max_new_tokens) == (True, 0.8, 0.9, 0, 6)
    a, b = _run(target, regen, jobs)[1], _run(target, regen, jobs)[1]
    assert [a[i].token_ids for i in range(2)] == [b[i].token_ids for i in range(2)]  # same seed, same samples
    saved = copy.deepcopy(target.model.generation_config)
    target.model.generation_config.repetition_penalty = 1.3  # a processor continuous batching cannot apply
    try:
        with pytest.raises(ValueError, match="RepetitionPenalty.*regen.engine: generate"):
            _run(target, regen.model_copy(update={"do_sample": False}), jobs)
    finally:
        target.model.generation_config = saved
    assert target.model.config._attn_implementation == "sdpa"


def test_engine_choice(smollm2, tiny_llama_config):
    from data_prep.regenerate import resolve_engine

    cfg, target = smollm2
    assert resolve_engine(target.model, cfg.regen) == "generate"  # auto on CPU
    assert resolve_engine(target.model, cfg.regen.model_copy(update={"engine": "continuous"})) == "continuous"

    class NoPaged:  # a model whose attention cannot be paged
        _supports_attention_backend = False
        init_continuous_batching = None

    with pytest.raises(ValueError, match="regen.engine: continuous.*NoPaged.*regen.engine: static or generate"):
        resolve_engine(NoPaged(), RegenConfig(engine="continuous"))
    with pytest.raises(ValueError, match="regen.engine is a setting of regen.backend: hf"):
        RegenConfig(backend="vllm", engine="continuous")
    with pytest.raises(ValueError, match="regen.kv_blocks"):
        RegenConfig(backend="vllm", kv_blocks=8)
    assert RegenConfig().max_new_tokens == 2048 and RegenConfig().engine == "auto"


def test_auto_engine_on_cuda_needs_flash_attention_for_continuous_batching(monkeypatch):
    """On CUDA, ``auto`` is continuous batching only where a flash attention kernel serves it (without one,
    transformers attends over the whole batch's keys with a dense mask), else the static-cache generate."""
    import torch
    from transformers.utils import import_utils

    from data_prep.regenerate import resolve_engine

    class Cfg:
        _attn_implementation = "sdpa"

    class OnCuda:  # resolve_engine reads the device, the attention implementation and the paging support
        device = torch.device("cuda")
        config = Cfg()
        _supports_attention_backend = True
        init_continuous_batching = None

    for name in ("is_flash_attn_2_available", "is_flash_attn_3_available"):
        monkeypatch.setattr(import_utils, name, lambda *a, **k: False, raising=False)
    assert resolve_engine(OnCuda(), RegenConfig()) == "static"
    monkeypatch.setattr(import_utils, "is_flash_attn_2_available", lambda *a, **k: True, raising=False)
    assert resolve_engine(OnCuda(), RegenConfig()) == "continuous"
    monkeypatch.setattr(import_utils, "is_flash_attn_2_available", lambda *a, **k: False, raising=False)
    OnCuda.config._attn_implementation = "flash_attention_2"  # loaded with flash attention already
    assert resolve_engine(OnCuda(), RegenConfig()) == "continuous"
    assert resolve_engine(OnCuda(), RegenConfig(engine="static")) == "static"


# -- memory check, with a fake free-memory figure ---------------------------------------------------------
GIB = 1024 ** 3


def test_kv_bytes_per_token_from_the_config(tiny_llama_config):
    c = tiny_llama_config(num_hidden_layers=4, num_key_value_heads=2, hidden_size=32, num_attention_heads=4)
    assert kv_bytes_per_token(c, 4) == 4 * 2 * 2 * 8 * 4
    smol = tiny_llama_config(num_hidden_layers=30, num_key_value_heads=3, hidden_size=576, num_attention_heads=9)
    assert kv_bytes_per_token(smol, 2) == 30 * 2 * 3 * 64 * 2  # SmolLM2-135M in bf16: 23,040 bytes/token


def test_generate_batch_is_reduced_or_refused_before_generation(tiny_llama_config):
    c = tiny_llama_config(num_hidden_layers=30, num_key_value_heads=3, hidden_size=576, num_attention_heads=9,
                          vocab_size=49152)
    per_seq = (512 + 2048) * kv_bytes_per_token(c, 4) + 49152 * 4 + prefill_bytes_per_row(c, 4, 512, None)  # 127 MB
    cfg = RegenConfig(engine="generate", max_new_tokens=2048, batch_size=512)
    same, note = fit_regen_memory(cfg, c, 4, "generate", 512, free_bytes=200 * GIB)
    assert same is cfg and note is None
    small, note = fit_regen_memory(cfg, c, 4, "generate", 512, free_bytes=10 * GIB)
    assert small.batch_size == int(10 * GIB * 0.9) // per_seq < 512 and cfg.batch_size == 512
    assert "regen.batch_size 512" in note and f"batch_size {small.batch_size} instead" in note and "GiB free" in note
    with pytest.raises(RegenMemoryError, match="one sequence.*regen.max_new_tokens"):
        fit_regen_memory(cfg, c, 4, "generate", 512, free_bytes=per_seq // 2)
    assert fit_regen_memory(cfg, c, 4, "generate", 512, free_bytes=None) == (cfg, None)  # unknown: not checked
    # static: the cache holds the prompt bucket (500 → 512 tokens) + the cap for every sequence from the start
    static = cfg.model_copy(update={"engine": "static"})
    fitted, _ = fit_regen_memory(static, c, 4, "static", 500, free_bytes=10 * GIB)
    assert fitted.batch_size == int(10 * GIB * 0.9) // per_seq


def test_eager_attention_prefill_is_counted(tmp_path):
    """GPT-OSS-20B runs eager attention (its sinks): a prefill of B prompts of P tokens holds 3 score tensors
    of ``B × 64 × P × (P + 1)`` bf16 values. The run that met this on an H200 (regen.batch_size 64,
    data.max_prompt_tokens 2,048, ~97 GB free beside the weights) died asking for 32.02 GiB; the check now
    reduces the batch first and says why. An SDPA target of the same shape keeps a much larger batch."""
    from peagle_train.features.target import random_target_config

    c = random_target_config("pkg:peagle_train/gpt-oss-20b.json")
    scores = 64 * 2048 * 2049 * 2  # one row's [64 heads, P, P + 1] bf16 scores
    assert abs(64 * scores / GIB - 32.02) < 0.01  # the allocation the OOM named at batch 64
    eager = prefill_bytes_per_row(c, 2, 2048, "eager")
    assert eager >= 3 * scores and eager > 3 * prefill_bytes_per_row(c, 2, 2048, "sdpa")
    cfg = RegenConfig(engine="generate", max_new_tokens=256, batch_size=64)
    fitted, note = fit_regen_memory(cfg, c, 2, "generate", 2048, free_bytes=97 * 10 ** 9, attn_implementation="eager")
    per_seq = (2048 + 256) * kv_bytes_per_token(c, 2) + c.vocab_size * 4 + eager
    assert fitted.batch_size == int(97 * 10 ** 9 * 0.9) // per_seq < 64
    assert "eager attention scores" in note and "batch_size 64" in note
    assert fitted.batch_size * (3 * scores) + 42 * 10 ** 9 < 139 * 10 ** 9  # the scores of the reduced batch fit
    sdpa, _ = fit_regen_memory(cfg, c, 2, "generate", 2048, free_bytes=97 * 10 ** 9, attn_implementation="sdpa")
    assert sdpa.batch_size == 64  # no score tensor: the same batch fits


def test_continuous_kv_budget_is_checked(tiny_llama_config):
    c = tiny_llama_config(num_hidden_layers=30, num_key_value_heads=3, hidden_size=576, num_attention_heads=9)
    per_tok = kv_bytes_per_token(c, 2)
    cfg = RegenConfig(engine="continuous", max_new_tokens=2048, kv_blocks=4)  # 1,024 tokens < 512 + 2,048
    with pytest.raises(RegenMemoryError, match="regen.kv_blocks=4 holds 1,024 tokens.*at least 10"):
        fit_regen_memory(cfg, c, 2, "continuous", 512, free_bytes=None)
    big = cfg.model_copy(update={"kv_blocks": 100_000})  # 25.6M tokens: 550 GiB at bf16
    fitted, note = fit_regen_memory(big, c, 2, "continuous", 512, free_bytes=80 * GIB)
    assert fitted.kv_blocks == int(80 * GIB * 0.9) // (PAGE_TOKENS * per_tok) and "kv_blocks 100000" in note
    auto = cfg.model_copy(update={"kv_blocks": None})  # sized by transformers from the free memory: fits
    assert fit_regen_memory(auto, c, 2, "continuous", 512, free_bytes=80 * GIB) == (auto, None)
    with pytest.raises(RegenMemoryError, match="one sequence.*regen.kv_memory_fraction"):
        fit_regen_memory(auto, c, 2, "continuous", 512, free_bytes=(512 + 2048) * per_tok)


def test_prepare_refuses_a_cap_that_cannot_fit_before_any_shard(smollm2, tmp_path, monkeypatch):
    import data_prep.regenerate as R
    from peagle_train.core.config import ConfigError
    from peagle_train.recipe import load_config
    from peagle_train.stages import run_prepare

    monkeypatch.setattr(R, "free_memory_bytes", lambda device: 50 * 1024 ** 2)  # 50 MiB "free"
    monkeypatch.setattr(R, "regenerate", lambda *a, **k: pytest.fail("generation started"))
    cfg = load_config(str(RECIPE), [f"output_dir={tmp_path / 'run'}", "data.num_conversations=3",
                                    "regen.max_new_tokens=100000", "regen.batch_size=2"])
    with pytest.raises(ConfigError, match="smollm2-135m.yaml.*one sequence.*GiB.*regen.max_new_tokens"):
        run_prepare(cfg, progress=False)
    assert not list((tmp_path / "run" / "data" / "regen").glob("*.json"))


def test_segmented_static_generation_equals_one_call_to_the_cap(tiny_llama_config, monkeypatch):
    """``_generate_segmented`` (``regen.segment_tokens``): rows leave at their end-of-turn token or the cap and
    waiting prompts take their places, rows that go on are prefilled again with their tokens so far; every
    answer equals one left-padded ``generate`` call to the cap, whatever the segment (float32 with SDPA: float64
    eager attention gives NaN on left padding in transformers, and this model's logit gaps, ~1e-3, are far
    above float32 rounding): the end-of-turn
    token counted, a row cut by the cap with exactly ``cap`` tokens, an end-of-turn token after the cap not
    counted, every job once; with ``regen.refill_at`` too, where calls end early (fewer row-steps decoded)."""
    from conftest import tiny_generator, varied_eos

    from data_prep import regen_memory
    from data_prep.regenerate import _generate_batch, _generate_segmented

    model, prompts = tiny_generator(1, (5, 9, 2, 14, 7, 3, 11))
    cap, kw = 13, {"do_sample": False}
    free = _generate_batch(model, prompts, 0, [1], {**kw, "max_new_tokens": cap})  # no row ends (id 1 unused)
    # an end-of-turn id that some rows reach at different depths, one of them only after the cap
    eos = varied_eos(free)
    ref = _generate_batch(model, prompts, 0, [eos], {**kw, "max_new_tokens": cap})
    assert any(f for _, f in ref) and not all(f for _, f in ref)
    order = sorted(range(len(prompts)), key=lambda i: -len(prompts[i]))
    generate, shapes = model.generate, []

    def recording(**kwargs):
        out = generate(**kwargs)  # [B, L + decoded]
        shapes.append((*kwargs["input_ids"].shape, kwargs["max_new_tokens"], out.shape[1] - kwargs["input_ids"].shape[1]))
        return out

    model.generate = recording
    monkeypatch.setattr(regen_memory, "SEGMENT_LENGTH_BUCKET", 4)  # the tiny prompts need a tiny length bucket
    work = {}
    for segment, batch, refill in ((3, 3, None), (5, 4, None), (13, 2, None), (40, 8, None), (2, 16, None),
                                   (40, 4, None), (40, 4, 0.25), (40, 4, 0.5), (13, 8, 1.0), (40, 8, 0.5)):
        shapes.clear()
        out = list(_generate_segmented(model, prompts, order, 0, [eos], kw, 1, batch, cap, segment, refill_at=refill))
        # few shapes for a compiled decoding step: rows a power of two (or the batch) and at least batch / 8,
        # lengths a multiple of max(segment, the length bucket), every call min(segment, cap) new tokens
        step = max(segment, 4)
        assert all((b == batch or b & (b - 1) == 0) and batch // 8 <= b <= batch and L % step == 0
                   and n == min(segment, cap) for b, L, n, _ in shapes), shapes
        assert sorted(i for i, _, _ in out) == list(range(len(prompts))), (segment, batch)
        got = {i: (new, fin) for i, new, fin in out}
        for i, (new, fin) in enumerate(ref):
            assert got[i] == (new, fin), (segment, batch, refill, i)
            assert len(new) <= cap and (fin or len(new) == cap)
        work[segment, batch, refill] = sum(b * t for b, _, _, t in shapes)  # row-steps decoded
    # refill_at: a call ends once its share of rows is done, so fewer places decode after their row finished
    assert work[40, 4, 0.25] < work[40, 4, None] and work[40, 4, 0.5] <= work[40, 4, None], work


def test_a_call_ends_once_its_share_of_rows_is_done():
    """``_EndsWhenShareDone`` (``regen.refill_at``): a row is done at an end-of-turn token (remembered after it:
    generate pads a finished row) or once it produced its ``tokens_left``; rows after ``tokens_left``'s (padding
    copies) never count; the call ends at ``ceil(share x rows)`` done rows (0.3 x 10 rows is 3)."""
    import torch

    from data_prep.regenerate import _EndsWhenShareDone

    eos, pad = 7, 0
    crit = _EndsWhenShareDone(0.5, [5, 2, 9, 9], [eos])  # 4 real rows and 2 padding copies: 2 done rows end it
    steps = [[3, 3, 3, 3, 7, 7], [7, 3, 3, 3, 7, 7], [pad, 3, 3, 3, 7, 7]]  # the token each row produced
    ids = torch.tensor([[1] * 6]).T
    said = []
    for tokens in steps:
        ids = torch.cat([ids, torch.tensor([tokens]).T], dim=1)  # [6, 1 + step]
        out = crit(ids, None)
        assert out.shape == (6,) and out.dtype == torch.bool and len(set(out.tolist())) == 1
        said.append(bool(out[0]))
    # step 1: padding copies at eos only; step 2: row 0 at eos and row 1 at its 2 tokens left
    assert said == [False, True, True]
    assert _EndsWhenShareDone(0.3, [9] * 10, [eos]).need == 3 and _EndsWhenShareDone(0.01, [9] * 3, [eos]).need == 1
    assert _EndsWhenShareDone(1.0, [9] * 3, [eos]).need == 3


def test_refill_at_is_a_setting_of_the_static_engine_in_segments(monkeypatch):
    from data_prep import regenerate as R

    with pytest.raises(ValueError, match="regen.refill_at works between the segments"):
        RegenConfig(refill_at=0.5)
    with pytest.raises(ValueError):
        RegenConfig(refill_at=0.0, segment_tokens=64)
    with pytest.raises(ValueError):
        RegenConfig(refill_at=1.5, segment_tokens=64)
    cfg = RegenConfig(refill_at=0.5, segment_tokens=64, engine="auto")
    monkeypatch.setattr(R, "resolve_engine", lambda model, cfg: "continuous")
    with pytest.raises(ValueError, match="regen.refill_at needs the static engine in segments.*continuous"):
        R.hf_engine(object(), object(), cfg)


def test_segment_tokens_is_an_hf_static_setting_and_its_memory_is_counted(tiny_llama_config):
    with pytest.raises(ValueError, match="regen.segment_tokens is a setting of regen.backend: hf"):
        RegenConfig(backend="vllm", segment_tokens=512)
    with pytest.raises(ValueError):
        RegenConfig(segment_tokens=4)  # fewer than 8 tokens a call: all prefill
    c = tiny_llama_config(num_hidden_layers=30, num_key_value_heads=3, hidden_size=576, num_attention_heads=9,
                          vocab_size=49152)
    cfg = RegenConfig(engine="static", max_new_tokens=2048, batch_size=512, segment_tokens=512)
    # the longest row goes on with 500 + 2,047 tokens, bucketed to 2,560 (a multiple of 512), plus one segment of 512
    per_seq = (2560 + 512) * kv_bytes_per_token(c, 2) + 49152 * 4 + prefill_bytes_per_row(c, 2, 2560, None)
    fitted, note = fit_regen_memory(cfg, c, 2, "static", 500, free_bytes=20 * GIB)
    assert fitted.batch_size == int(20 * GIB * 0.9) // per_seq and "batch_size 512" in note


def test_a_batch_that_runs_out_of_memory_in_generate_goes_on_in_halves(tiny_llama_config):
    """What the memory check could not foresee (e.g. a long re-prefill on PyTorch's math SDPA kernel, the cause
    of an out-of-memory on an H200 at batch 427 × 4,096 tokens in float32) costs one failed call, not the run:
    ``_FittingRows`` halves its row limit (for the rest of the run), says so and what to set, and the outputs
    equal one batch's; a single row that does not fit is an error naming what to lower."""
    import torch
    from conftest import tiny_generator

    from data_prep.regenerate import _FittingRows, _generate_batch, _generate_segmented

    model, prompts = tiny_generator(2, (5, 9, 2, 14, 7, 3, 11, 4))
    kw = {"do_sample": False, "max_new_tokens": 6}
    want = _generate_batch(model, prompts, 0, [1], kw)
    generate, calls = model.generate, []

    def small_memory(**kwargs):
        calls.append(kwargs["input_ids"].shape[0])
        if kwargs["input_ids"].shape[0] > 2:
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 21.89 GiB")
        return generate(**kwargs)

    model.generate = small_memory
    said = []
    rows = _FittingRows(8, log=said.append)
    assert rows(model, prompts, 0, [1], kw) == want
    assert calls == [8, 4, 2, 2, 2, 2] and rows.limit == 2
    assert len(said) == 2 and "ran out of accelerator memory on 8 rows" in said[0]
    assert "set regen.batch_size: 2" in said[1]
    calls.clear()
    assert rows(model, prompts[:4], 0, [1], kw) == want[:4] and calls == [2, 2]  # the limit stays
    # the segmented engine goes through the same rows
    out = {i: new for i, new, _ in _generate_segmented(model, prompts, list(range(8)), 0, [1], {"do_sample": False},
                                                       1, 8, 6, 8, generate_rows=_FittingRows(8, log=said.append))}
    assert [out[i] for i in range(8)] == [new for new, _ in want]
    model.generate = lambda **kwargs: (_ for _ in ()).throw(torch.OutOfMemoryError("CUDA out of memory"))
    with pytest.raises(torch.OutOfMemoryError, match="one row of 14 prompt tokens does not fit.*lower data.max_prompt"):
        _FittingRows(1, log=said.append)(model, prompts[3:4], 0, [1], kw)


def test_segment_shapes_stay_few():
    """The shapes a segmented static run meets: widths a power of two between batch / 8 and the batch, lengths
    a multiple of max(bucket, segment, 512) -- over a 2,048-token prompt limit and cap at most 8 lengths."""
    from data_prep.regen_memory import segment_bucket, segment_width

    assert [segment_width(r, 512) for r in (512, 300, 256, 100, 65, 64, 3, 1)] == [512, 512, 256, 128, 128, 64, 64, 64]
    assert segment_width(5, 6) == 6 and segment_width(1, 1) == 1 and segment_width(3, 16) == 4
    assert segment_bucket(128, 256) == 512 and segment_bucket(128, 1024) == 1024
    lengths = {-(-n // segment_bucket(128, 256)) for n in range(1, 2048 + 2047)}
    assert len(lengths) == 8


def test_progress_lines_say_how_fast_the_engine_went(tiny_llama_config, monkeypatch):
    """``regen.progress_every_s``: after a call ending that long after the last line, one line with the calls, the
    tokens generated and their rate, so a run stopped before its first shard still tells its speed (a keep_kv
    prepare on an H100 wrote no shard in 478 s and left nothing to read); none without it. The profile counts the
    generated tokens exactly."""
    import data_prep.regenerate as regen
    from conftest import tiny_generator
    from data_prep.regenerate import _FittingRows, _generate_batch

    model, prompts = tiny_generator(2, (5, 9, 2, 14, 7, 3, 11, 4))
    kw = {"do_sample": False, "max_new_tokens": 6}
    want = _generate_batch(model, prompts, 0, [1], kw)
    clock = iter(range(0, 10_000, 10))  # every perf_counter reading 10 s after the last
    monkeypatch.setattr(regen.time, "perf_counter", lambda: float(next(clock)))
    said = []
    rows = _FittingRows(4, log=said.append, progress_every_s=15.0)
    assert rows(model, prompts, 0, [1], kw) == want
    tokens = sum(len(new) for new, _ in want)
    assert rows.profile["generated_tokens"] == tokens and rows.profile["calls"] == 2
    # readings per call: its start, its end, the progress check: the first ends 30 s after the engine's start
    # (>= 15: a line), the second 30 s after that line
    assert len(said) == 2 and said[0].startswith("regen: 1 calls in 30 s, ")
    assert said[1].startswith(f"regen: 2 calls in 60 s, {tokens:,} tokens ({tokens / 60:,.0f} tokens/s)")
    assert "4 rows per call" in said[1]
    quiet = []
    _FittingRows(4, log=quiet.append)(model, prompts, 0, [1], kw)
    assert quiet == []


def test_free_memory_counts_what_the_caching_allocator_holds_unused(monkeypatch):
    """After an earlier ``generate`` in the same process, PyTorch's caching allocator keeps the freed KV cache's
    blocks: the driver reports them as used (an H200 showed 62.9 of 139 GiB free and the check cut a batch
    of 512 to 459). They are free to this process, so they count."""
    import torch

    from data_prep.regen_memory import free_memory_bytes

    monkeypatch.setattr(torch.cuda, "mem_get_info", lambda device=None: (63 * GIB, 139 * GIB))
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 72 * GIB)
    monkeypatch.setattr(torch.cuda, "memory_allocated", lambda device=None: 1 * GIB)
    assert free_memory_bytes("cuda:0") == (63 + 71) * GIB
    monkeypatch.setattr(torch.cuda, "memory_reserved", lambda device=None: 0)
    assert free_memory_bytes("cuda:0") == 63 * GIB


def test_stop_loops_cuts_looping_rows_between_segments(tiny_llama_config, monkeypatch):
    """``regen.stop_loops``: a row whose answer ends in a repetition loop at a segment's end leaves there as
    unfinished and is listed in ``looped``; every answer is a prefix of the greedy answer without it (the same
    answer where no loop was seen); the setting is refused where there are no segments."""
    from conftest import tiny_generator

    from data_prep import regen_memory
    from data_prep.loops import ends_in_loop
    from data_prep.regenerate import _generate_segmented

    model, prompts = tiny_generator(3, (5, 9, 2, 14, 7, 3))
    monkeypatch.setattr(regen_memory, "SEGMENT_LENGTH_BUCKET", 4)
    cap, segment, kw = 200, 40, {"do_sample": False}
    full = {i: (new, fin) for i, new, fin in _generate_segmented(model, prompts, list(range(6)), 0, [1], kw, 1, 4,
                                                                   cap, segment)}
    looped = []
    cut = {i: (new, fin) for i, new, fin in _generate_segmented(model, prompts, list(range(6)), 0, [1], kw, 1, 4,
                                                                  cap, segment, stop_loops=True, looped=looped)}
    assert looped, "the tiny random model's greedy answers loop"  # the test needs at least one
    for i in range(6):
        new, fin = cut[i]
        assert full[i][0][: len(new)] == new
        if i in looped:
            assert not fin and len(new) < cap and len(new) % segment == 0 and ends_in_loop(new)
        else:
            assert (new, fin) == full[i]
    with pytest.raises(ValueError, match="regen.stop_loops works between the segments"):
        RegenConfig(stop_loops=True)
    RegenConfig(stop_loops=True, segment_tokens=64, engine="static")


def test_stop_loops_is_refused_where_auto_resolves_to_continuous_batching(monkeypatch):
    """``regen.engine: auto`` with ``stop_loops`` is valid config (static on CUDA without flash attention) but
    where it resolves to continuous batching, which has no segments, the engine refuses instead of ignoring it."""
    from data_prep import regenerate as R

    monkeypatch.setattr(R, "resolve_engine", lambda model, cfg: "continuous")
    with pytest.raises(ValueError, match="stop_loops needs the static engine in segments.*engine is continuous"):
        R.hf_engine(None, None, RegenConfig(stop_loops=True, segment_tokens=64))


def test_engine_profile_counts_the_compiles_made_in_its_calls(tiny_llama_config, monkeypatch):
    """``engine_profile.compiles`` / ``compile_seconds``: what torch.compile's counters grew by during the
    ``generate`` calls (a stand-in generate grows them as a compiled decoding step would), not before them."""
    import collections

    import torch
    from torch._dynamo import utils
    from transformers import LlamaForCausalLM

    from data_prep.regenerate import _compile_stats, _FittingRows

    counters = collections.defaultdict(collections.Counter)
    counters["stats"]["unique_graphs"] = 5  # made before: not this engine's
    monkeypatch.setattr(utils, "counters", counters)
    monkeypatch.setattr(utils, "compilation_time_metrics", {"_compile.compile_inner": [7.0]})
    assert _compile_stats() == (5, 7.0)
    torch.manual_seed(0)
    model = LlamaForCausalLM(tiny_llama_config()).eval()
    generate = model.generate

    def compiling(**kwargs):
        counters["stats"]["unique_graphs"] += 2
        utils.compilation_time_metrics["_compile.compile_inner"].append(1.5)
        return generate(**kwargs)

    model.generate = compiling
    rows = _FittingRows(2)
    rows(model, [[3, 4], [5], [6, 7, 8]], 0, [1], {"do_sample": False, "max_new_tokens": 2})  # two calls
    assert (rows.profile["calls"], rows.profile["compiles"], rows.profile["compile_seconds"]) == (2, 4, 3.0)
    # id 1 ends no answer here (the tiny random model): each call runs its 2 steps, on 2 and then 1 rows
    assert (rows.profile["decode_steps"], rows.profile["row_steps"]) == (4, 2 * 2 + 1 * 2)
