"""CPU smoke test of ``benchmarks/train_step.py`` (issue #7): the tiny shape runs end to end
with ``--partitions auto`` (planner), two partitions, and ``--profile`` (top-ops table in the
JSON); rows and the table come out; ``--check-grads`` and ``--attention both`` on CPU; the
block-mask counts of ``mask_density.py``. ``--compile`` is exercised numerically in
``test_compile.py`` (compiling the benchmark's step on CPU takes about a minute)."""
from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.usefixtures("torch_single_thread")
def test_train_step_cpu_smoke(bench, tmp_path, capsys):
    out = tmp_path / "b.json"
    rows = bench.main(["--shape", "tiny", "--seq-len", "256", "128", "--partitions", "auto", "2", "--steps", "2",
                       "--warmup", "1", "--compile", "off", "--profile", "--out", str(out)])
    assert len(rows) == 2 and all("error" not in r for r in rows), rows
    assert rows[0]["S"] == 1 and rows[0]["plan"]["S"] == 1 and rows[1]["S"] == 2
    assert all(r["step_ms"] > 0 and r["first_step_s"] > 0 and r["compile"] is False for r in rows)
    data = json.loads(out.read_text())
    assert data["meta"]["compile_variants"] == [False]
    assert data["meta"]["command"].startswith("python benchmarks/train_step.py") and "commit" in data["meta"]
    assert data["meta"]["step"].startswith("peagle_train.trainer.trainer.Trainer.train_step")
    top = data["profile"]["top"]
    assert 0 < len(top) <= 25 and {"name", "ms_per_step", "pct_of_step"} <= set(top[0])
    printed = capsys.readouterr().out
    assert "step ms" in printed and "first s" in printed and "top" in printed
    assert all(r["loss_path"] == "fused" for r in rows)  # train.fused_loss's default, and it applied
    for r in rows:  # every timed step is kept, with the garbage collector's share of it
        assert len(r["step_ms_all"]) == len(r["gc_ms_all"]) == len(r["gc_full_all"]) == 2
        assert r["alloc_retries_all"] == [None, None]  # CPU: no CUDA allocator to count
        assert r["gpu_clocks"] is None  # CPU: no card to sample (benchmarks/gpu_clocks.py)
        assert r["step_ms_min"] == min(r["step_ms_all"]) and r["step_ms_max"] == max(r["step_ms_all"])
        # the attention of all 4 drafter layers over the step's (query, key) pairs is in the FLOP count
        assert r["attention_flop"] == 4 * 12 * 4 * 16 * r["attention_pairs"] and r["flop"] > r["attention_flop"] > 0


def _train_keys_built(monkeypatch, key: str) -> list:
    """The ``train.<key>`` of every Trainer built from now on in the test, in order (the Trainers are still built)."""
    import peagle_train.trainer.trainer as trainer_module

    built = []
    init = trainer_module.Trainer.__init__

    def spy(self, cfg, *a, **k):
        built.append(getattr(cfg.train, key))
        init(self, cfg, *a, **k)

    monkeypatch.setattr(trainer_module.Trainer, "__init__", spy)
    return built


def test_train_step_passes_prefix_kernel_options_to_the_trainer(bench, tmp_path, monkeypatch):
    """``--prefix-kernel-options``: the recipe's ``train.prefix_kernel_options`` (what the Trainer is built from):
    a JSON object as given, ``null`` as None (FlexAttention's own choice: the baseline), ``auto`` or no flag as the
    trainer's default ``auto``; a row records the options that ran where its attention is the split form's
    FlexAttention (not this CPU's SDPA); anything else is refused by the argument parser."""
    built = _train_keys_built(monkeypatch, "prefix_kernel_options")
    out = tmp_path / "k.json"
    common = ["--shape", "tiny", "--seq-len", "128", "--steps", "1", "--warmup", "0"]
    rows = bench.main(common + ["--prefix-kernel-options", '{"fwd_BLOCK_M": 64}', "--out", str(out)])
    assert built == [{"fwd_BLOCK_M": 64}] and rows[0]["attention"] == "sdpa" and rows[0]["prefix_kernel_options"] is None
    assert json.loads(out.read_text())["meta"]["command"].endswith('--prefix-kernel-options {"fwd_BLOCK_M": 64} --out '
                                                                   + str(out))
    for flag, expected in ((["--prefix-kernel-options", "null"], None), ([], "auto"),
                           (["--prefix-kernel-options", "auto"], "auto")):
        built.clear()
        rows = bench.main(common + flag + ["--out", str(out)])
        assert built == [expected] and "error" not in rows[0] and rows[0]["prefix_kernel_options"] is None, flag
    assert bench.parse_args([]).prefix_kernel_options == "auto"
    assert bench.parse_args(["--prefix-kernel-options", "null"]).prefix_kernel_options is None
    for bad in ("BLOCK_M=64", "[64]", "fast", '"fast"', "64"):
        with pytest.raises(SystemExit):
            bench.parse_args(["--prefix-kernel-options", bad])


def test_train_step_passes_prefix_compiled_apart_to_the_trainer(bench, tmp_path, monkeypatch):
    """``--prefix-compiled-apart``: the recipe's ``train.prefix_compiled_apart`` (off without the flag); a row records
    it true only where a compiled split form ran (not this CPU's SDPA, not an eager row)."""
    built = _train_keys_built(monkeypatch, "prefix_compiled_apart")
    out = tmp_path / "a.json"
    common = ["--shape", "tiny", "--seq-len", "128", "--steps", "1", "--warmup", "0", "--out", str(out)]
    rows = bench.main(common + ["--prefix-compiled-apart"])
    assert built == [True] and "error" not in rows[0] and rows[0]["prefix_compiled_apart"] is False
    built.clear()
    rows = bench.main(common)
    assert built == [False] and rows[0]["prefix_compiled_apart"] is False
    assert bench.parse_args(["--prefix-compiled-apart"]).prefix_compiled_apart is True
    # recorded true only where the step ran a compiled split form
    assert bench.prefix_compiled_apart_ran(True, "flex", True) and bench.prefix_compiled_apart_ran(True, "flex",
                                                                                                   "max-autotune")
    for value, kind, comp in ((False, "flex", True), (True, "flex", False), (True, "sdpa", True),
                              (True, "flex_joint", True)):
        assert bench.prefix_compiled_apart_ran(value, kind, comp) is False, (value, kind, comp)


def test_train_step_passes_selective_checkpointing_to_the_trainer(bench, tmp_path, monkeypatch):
    """``--checkpointing selective``: the recipe's ``train.activation_checkpointing: selective`` (``--checkpointing``
    alone: true; without it: false), the row records it, the step runs on the CPU; another value is refused."""
    built = _train_keys_built(monkeypatch, "activation_checkpointing")
    out = tmp_path / "c.json"
    common = ["--shape", "tiny", "--seq-len", "128", "--steps", "1", "--warmup", "0", "--out", str(out)]
    rows = bench.main(common + ["--checkpointing", "selective"])
    assert built == ["selective"] and "error" not in rows[0] and rows[0]["checkpointing"] == "selective"
    built.clear()
    rows = bench.main(common + ["--checkpointing"])
    assert built == [True] and rows[0]["checkpointing"] is True
    assert bench.parse_args([]).checkpointing is False
    with pytest.raises(SystemExit):
        bench.parse_args(["--checkpointing", "sometimes"])


def test_train_step_passes_dynamic_shapes_and_the_divisible_hint(bench, tmp_path, monkeypatch):
    """``--dynamic-shapes``: the recipe's ``train.dynamic_shapes`` (on without the flag, the trainer's default);
    ``--divisible-hint off``: FlexAttention without ``IS_DIVISIBLE`` (``attention.DIVISIBLE_HINT`` off for the run,
    on again with the default); rows record both, the hint true only where FlexAttention ran on CUDA."""
    import peagle_train.kernels.attention as attention_mod

    monkeypatch.setattr(attention_mod, "DIVISIBLE_HINT", True)  # restored after the test whatever main sets
    built = _train_keys_built(monkeypatch, "dynamic_shapes")
    out = tmp_path / "d.json"
    common = ["--shape", "tiny", "--seq-len", "128", "--steps", "1", "--warmup", "0", "--out", str(out)]
    rows = bench.main(common + ["--dynamic-shapes", "off", "--divisible-hint", "off"])
    assert built == [False] and "error" not in rows[0]
    assert rows[0]["dynamic_shapes"] is False and rows[0]["divisible_hint"] is False
    assert attention_mod.DIVISIBLE_HINT is False
    built.clear()
    rows = bench.main(common)
    assert built == [True] and rows[0]["dynamic_shapes"] is True
    assert attention_mod.DIVISIBLE_HINT is True and rows[0]["divisible_hint"] is False  # CPU SDPA: no FlexAttention
    assert bench.divisible_hint_ran(True, "flex", "cuda") and bench.divisible_hint_ran(True, "flex_joint", "cuda:0")
    for flag, kind, dev in ((False, "flex", "cuda"), (True, "sdpa", "cuda"), (True, "flex", "cpu")):
        assert bench.divisible_hint_ran(flag, kind, dev) is False, (flag, kind, dev)
    with pytest.raises(SystemExit):
        bench.parse_args(["--divisible-hint", "maybe"])


def test_train_step_rows_record_the_prefix_kernel_options_that_ran(bench, tmp_path, monkeypatch):
    """A row's ``prefix_kernel_options`` is ``train.prefix_kernel_options`` resolved for the GPU where the split
    form's FlexAttention ran (auto: the forward block on compute capability 9 at head dimension 64 in bf16 only), None
    for ``flex_joint`` and SDPA; ``bench_case`` records it so (a simulated H100 and split attention on this CPU; the
    Trainer is not built)."""
    from peagle_train.kernels.attention import HOPPER_PREFIX_KERNEL_OPTIONS

    given = {"fwd_BLOCK_M": 32}

    def ran(value, kind, capability, head_dim=64, dtype=torch.bfloat16):
        return bench.prefix_kernel_options_ran(value, kind, capability, head_dim, dtype)

    assert ran("auto", "flex", (9, 0)) == HOPPER_PREFIX_KERNEL_OPTIONS
    assert ran("auto", "flex", (8, 0)) is None and ran("auto", "flex", None) is None
    assert ran("auto", "flex", (9, 0), 128) is None and ran("auto", "flex", (9, 0), 64, torch.float32) is None
    assert ran(given, "flex", (9, 0), 128, torch.float32) == given  # a mapping applies at any shape
    assert ran(None, "flex", (9, 0)) is None and ran(given, "flex", (8, 0)) == given
    assert all(ran(v, kind, (9, 0)) is None for v in ("auto", given) for kind in ("flex_joint", "sdpa"))
    assert bench.shape_head_dim("gpt-oss-20b") == 64 and bench.shape_head_dim("llama-3.1-8b-recipe") == 128

    def not_built(*a, **k):
        raise RuntimeError("not built")

    monkeypatch.setattr(bench, "effective_attention", lambda kind, device: kind)
    monkeypatch.setattr(bench, "device_capability", lambda device: (9, 0))
    monkeypatch.setattr(bench, "build_trainer", not_built)
    cpu = torch.device("cpu")
    for shape, flag, kind, expected in (("gpt-oss-20b", [], "flex", HOPPER_PREFIX_KERNEL_OPTIONS),
                                        ("gpt-oss-20b", ["--mixed-precision", "no"], "flex", None),  # float32
                                        ("tiny", [], "flex", None),  # head dimension 16
                                        ("gpt-oss-20b", [], "flex_joint", None),
                                        ("gpt-oss-20b", ["--prefix-kernel-options", "null"], "flex", None),
                                        ("tiny", ["--prefix-kernel-options", '{"fwd_BLOCK_M": 32}'], "flex", given)):
        args = bench.parse_args(["--shape", shape] + flag)
        row = bench.bench_case(args, 128, 1, cpu, attention=kind, out_dir=str(tmp_path))
        assert row["error"] == "RuntimeError: not built" and row["attention"] == kind
        assert row["prefix_kernel_options"] == expected, (flag, kind, row)


def test_flop_count_counts_the_attention_of_every_drafter_layer(bench):
    """The step's FLOP count (``train_step.flops``) has one attention term per decoder layer: each of the
    drafter's layers attends over the whole grid (before the fix it counted one layer's, whatever ``L``)."""
    from peagle_train.model.drafter import Drafter, make_drafter_config

    tc = bench.target_config("tiny")
    d2, d4 = (Drafter(make_drafter_config(tc, aux_layer_ids=[1, 2, 3], draft_vocab_size=64, mask_token_id=63,
                                          num_layers=n)) for n in (2, 4))
    per_layer = 12 * tc.num_attention_heads * tc.head_dim * 1000
    assert bench.attention_flops(d2, 1000) == 2 * per_layer and bench.attention_flops(d4, 1000) == 4 * per_layer
    layer = sum(p.numel() for p in d4.layers[1].parameters())  # layers 1.. are alike (layer 0 fuses 2H)
    assert bench.dense_flops(d4, 300, 100) - bench.dense_flops(d2, 300, 100) == 6 * 2 * layer * 300
    assert bench.flops(d4, 300, 1000, 100) == bench.dense_flops(d4, 300, 100) + 4 * per_layer


def test_provenance_names_the_command_and_prefers_the_commit_the_caller_sent(bench, monkeypatch):
    monkeypatch.setenv("PEAGLE_COMMIT", "abc123")
    assert bench.provenance(["--shape", "tiny"]) == {"command": "python benchmarks/train_step.py --shape tiny",
                                                    "commit": "abc123"}
    monkeypatch.delenv("PEAGLE_COMMIT")
    commit = bench.provenance([])["commit"]
    assert commit is None or len(commit) == 40  # the checkout's HEAD where git can read it


@pytest.mark.usefixtures("torch_single_thread")
def test_train_step_records_garbage_collection_inside_a_step(bench, tmp_path, monkeypatch):
    import gc

    import peagle_train.trainer.trainer as trainer_module

    norm = trainer_module.grad_norm_value

    def norm_and_collect(*a, **k):  # a full collection inside every step (our own call: accelerate's clipping
        gc.collect()  # does not go through torch.nn.utils.clip_grad_norm_ in every version)
        return norm(*a, **k)

    monkeypatch.setattr(trainer_module, "grad_norm_value", norm_and_collect)
    # what the benchmark times is the trainer's own step: count the calls of Trainer.train_step
    from peagle_train.trainer.trainer import Trainer

    calls = []
    step = Trainer.train_step

    def counted_step(self):
        calls.append(self.step)
        return step(self)

    monkeypatch.setattr(Trainer, "train_step", counted_step)
    callbacks = list(gc.callbacks)
    (row,) = bench.main(["--shape", "tiny", "--seq-len", "64", "--steps", "2", "--warmup", "1",
                         "--out", str(tmp_path / "gc.json")])
    assert "error" not in row, row
    assert calls == [0, 1, 2]  # warmup + steps calls of one trainer, nothing else stepped
    assert row["host_inputs"] == "in-step (the trainer's own)" and len(row["step_ms_all"]) == 2
    # at least the forced one per step (Python may add its own)
    assert all(n >= 1 for n in row["gc_full_all"]) and all(ms > 0 for ms in row["gc_ms_all"])
    assert gc.callbacks == callbacks  # the benchmark's clock is removed again


def test_chain_tiling_file_without_best_tiling_is_a_clear_error(bench, tmp_path):
    bad = tmp_path / "tiling.json"
    bad.write_text('{"rows": []}')
    with pytest.raises(SystemExit, match=r"--chain-tiling .*tiling.json: no 'best_tiling'.*chain_kernel.py"):
        bench.main(["--shape", "tiny", "--seq-len", "64", "--chain-tiling", str(bad), "--out", str(tmp_path / "o.json")])
    bad.write_text('{"best_tiling": {"fwd_typo": [64, 4]}}')
    with pytest.raises(SystemExit, match="no 'best_tiling' of kernels"):
        bench.main(["--shape", "tiny", "--seq-len", "64", "--chain-tiling", str(bad), "--out", str(tmp_path / "o.json")])


def test_reference_rows_carry_the_ratio(bench):
    rows = [{"N": 2048, "step_ms": 100.0}, {"N": 65536, "step_ms": 9000.0}, {"N": 4096, "error": "OOM"}]
    refs = {2048: {"status": "ok", "step_ms_median": 150.0, "peak_alloc_gb": 20.0, "grid_positions": 6897},
            65536: {"status": "oom"}, 4096: {"status": "ok", "step_ms_median": 200.0, "peak_alloc_gb": 16.0}}
    bench.attach_reference(rows, refs)
    assert rows[0]["speedup"] == pytest.approx(1.5) and rows[0]["ref_peak_gb"] == 20.0
    assert rows[1]["speedup"] is None and rows[1]["ref_status"] == "oom"  # where the reference runs out of memory
    assert rows[2]["speedup"] is None and rows[2]["ref_step_ms"] == 200.0  # ours failed: no ratio


def test_alloc_retries_reads_the_cuda_allocators_count(bench, monkeypatch):
    assert bench.alloc_retries(False) is None
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda: {"num_alloc_retries": 3, "num_ooms": 0})
    assert bench.alloc_retries(True) == 3
    monkeypatch.setattr(torch.cuda, "memory_stats", lambda: {})  # no allocation yet: the key is absent
    assert bench.alloc_retries(True) == 0


def test_matmul_rate_is_none_on_cpu(bench):
    import torch

    assert bench.matmul_rate(torch.device("cpu")) is None


def test_mask_density_counts(tmp_path):
    import mask_density

    res = mask_density.main(["--seq-len", "300", "--out", str(tmp_path / "m.json")])
    assert res["blocks_partial"] + res["blocks_full"] <= res["blocks_total"]
    assert res["pairs_computed"] >= res["pairs_allowed"] > 0  # the block mask never drops an allowed pair
    assert json.loads((tmp_path / "m.json").read_text())["elements"] % 1024 == 0


@pytest.mark.usefixtures("torch_single_thread")
def test_benchmark_check_grads_and_attention_option(bench, tmp_path, capsys):
    """``benchmarks/train_step.py --check-grads`` on CPU (prefix part dense vs SDPA) reports tiny errors;
    ``--attention both`` on CPU gives one ``sdpa`` row per N with the ``attention`` field."""
    out = tmp_path / "g.json"
    res = bench.main(["--shape", "tiny", "--check-grads", "--check-n", "160", "--K", "4", "--compile", "both",
                      "--out", str(out)])
    assert len(res) == 1 and "error" not in res[0], res
    r = res[0]
    assert r["grads_finite"] and r["params_compared"] > 10 and r["E"] > 160
    assert r["loss_rel_err"] < 1e-5 and r["grad_max_rel_err"] < 1e-4, r
    assert json.loads(out.read_text())["grad_check"][0]["worst_param"] == r["worst_param"]
    assert r["prefix_kernel_options"] is None  # the default (auto), but no FlexAttention ran on the CPU's split side
    assert "compiled variants skipped" in capsys.readouterr().out

    rows = bench.main(["--shape", "tiny", "--seq-len", "128", "--steps", "1", "--warmup", "0", "--attention", "both",
                       "--out", str(tmp_path / "b.json")])
    assert len(rows) == 1 and rows[0]["attention"] == "sdpa" and "error" not in rows[0]
    data = json.loads((tmp_path / "b.json").read_text())
    assert data["meta"]["attention_variants"] == ["sdpa"] and data["rows"][0]["attention"] == "sdpa"
    # the speedup column pairs a split row with the joint row of the same configuration
    paired = bench.attach_joint_speedup([{"N": 1, "S": 1, "compile": False, "attention": "flex_joint", "step_ms": 30.0},
                                         {"N": 1, "S": 1, "compile": False, "attention": "flex", "step_ms": 20.0},
                                         {"N": 2, "S": 1, "compile": False, "attention": "flex", "step_ms": 20.0}])
    assert paired[1]["speedup_vs_joint"] == pytest.approx(1.5) and "speedup_vs_joint" not in paired[2]


def test_timeline_summary_busy_idle_and_categories(bench):
    """Busy time is the union of kernel intervals (overlaps count once), idle the rest of the window,
    per step; categories sum kernel time by name."""
    kernels = [("triton_tem_fused_flex_attention_backward_9", 0.0, 4000.0),
               ("nvjet_sm90_tst_192x192", 3000.0, 5000.0),  # overlaps the first: busy 0..5000
               ("triton_tem_fused_flex_attention_transpose_view_5", 7000.0, 8000.0),  # 2000 us idle before
               ("Memcpy HtoD (Pageable -> Device)", 9000.0, 9500.0),
               ("triton_per_fused_sum_6", 9500.0, 10000.0),
               ("void at::native::multi_tensor_apply_kernel<FusedAdam>", 10000.0, 12000.0),
               ("some_other_kernel", 12000.0, 12000.0)]
    tl = bench.timeline_summary(kernels, 2)
    assert tl["window_ms"] == 6.0 and tl["busy_ms"] == 4.5 and tl["idle_ms"] == 1.5  # gaps 5000-7000, 8000-9000
    cats = tl["by_category"]
    assert cats["flex attention backward"] == 2.0 and cats["flex attention forward"] == 0.5
    assert cats["GEMM (cuBLAS / CUTLASS)"] == 1.0 and cats["optimizer (fused multi-tensor)"] == 1.0
    assert cats["copies"] == 0.25 and cats["Inductor fused (norms, RoPE, loss, chain part, ...)"] == 0.25
    assert cats["other"] == 0.0 and list(cats)[0] == "flex attention backward"
    assert bench.timeline_summary([], 3) == {"window_ms": 0.0, "busy_ms": 0.0, "idle_ms": 0.0, "by_category": {}}
    with pytest.raises(ValueError, match="n_steps"):
        bench.timeline_summary(kernels, 0)
    with pytest.raises(ValueError, match="ends before"):
        bench.timeline_summary([("x", 5.0, 1.0)], 1)


def test_regen_throughput_counts_a_decoded_batch_past_the_limit():
    """collect_answers: a batch answered in one call counts whole even when its answers are read past the
    time limit (the 2026-12-02 GPU run counted 1 of 512); the next batch, decoded past the limit, does not."""
    import regen_throughput

    times = iter([100.0, 100.01, 100.02, 190.0, 190.01])  # batch 1 (3 answers) at 100 s, batch 2 at 190 s
    answers = ((i, f"c{i}") for i in range(5))
    out, secs = regen_throughput.collect_answers(answers, 60.0, 0.0, clock=lambda: next(times))
    assert sorted(out) == [0, 1, 2] and secs == pytest.approx(100.02)
    times = iter([10.0, 20.0, 30.0])  # within the limit: everything
    out, secs = regen_throughput.collect_answers(((i, i) for i in range(3)), 60.0, 0.0, clock=lambda: next(times))
    assert sorted(out) == [0, 1, 2] and secs == 30.0


def test_regen_throughput_cpu_smoke(tmp_path, capsys):
    """``benchmarks/regen_throughput.py --smoke``: the static-cache and continuous engines and plain generate
    on the same real prompts through prepare's engine, token-identical, one JSON with the command and commit,
    a one-line summary."""
    from conftest import need_smollm2

    need_smollm2()
    import regen_throughput

    out = tmp_path / "regen.json"
    result = regen_throughput.main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert result["meta"]["command"] == f"python benchmarks/regen_throughput.py --smoke --out {out}"
    assert "commit" in result["meta"]
    # whole greedy answers whatever the recipe says (a GPU recipe's regen.stop_loops would cut loops short)
    assert "regen.stop_loops=false" in result["meta"]["overrides"]
    (run,) = result["runs"]
    assert run["continuous"]["engine"] == "continuous" and run["generate"]["engine"] == "generate"
    assert run["static"]["engine"] == "static"
    assert run["static"]["prompts"] == run["continuous"]["prompts"] == run["generate"]["prompts"] == 4
    prof = run["static"]["engine_profile"]  # where the engine's time went: generate calls, shapes, first-shape seconds
    assert prof["calls"] >= 1 and 1 <= prof["shapes"] <= prof["calls"] and prof["new_shape_seconds"] <= prof["seconds"]
    assert run["continuous"]["engine_profile"] is None
    for name in ("static", "continuous"):
        assert run[name]["generated_tokens"] > 0 and run[name]["tokens_per_s"] > 0
        assert run["identical"][name] == {"compared": 4, "identical": 4, "all": True, "first_differing_prompt": None}
    assert capsys.readouterr().out.strip().splitlines()[-1] == result["summary"]
    assert result["summary"].startswith("regen_throughput (cap 12): float32: static")


@pytest.mark.usefixtures("torch_single_thread")
def test_regen_throughput_random_weight_target(tmp_path, monkeypatch, capsys):
    """``--random-init-from-config SPEC --tokenizer DIR``: the target is built with random weights by the
    project's ``load_target`` (a tiny Llama configuration JSON, a character-level tokenizer folder), the
    prompts come from ``--prompts-file``, plain generate runs at its own shorter cap and its answers are
    compared with the continuous ones cut there; the JSON and the summary say ``random_weights``."""
    import regen_throughput
    from test_evaluate import tiny_tokenizer

    monkeypatch.setenv("PEAGLE_CACHE", str(tmp_path / "cache"))
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"], "hidden_size": 32,
              "intermediate_size": 64, "num_attention_heads": 4, "num_key_value_heads": 2, "num_hidden_layers": 8,
              "vocab_size": 64, "max_position_embeddings": 256, "tie_word_embeddings": False,
              "bos_token_id": 1, "eos_token_id": 2}
    (tmp_path / "config.json").write_text(json.dumps(config))
    tiny_tokenizer().save_pretrained(tmp_path / "tok")
    prompts = [{"conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": "(answer omitted)"}]}
               for q in ("what is two plus two?", "write a haiku about rain.", "name three colors.", "hi")]
    (tmp_path / "prompts.json").write_text(json.dumps(prompts))
    out = tmp_path / "regen.json"
    result = regen_throughput.main([
        "--recipe", "recipes/smollm2-135m.yaml", "--random-init-from-config", str(tmp_path / "config.json"),
        "--tokenizer", str(tmp_path / "tok"), "--prompts-file", str(tmp_path / "prompts.json"), "--prompts", "4",
        "--subset", "3", "--cap", "12", "--generate-cap", "5", "--batch", "3", "--cb-batch", "4",
        "--dtypes", "float32", "--engines", "continuous", "--profile-cap", "3", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert result["random_weights"] is True and result["meta"]["generate_cap"] == 5
    assert f"target.random_init_from_config={tmp_path / 'config.json'}" in result["meta"]["overrides"]
    (run,) = result["runs"]
    assert run["continuous"]["prompts"] == 4 and run["generate"]["prompts"] == 3
    assert run["continuous"]["generated_tokens"] > run["generate"]["generated_tokens"] > 0
    assert "static" not in run  # --engines continuous: only that one
    prof = run["profile"]  # --profile-cap 3: the first engine again, one batch of the 4 prompts, 3 tokens each
    assert prof["engine"] == "continuous" and prof["batch"] == 4 and prof["decode_steps"] == 3
    assert prof["wall_ms_per_step"] > 0 and prof["timeline"] is None  # no GPU: no kernel timeline
    assert prof["top_kernels"] and prof["top_host_ops"][0]["self_cpu_ms_per_step"] > 0
    assert run["identical"] == {"continuous": {"compared": 3, "identical": 3, "all": True, "first_differing_prompt": None}}
    assert capsys.readouterr().out.strip().splitlines()[-1] == result["summary"]
    assert result["summary"].startswith("regen_throughput (cap 12, generate cap 5, random_weights: true")
    assert "profile:" not in result["summary"]  # the profile's timeline is GPU-only
    with pytest.raises(SystemExit):
        regen_throughput.parse_args(["--random-init-from-config", "x.json", "--out", "o.json"])  # no --tokenizer
    # --variants: the static engine again on the same prompts, in segments and at another batch, side by side,
    # each counted against plain generate
    out2 = tmp_path / "variants.json"
    res = regen_throughput.main([
        "--recipe", "recipes/smollm2-135m.yaml", "--random-init-from-config", str(tmp_path / "config.json"),
        "--tokenizer", str(tmp_path / "tok"), "--prompts-file", str(tmp_path / "prompts.json"), "--prompts", "4",
        "--subset", "4", "--cap", "12", "--batch", "4", "--cb-batch", "4", "--dtypes", "float32",
        "--engines", "static", "--variants", "seg8=regen.segment_tokens=8", "b2=regen.batch_size=2,regen.segment_tokens=8",
        "--warmup", "--out", str(out2)])
    (run,) = res["runs"]
    # --warmup: each timed run after an untimed one on its first batch; a run without it records None
    assert run["static"]["warmup_seconds"] > 0 and all(v["warmup_seconds"] > 0 for v in run["variants"].values())
    assert result["runs"][0]["continuous"]["warmup_seconds"] is None
    assert set(run["variants"]) == {"seg8", "b2"} and run["variants"]["b2"]["settings"] == {"batch_size": 2,
                                                                                          "segment_tokens": 8}
    assert run["variants"]["b2"]["batch_size"] == 2 and run["variants"]["seg8"]["batch_size"] == 4
    for v in run["variants"].values():
        assert v["engine"] == "static" and v["answered"] == 4 and v["identical"] == {"compared": 4, "identical": 4,
                                                                                      "all": True}
    assert "seg8 " in res["summary"] and "(4/4 identical)" in res["summary"]
    # --override regen.keep_kv=true: the engines under test keep the KV cache; the reference generate does not
    # (it would refuse the setting), and the count still runs (a GPU run lost its identity count to this)
    res = regen_throughput.main([
        "--recipe", "recipes/smollm2-135m.yaml", "--random-init-from-config", str(tmp_path / "config.json"),
        "--tokenizer", str(tmp_path / "tok"), "--prompts-file", str(tmp_path / "prompts.json"), "--prompts", "4",
        "--subset", "4", "--cap", "20", "--batch", "4", "--cb-batch", "4", "--dtypes", "float32",
        "--engines", "static", "--override", "regen.segment_tokens=8", "regen.keep_kv=true",
        "--out", str(tmp_path / "kv.json")])
    (run,) = res["runs"]
    assert "regen.keep_kv=true" in res["meta"]["overrides"] and run["generate"]["prompts"] == 4
    assert run["identical"]["static"]["compared"] == 4 and run["identical"]["static"]["all"]
    assert regen_throughput.parse_variants(["a=regen.segment_tokens=null"]) == {"a": {"segment_tokens": None}}
    for bad, why in ((["a=target.dtype=bfloat16"], "only the regen section"), (["a"], "expected NAME="),
                     (["a=regen.batch_size=2", "a=regen.batch_size=4"], "given twice")):
        with pytest.raises(ValueError, match=why):
            regen_throughput.parse_variants(bad)


def test_train_step_data_from_trains_on_the_prepared_sequences(bench, tmp_path):
    """--data-from: the benchmark's steps train on a run folder's prepared sequences in the trainer's
    order (micro-batch of --micro-batch sequences, their real lengths): the step's tokens are those of
    the trainer's first micro-batch, and --seq-len becomes the longest sequence."""
    from peagle_train.features.tokenized import save_tokenized

    lengths = [30, 45, 17, 60, 24, 38]
    rows = [{"input_ids": [(7 * i + j) % 500 for j in range(n)], "loss_mask": [0] * 5 + [1] * (n - 5)}
            for i, n in enumerate(lengths)]
    save_tokenized(rows, tmp_path / "run" / "data" / "train.safetensors")
    save_tokenized(rows[:1], tmp_path / "run" / "data" / "eval.safetensors")
    out = tmp_path / "b.json"
    res = bench.main(["--shape", "tiny", "--data-from", str(tmp_path / "run"), "--micro-batch", "2",
                      "--steps", "1", "--warmup", "0", "--out", str(out)])
    row = res[0]
    assert "error" not in row, row
    assert row["N"] == max(lengths)
    from peagle_train.trainer.setup import epoch_order

    order = epoch_order(len(lengths), 0, 0)
    assert row["tokens"] == lengths[order[0]] + lengths[order[1]]  # the trainer's first micro-batch (step 0)
    assert json.loads(out.read_text())["meta"]["command"].count("--data-from") == 1


def test_trainer_throughput_reads_the_steady_step_from_the_history(tmp_path):
    """benchmarks/trainer_throughput.py: the median gap between steps after the warm-up, leaving out
    the step whose gap holds an in-training evaluation; the evaluation's own time; a missing run is named."""
    import trainer_throughput as tt

    run = tmp_path / "run"
    run.mkdir()
    elapsed, hist, t = [5.0, 5.1, 5.2, 5.3, 8.4, 8.5, 8.6, 8.7], [], 0.0
    for i, e in enumerate(elapsed):
        rec = {"step": i + 1, "elapsed_s": e, "tokens": 1000}
        if i + 1 == 4:
            rec["eval_loss"] = 1.0  # evaluated after step 4: step 5's gap (3.1 s) holds it
        hist.append(rec)
    (run / "train_metrics.json").write_text(json.dumps({"history": hist}))
    s = tt.summarise(run, skip=1)
    assert s["step_ms"] == pytest.approx(100.0)
    assert s["steady_steps"] == 6 and s["tokens_per_s"] == pytest.approx(10000.0)
    assert s["eval_s"] == [pytest.approx(3.0)]
    assert s["first_steps_s"] == 5.0
    assert s["finished"] is True
    rows = tt.main([str(tmp_path / "missing"), "--skip", "1"])
    assert "not found" in rows[0]["error"]
    # a run stopped before its end (a job's time limit): no train_metrics.json, the per-step log instead
    cut = tmp_path / "cut"
    (cut / "logs").mkdir(parents=True)
    (cut / "logs" / "steps.jsonl").write_text("".join(json.dumps(h) + "\n" for h in hist))
    p = tt.summarise(cut, skip=1)
    assert p["finished"] is False and p["step_ms"] == pytest.approx(100.0) and p["steady_steps"] == 6

    # --reference: a run against the plain one (a distributed strategy): tokens/s ratio and loss agreement
    other = tmp_path / "zero2"
    other.mkdir()
    slower = [{**h, "elapsed_s": h["elapsed_s"] * 1.25, "loss": 2.0 + 0.01 * h["step"]} for h in hist]
    (other / "train_metrics.json").write_text(json.dumps({"history": slower}))
    (run / "train_metrics.json").write_text(json.dumps({"history": [{**h, "loss": 2.0} for h in hist]}))
    rows = tt.main([str(run), str(other), "--names", "plain", "zero2", "--skip", "1", "--reference", "plain"])
    v = rows[1]["vs_reference"]
    assert "vs_reference" not in rows[0] and v["reference"] == "plain" and v["steps_compared"] == 8
    assert v["tokens_per_s_ratio"] == pytest.approx(0.8) and v["loss_max_abs_diff"] == pytest.approx(0.08)
    assert v["loss_max_rel_diff"] == pytest.approx(0.04) and v["last_step_rel_diff"] == pytest.approx(0.04)
    with pytest.raises(SystemExit, match="--reference nope"):
        tt.main([str(run), "--reference", "nope"])


def test_trainer_throughput_reports_predicted_against_measured_peak(tmp_path):
    """benchmarks/trainer_throughput.py: ``peak`` = the planner's predicted peak against the measured one from
    the last train-stage record of logs/stages.jsonl that trained (a reused record, or one without a
    prediction, is skipped), with the relative error; without a measurement (CPU) no error; absent when
    no record holds a prediction."""
    import trainer_throughput as tt

    run = tmp_path / "run"
    (run / "logs").mkdir(parents=True)
    hist = [{"step": i + 1, "elapsed_s": 1.0 + i, "tokens": 100} for i in range(4)]
    (run / "train_metrics.json").write_text(json.dumps({"history": hist}))
    assert "peak" not in tt.summarise(run, skip=1) and tt.peak_vs_predicted(run) is None
    recs = [{"stage": "prepare", "reused": False, "peak_gpu_bytes": 5},
            {"stage": "train", "reused": False, "peak_gpu_bytes": 100, "predicted_peak_bytes": 90,
             "predicted_peak_for": {"tokens": 8192, "partitions": 2, "target_forwards": [[1, 8192]]}},
            {"stage": "train", "reused": True, "peak_gpu_bytes": 1, "predicted_peak_bytes": None}]
    (run / "logs" / "stages.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    peak = tt.summarise(run, skip=1)["peak"]
    assert peak == {"predicted_bytes": 90, "measured_bytes": 100, "rel_error": pytest.approx(-0.1),
                    "predicted_for": {"tokens": 8192, "partitions": 2, "target_forwards": [[1, 8192]]}}
    recs[1]["peak_gpu_bytes"] = None
    (run / "logs" / "stages.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    assert tt.peak_vs_predicted(run)["rel_error"] is None


def test_train_step_data_from_refuses_ids_outside_the_shape(bench, tmp_path):
    """--data-from with token ids the --shape's vocabulary cannot hold stops before any work, naming the
    folder, the largest id and the vocabulary."""
    from peagle_train.features.tokenized import save_tokenized

    rows = [{"input_ids": [1, 2, 600], "loss_mask": [0, 1, 1]}]
    for split in ("train", "eval"):
        save_tokenized(rows, tmp_path / "run" / "data" / f"{split}.safetensors")
    with pytest.raises(SystemExit, match=r"token id 600 .* vocabulary of 512"):
        bench.main(["--shape", "tiny", "--data-from", str(tmp_path / "run"), "--out", str(tmp_path / "b.json")])
    assert not (tmp_path / "b.json").exists()


def test_target_forward_cpu_smoke(tmp_path, capsys):
    """``benchmarks/target_forward.py --smoke``: the tiny GPT-OSS target's feature forward under each experts
    implementation on the same weights, timed, with the agreement of each with the first variant; a variant
    transformers refuses (flex attention with sinks on a CPU) is an error row, not a lost run."""
    import target_forward

    out = tmp_path / "tf.json"
    result = target_forward.main(["--smoke", "--variants", "eager/eager", "eager/grouped_mm", "flex_attention/keep",
                                  "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert result["meta"]["random_weights"] and result["meta"]["tokens"] == 2 * 64 and "commit" in result["meta"]
    assert result["meta"]["command"] == ("python benchmarks/target_forward.py --smoke --variants eager/eager "
                                         f"eager/grouped_mm flex_attention/keep --out {out}")
    ref, grouped, flex = result["rows"]
    assert ref["runs_with"] == {"attn": "eager", "experts": "eager"} and ref["step_ms"] > 0
    assert grouped["runs_with"]["experts"] == "grouped_mm" and grouped["tokens_per_s"] > 0
    assert grouped["argmax_equal"] == 1.0 and grouped["aux_rel_max_diff"] < 1e-5  # float32: the same features
    assert len(grouped["aux_rel_max_diff_by_layer"]) == 3 and max(grouped["aux_rel_max_diff_by_layer"]) < 1e-5
    # every token's experts were recorded in each of the 8 layers, and none changed with the implementation
    assert grouped["routing_changed_tokens_by_layer"] == {str(i): 0 for i in range(8)}
    assert grouped["routing_changed_before_tap"] == [0, 0, 0] and grouped["aux_tokens_off_by_layer"] == [0.0] * 3
    assert "sinks" in flex["error"] and "step_ms" not in flex
    with pytest.raises(SystemExit):  # a variant without its experts half: refused before the target is built
        target_forward.parse_args(["--smoke", "--variants", "eager", "--out", str(out)])
    assert "each is ATTN/EXPERTS" in capsys.readouterr().err


def _forward_result(by_layer, median=(1e-6,) * 3, off=(0.0,) * 3, rerouted=None, greedy=1.0, flex_error=None):
    flex = {"variant": "flex_attention/keep", "step_ms": 300.0, "aux_rel_max_diff_by_layer": list(by_layer),
            "aux_token_rel_diff_median_by_layer": list(median), "aux_tokens_off_by_layer": list(off),
            "argmax_equal": greedy}
    if rerouted is not None:
        flex["routing_changed_before_tap"] = list(rerouted)
    if flex_error:
        flex = {"variant": "flex_attention/keep", "error": flex_error}
    return {"meta": {"dtype": "float32"}, "rows": [{"variant": "eager/keep", "step_ms": 1200.0}, flex]}


def test_attn_check_verdict():
    """attn-check's rule (``target_forward.verdict``): a difference grown at a deep tapped layer after a router's
    near tie flipped is rounding; a wrong kernel (off at the first tapped layer, or on most tokens) and a large
    difference with no routing change are not. Figures of the GPT-OSS-20B shape's float32 check on an H200."""
    import target_forward as tf

    rounding = [2.74e-06, 7.51e-06, 2.52e-02]
    ok, msg = tf.verdict(_forward_result(rounding, off=(0.0, 0.0, 0.0006), rerouted=[0, 0, 3], greedy=0.9994))
    assert ok and "AGREES" in msg and "rerouted before the tap 0, 0, 3" in msg
    assert not tf.verdict(_forward_result(rounding, off=(0.0, 0.0, 0.0006), rerouted=[0, 0, 0]))[0]  # unexplained
    assert not tf.verdict(_forward_result(rounding, greedy=0.9994))[0]  # a dense target: no routing to flip
    assert not tf.verdict(_forward_result([3e-4, 1e-3, 5e-3]))[0]  # off at the first tapped layer: the kernel
    assert not tf.verdict(_forward_result(rounding, off=(0.0, 0.0, 0.2), rerouted=[0, 0, 40]))[0]  # most tokens
    assert not tf.verdict(_forward_result(rounding, median=(1e-6, 1e-6, 3e-4), rerouted=[0, 0, 3]))[0]
    assert not tf.verdict(_forward_result([1e-6, 1e-6, 1e-6], greedy=0.9))[0]
    assert tf.verdict(_forward_result([1e-6, 2e-6, 5e-3]))[0]  # a dense target within rounding
    with pytest.raises(ValueError, match="did not run: .*sinks"):
        tf.verdict(_forward_result(rounding, flex_error="RuntimeError: Attention sinks cannot be run on CPU"))


def test_attn_check_verdict_names_an_unreadable_file(tmp_path):
    """``target_forward.py --verdict FILE`` on a missing or non-JSON file exits with a message naming the file,
    not a traceback."""
    import target_forward as tf

    bad = tmp_path / "half.json"
    bad.write_text('{"rows": [')
    for path in (tmp_path / "missing.json", bad):
        with pytest.raises(SystemExit) as e:
            tf.main(["--verdict", str(path)])
        assert str(path) in str(e.value.code) and "cannot read" in str(e.value.code)


def test_agreement_counts_rerouted_tokens_and_tokens_off():
    """``target_forward.agreement``: per tapped layer the largest and the median token's difference, the tokens
    off, and the tokens whose experts changed in a layer BEFORE the tap (aux id i = the output of layer i - 1)."""
    import torch

    import target_forward as tf

    g = torch.Generator().manual_seed(0)
    ref = {"aux": torch.randn(1, 200, 3 * 8, generator=g, dtype=torch.float64), "last": torch.ones(1, 200, 8),
           "argmax": torch.zeros(1, 200, dtype=torch.long)}
    f = {k: v.clone() for k, v in ref.items()}
    f["aux"][0, 7, 16:] += 1.0  # token 7 differs at the third tapped layer only
    f["argmax"][0, 0] = 1
    routes = {i: torch.tensor([[0, 1]] * 200) for i in range(6)}
    moved = {**routes, 4: routes[4].clone()}
    moved[4][7] = torch.tensor([0, 2])  # token 7 got another expert in layer 4
    out = tf.agreement(f, ref, [2, 4, 6], moved, routes)
    assert out["aux_rel_max_diff_by_layer"][:2] == [0.0, 0.0] and out["aux_rel_max_diff_by_layer"][2] > 0.1
    assert out["aux_tokens_off_by_layer"] == pytest.approx([0.0, 0.0, 1 / 200]) and out["aux_token_rel_diff_median_by_layer"][2] == 0
    assert out["routing_changed_tokens_by_layer"] == {"0": 0, "1": 0, "2": 0, "3": 0, "4": 1, "5": 0}
    assert out["routing_changed_before_tap"] == [0, 0, 1]  # layer 4 is before aux id 6, not before aux id 4
    assert out["argmax_equal"] == pytest.approx(199 / 200)


def test_regen_compiles_cpu_smoke(tmp_path):
    """``benchmarks/regen_compiles.py --smoke``: the static engine's batch call on the tiny GPT-OSS target, compiled
    with TorchDynamo on a CPU: the first batch compiles, a new prompt bucket does not, a new batch size compiles
    once more, and a third size no more (the batch dimension is dynamic then) -- what docs/real_shapes.md says
    of the 20B target's prepare."""
    import regen_compiles

    out = tmp_path / "rc.json"
    result = regen_compiles.main(["--smoke", "--out", str(out)])
    assert json.loads(out.read_text()) == result and result["meta"]["backend"] == "eager"
    rows = result["batches"]
    assert [(r["batch"], r["bucket"]) for r in rows] == [(4, 384), (4, 256), (3, 128), (2, 128)]
    assert rows[0]["frames_compiled"] > 0 and rows[1]["frames_compiled"] == 0
    assert rows[2]["frames_compiled"] > 0 and rows[3]["frames_compiled"] == 0
    with pytest.raises(ValueError, match="expected BxL"):
        regen_compiles.parse_batch("48")


@pytest.mark.usefixtures("torch_single_thread")
def test_real_shape_attn_check(tmp_path):
    """``real_shape_experiment.sh attn-check``: float32 eager against flex_attention on the same weights, exit 0
    only when they agree (tiny Llama-3.1 on CPU: they do); a variant that cannot run (flex attention with GPT-OSS's
    sinks on a CPU) exits non-zero with the reason, so no online run is switched to it."""
    import os
    import subprocess

    env = {**os.environ, "TINY": "1", "LENGTH": "64", "WORK": str(tmp_path / "work"),
           "PEAGLE_CACHE": str(tmp_path / "cache")}
    script = str(ROOT / "benchmarks" / "real_shape_experiment.sh")
    ok = subprocess.run(["bash", script, "attn-check", "llama-3.1-8b"], cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=300)
    assert ok.returncode == 0 and "flex_attention AGREES" in ok.stdout, ok.stdout[-2000:] + ok.stderr[-2000:]
    rows = json.loads((tmp_path / "work" / "attn-check-llama-3.1-8b.json").read_text())["rows"]
    assert [r["variant"] for r in rows] == ["eager/keep", "flex_attention/keep", "eager/eager"]
    assert [r["runs_with"]["attn"] for r in rows[:2]] == ["eager", "flex_attention"]
    assert "routing_changed_before_tap" not in rows[1]  # a dense target: no routers to record
    sinks = subprocess.run(["bash", script, "attn-check", "gpt-oss-20b"], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=300)
    assert sinks.returncode != 0 and "did not run" in sinks.stderr and "sinks" in sinks.stderr


def test_real_shape_experiment_cpu_smoke(tmp_path):
    """``TINY=1 bash benchmarks/real_shape_experiment.sh lease ARCH`` then ``wait``: every stage of the recipe
    runs through peagle-train (tiny Llama-3.1 configuration on CPU), check passes, and the summary holds the
    per-stage records, both trainers' tokens/s and the cache's bytes per token."""
    import os
    import subprocess

    work = tmp_path / "work"
    env = {**os.environ, "TINY": "1", "WORK": str(work), "PEAGLE_CACHE": str(tmp_path / "cache"),
           "ATTN_CHECK": "llama-3.1-8b", "LENGTH": "64", "PLAN_N": "", "PLAN_N_llama_3_1_8b": "800",  # per ARCH
           "PLAN_OVERRIDES": "train.max_steps=8"}
    script = str(ROOT / "benchmarks" / "real_shape_experiment.sh")
    # the GPU machine's way: `lease` runs the plan (attn-check, run, pack, online-n, summary) in the background and
    # `wait` follows it and brings back the log, summary, step logs and packed prepared data
    lease = subprocess.run(["bash", script, "lease", "llama-3.1-8b"], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=60)
    assert lease.returncode == 0 and "started in the background" in lease.stdout, lease.stdout + lease.stderr
    back = tmp_path / "back"
    waited = subprocess.run(["bash", script, "wait", "900", str(back)], cwd=ROOT, env=env, capture_output=True,
                            text=True, timeout=960)
    log = (work / "plan.log").read_text()
    assert "wait: the plan finished" in waited.stdout and "FAILED" not in log, waited.stdout[-2000:] + log[-3000:]
    assert "check: passed" in log and "flex_attention AGREES" in log and "micro-batch" in log
    assert "plan: run llama-3.1-8b target.attn_implementation=flex_attention" in log  # the features on flex ...
    stamp = (work / "llama-3.1-8b" / "run_config.yaml").read_text()
    assert "attn_implementation: null" in stamp  # ... the regeneration on the default kernel
    assert {p.name for p in back.iterdir()} == {"plan.log", "summary.json", "logs.tar.xz", "llama-3.1-8b-prepared.tar.xz",
                                                "llama-3.1-8b-prepared.tar.xz.sha256"}
    assert not [p for p in work.glob("llama-3.1-8b*/features/*/*") if p.name != "manifest.json"]  # shards deleted
    # the disk of a GPU machine: the fp32 drafters are deleted too, the export stays
    assert (work / "llama-3.1-8b" / "export").is_dir() and not list(work.glob("llama-3.1-8b*/drafter"))
    assert "dropped " in log
    # `run` again (a later call): what was dropped is not rebuilt (no cache, no training), eval runs again
    rerun = subprocess.run(["bash", script, "run", "llama-3.1-8b"], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=600)
    assert rerun.returncode == 0 and "check: passed" in rerun.stdout, rerun.stdout[-2000:] + rerun.stderr[-2000:]
    assert "cache: started" not in rerun.stdout and "train: started" not in rerun.stdout
    packed = back / "llama-3.1-8b-prepared.tar.xz"
    runs = json.loads((back / "summary.json").read_text())["runs"]["llama-3.1-8b"]
    assert runs["llama-3.1-8b-online-800"]["trainer"]["tokens_per_s"] > 0  # online-n: the trainer ...
    (bench,) = runs["drafter_only"].values()  # ... beside the drafter-only step of the same micro-batch
    assert bench["meta"]["micro_batch"] == runs["llama-3.1-8b-online-800"]["trainer"]["recipe"]["micro_batch_size"]
    assert bench["meta"]["shape"] == "llama-3.1-8b-tiny-recipe" and "error" not in bench["rows"][0], bench["rows"]
    assert bench["rows"][0]["tokens_per_s"] > 0
    # pack: the prepared data comes back from one machine and the next run starts from it (prepare reused);
    # a tarball that does not match its sha256 is refused before anything is unpacked
    env2 = {**env, "WORK": str(tmp_path / "work2"), "PREPARED": str(packed)}
    again = subprocess.run(["bash", script, "run", "llama-3.1-8b"], cwd=ROOT, env=env2, capture_output=True,
                           text=True, timeout=900)
    assert again.returncode == 0 and "prepared data unpacked" in again.stdout, again.stdout[-2000:] + again.stderr[-2000:]
    assert "prepare: reused (data/meta.json exists)" in again.stdout and "check: passed" in again.stdout
    # online-n alone on a fresh machine: from the pack too
    env4 = {**env, "WORK": str(tmp_path / "work4"), "PREPARED": str(packed)}
    alone = subprocess.run(["bash", script, "online-n", "llama-3.1-8b", "800"], cwd=ROOT, env=env4, capture_output=True,
                           text=True, timeout=900)
    assert alone.returncode == 0 and "prepared data unpacked" in alone.stdout, alone.stdout[-2000:] + alone.stderr[-2000:]
    assert (tmp_path / "work4" / "bench-llama-3.1-8b-800.json").is_file()
    with packed.open("ab") as f:
        f.write(b"x")
    env3 = {**env2, "WORK": str(tmp_path / "work3")}
    bad = subprocess.run(["bash", script, "run", "llama-3.1-8b", "--quiet"], cwd=ROOT, env=env3, capture_output=True,
                         text=True, timeout=300)
    assert bad.returncode != 0 and "FAILED" in bad.stdout + bad.stderr and not (tmp_path / "work3").exists()
    assert [s["stage"] for s in runs["llama-3.1-8b"]["stages"]] == ["prepare", "cache", "train", "export", "eval"]
    assert [s["stage"] for s in runs["llama-3.1-8b-online"]["stages"]] == ["train"]
    for name in ("llama-3.1-8b", "llama-3.1-8b-online"):
        assert runs[name]["trainer"]["tokens_per_s"] > 0, runs[name]["trainer"]
    assert {c["split"] for c in runs["llama-3.1-8b"]["cache"]} == {"train", "eval"}
    assert all(c["bytes_per_token"] > 0 for c in runs["llama-3.1-8b"]["cache"])
    bf16, fp8 = ({c["split"]: c for c in runs[n]["cache"]}["train"] for n in ("llama-3.1-8b", "llama-3.1-8b-fp8"))
    assert (bf16["dtype"], fp8["dtype"]) == ("bfloat16", "fp8") and fp8["bytes_per_token"] < bf16["bytes_per_token"]
    assert "OK" in runs["llama-3.1-8b"]["check"]


def test_real_shape_short_runs_the_late_stages_of_gpt_oss(tmp_path):
    """``short gpt-oss-20b`` (TINY=1): on prepared data (sliding window 16, prompts longer than it), a short online
    training, export, ``check`` and eval, which must be lossless: the stages a GPU machine with a few minutes left
    can still finish (the H200's GPT-OSS-20B eval failed at 91214da with transformers 5.17, docs/real_shapes.md)."""
    import os
    import subprocess

    work = tmp_path / "work"
    env = {**os.environ, "TINY": "1", "WORK": str(work), "PEAGLE_CACHE": str(tmp_path / "cache"), "SHORT_STEPS": "3"}
    script = str(ROOT / "benchmarks" / "real_shape_experiment.sh")
    early = subprocess.run(["bash", script, "short", "gpt-oss-20b"], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=60)  # before prepare: refused, naming the folder and what to do
    assert early.returncode == 2 and f"short: no prepared data in {work}/gpt-oss-20b/data" in early.stderr, early.stderr
    assert "PREPARED=" in early.stderr and not (work / "gpt-oss-20b-short").exists()
    prep = subprocess.run(["bash", script, "prepare", "gpt-oss-20b"], cwd=ROOT, env=env, capture_output=True,
                          text=True, timeout=300)
    assert prep.returncode == 0, prep.stdout[-2000:] + prep.stderr[-2000:]
    short = subprocess.run(["bash", script, "short", "gpt-oss-20b"], cwd=ROOT, env=env, capture_output=True,
                           text=True, timeout=600)
    out = short.stdout + short.stderr
    assert short.returncode == 0 and "check: passed" in out, out[-3000:]
    assert "lossless (greedy == target alone): True" in out, out[-3000:]
    o = work / "gpt-oss-20b-short"
    assert (o / "export" / "config.json").is_file() and not (o / "drafter").exists()
    stages = [json.loads(x)["stage"] for x in (o / "logs" / "stages.jsonl").read_text().splitlines()]
    assert stages == ["train", "export", "eval"]


@pytest.mark.parametrize("shape, spec, recipe, extra", [
    ("gpt-oss-20b-recipe", "pkg:peagle_train/gpt-oss-20b.json", "recipes/gpt-oss-20b.yaml", []),
    ("llama-3.1-8b-recipe", "pkg:peagle_train/llama-3.1-8b-instruct.json", "recipes/llama-3.1-8b.yaml", []),
    ("llama-3.1-8b-tiny-recipe", "pkg:peagle_train/llama-3.1-8b-tiny.json", "recipes/llama-3.1-8b.yaml",
     ["drafter.draft_vocab_size=1024"]),
    ("gpt-oss-20b-tiny-recipe", "pkg:peagle_train/gpt-oss-20b-tiny.json", "recipes/gpt-oss-20b.yaml",
     ["drafter.draft_vocab_size=1024"])])  # the CPU smoke of real_shape_experiment.sh (TINY=1)
def test_recipe_shapes_are_the_drafters_the_recipes_build(bench, shape, spec, recipe, extra):
    """The benchmark's ``*-recipe`` shapes (the drafter-only step beside the real-shape online trainer) are the
    drafter ``make_drafter_config`` builds for the recipe from the shipped real configuration: same widths, heads,
    intermediate size, vocabulary and draft vocabulary (the recipe's ``drafter.draft_vocab_size``, None = V)."""
    from peagle_train.features.target import random_target_config
    from peagle_train.model.drafter import make_drafter_config
    from peagle_train.recipe import load_config

    tconf = random_target_config(spec)
    cfg = load_config(recipe, ["target.path=null", f"target.random_init_from_config={spec}", *extra])
    vd = cfg.drafter.draft_vocab_size or tconf.vocab_size
    d = make_drafter_config(tconf, aux_layer_ids=[2, 3, 4], draft_vocab_size=vd, mask_token_id=cfg.drafter.mask_token_id,
                            num_layers=cfg.drafter.num_layers)
    want = {k: getattr(d, k) for k in ("hidden_size", "num_attention_heads", "num_key_value_heads", "head_dim",
                                       "intermediate_size", "vocab_size")}
    got = {k: v for k, v in bench.SHAPES[shape].items() if k in want}
    assert got == want and bench.SHAPES[shape]["draft_vocab"] == vd


def test_decode_attention_kernels_cpu_smoke(tmp_path):
    """``benchmarks/decode_attention_kernels.py --smoke``: every decoding-attention candidate of the
    regeneration step runs on the same tiny left-padded batch and equals the float32 reference (a variant
    with a wrong mask, e.g. one attending to the unwritten cache tail, would be off by far more); a variant
    this torch cannot run is an error row, not a lost run; the JSON names the command."""
    import decode_attention_kernels as dak

    out = tmp_path / "d.json"
    res = dak.main(["--smoke", "--fills", "0.5", "1.0", "--out", str(out)])
    assert json.loads(out.read_text()) == res
    assert res["meta"]["command"] == f"python benchmarks/decode_attention_kernels.py --smoke --fills 0.5 1.0 --out {out}"
    assert [(r["L"], r["fill"]) for r in res["rows"]] == [(256, 0.5), (256, 1.0)]
    for row in res["rows"]:
        v = row["variants"]
        for name in ("sdpa_expanded", "sdpa_folded", "bmm_bf16", "flex"):
            assert v[name]["max_abs_err"] < 1e-5 and v[name]["ms"] > 0, name
        assert v["sdpa_nomask"]["max_abs_err"] is None and "ms" in v["flex_mask_only"]
        assert "error" in v["sdpa_folded_efficient"] or v["sdpa_folded_efficient"]["max_abs_err"] < 1e-5
        assert "RuntimeError: the Triton decoding kernel needs Triton and a CUDA device" in v["triton_splitk_c256"]["error"]
    q, k, v_, start, pos = dak.make_inputs(4, 9, 3, 64, 256, 0.5, "cpu", torch.float32)
    wrong = torch.nn.functional.scaled_dot_product_attention(q, k, v_, enable_gqa=True)  # no mask
    assert (wrong - dak.reference(q, k, v_, start, pos)).abs().max() > 1e-2


def test_cpu_ablation_smoke(tmp_path, capsys):
    """``benchmarks/cpu_ablation.py``: the committed regenerated shards as a chat JSONL, prepare and cache
    once, two variants trained by ``peagle-train train`` from copies of the same data for the same steps;
    one JSON with the command, the data and each variant's eval. The target-started drafter begins far
    closer to the target (its eval loss after two steps is below the random start's)."""
    from conftest import need_smollm2

    need_smollm2()
    import cpu_ablation

    out = tmp_path / "abl.json"
    args = ["--out", str(out), "--work", str(tmp_path / "w"), "--conversations", "40", "--steps", "2",
            "--eval-every", "1", "--max-length", "256", "--eval-fraction", "0.1"]
    assert cpu_ablation.main(args) == 0
    got = json.loads(out.read_text())
    assert got["command"] == "python benchmarks/cpu_ablation.py " + " ".join(args)
    assert got["data"]["train"]["sequences"] > 0 and got["data"]["eval"]["sequences"] > 0
    v = got["variants"]
    assert set(v) == {"random", "target"} and v["target"]["overrides"] == ["drafter.init_layers=target"]
    assert v["random"]["steps"] == v["target"]["steps"] == 2
    assert [c["step"] for c in v["random"]["eval_curve"]] == [1]  # the last step's eval is the final one
    point = v["random"]["eval_curve"][0]  # accuracy by depth at each eval step: how depths learn over steps
    assert len(point["eval_acc"]) == len(point["eval_cond_acc"]) == 8 and point["eval_cond_acc"][0] == point["eval_acc"][0]
    assert point["sim_al_k7"] >= 1.0 and point["walk_al_k7"] >= 1.0
    assert v["target"]["eval_loss"] < v["random"]["eval_loss"]
    printed = capsys.readouterr().out
    assert "random: 2 steps" in printed and "target: 2 steps" in printed


@pytest.mark.usefixtures("torch_single_thread")
def test_cache_report_cpu_smoke(tmp_path, capsys):
    """``benchmarks/cache_report.py`` on the real SmolLM2 and three ShareGPT conversations: regenerated,
    cached in bf16 and fp8, read back against the float32 reference. fp8 takes about half the bytes of
    bf16 and errs more; both keep the argmax; the regeneration is reused when run again."""
    from conftest import need_smollm2

    need_smollm2()
    import cache_report

    out = tmp_path / "r.json"
    args = ["--conversations", "3", "--max-new-tokens", "4", "--batch-size", "2", "--shard-size", "2",
            "--verify", "1", "--workdir", str(tmp_path / "w"), "--out", str(out)]
    cache_report.main(args)
    r = json.loads(out.read_text())
    assert r["regeneration"]["conversations_out"] == 3 and r["tokenized"]["sequences"] == 3
    bf16, fp8 = r["caches"]["bfloat16"], r["caches"]["fp8"]
    assert bf16["size"]["tokens"] == fp8["size"]["tokens"] == r["tokenized"]["tokens"]
    assert 0.4 < fp8["size"]["bytes_per_token"] / bf16["size"]["bytes_per_token"] < 0.6
    e16, e8 = bf16["readback_vs_fp32"], fp8["readback_vs_fp32"]
    assert 0 < e16["aux"]["rel_mean"] < 0.005 and e16["aux"]["rel_mean"] < e8["aux"]["rel_mean"] < 0.05
    assert e16["argmax_agreement"] > 0.9 and e8["argmax_agreement"] > 0.9
    assert [v["sequence"] for v in fp8["verify_against"]] == [0]
    assert f"wrote {out}" in capsys.readouterr().out
    regen = list((tmp_path / "w").glob("regen-*.json"))
    assert len(regen) == 1
    stamp = regen[0].stat().st_mtime_ns
    cache_report.main(args)
    assert regen[0].stat().st_mtime_ns == stamp  # reused, not regenerated


def test_decode_profile_cpu_smoke(tmp_path, capsys):
    """``benchmarks/decode_profile.py --smoke``: the target's forward per query length through each kind of
    TargetRunner (dynamic, static, inductor, compiled: the last two eager on a CPU), each call leaving the cache at its length, and a
    profile of the last kind's calls; the runners leave no hook on the target and the command is recorded."""
    import decode_profile

    out = tmp_path / "dp.json"
    result = decode_profile.main(["--smoke", "--lengths", "1", "3", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    meta = result["meta"]
    assert meta["command"] == f"python benchmarks/decode_profile.py --smoke --lengths 1 3 --out {out}"
    assert meta["layers"] == 8 and meta["gpu"] is None and "commit" in meta
    assert list(result["kinds"]) == ["dynamic", "static", "inductor", "compiled"]
    # no --attn: the recipe's own attention (transformers' choice for the tiny Llama), recorded
    assert meta["attn_default"] == "sdpa" and meta["attn"] == ["sdpa"]
    assert all(r["attn"] == "sdpa" for r in result["kinds"].values())
    runners = [r["runner"] for r in result["kinds"].values()]
    assert runners == ["dynamic", "static", "static", "static"]  # compile (inductor alone or with CUDA graphs): CUDA only
    for r in result["kinds"].values():
        assert set(r["per_length"]) == {"1", "3"} and all(x["median_ms"] > 0 for x in r["per_length"].values())
        assert r["fallback"] is None and r["cudagraph_skips"] == []
    prof = result["kinds"]["compiled"]["profile"]
    assert prof["length"] == 3 and prof["calls"] == 2 and prof["device_ms_per_call"] is None
    assert any(row["name"] == "aten::mm" for row in prof["by_self_cpu"])  # the layers' matmuls were seen
    assert "profile" not in result["kinds"]["dynamic"]
    with pytest.raises(SystemExit):
        decode_profile.parse_args(["--smoke", "--lengths", "0"])


def test_decode_profile_times_each_attention_implementation(tmp_path):
    """``decode_profile.py --smoke --attn eager sdpa``: every kind again per attention implementation, each a load
    of the same weights; the recipe's own attention (``sdpa``, transformers' choice for the tiny Llama) keeps the
    plain kind names, eager's entries are ``KIND@eager``; each entry records its ``attn``, the last kind of each
    implementation is profiled, and a repeated name is timed once."""
    import decode_profile

    out = tmp_path / "dp.json"
    result = decode_profile.main(["--smoke", "--lengths", "1", "2", "--kinds", "dynamic", "compiled",
                                  "--attn", "eager", "sdpa", "eager", "--out", str(out)])
    assert json.loads(out.read_text()) == result
    assert result["meta"]["attn_default"] == "sdpa" and result["meta"]["attn"] == ["eager", "sdpa"]
    kinds = result["kinds"]
    assert list(kinds) == ["dynamic@eager", "compiled@eager", "dynamic", "compiled"]
    assert [r["attn"] for r in kinds.values()] == ["eager", "eager", "sdpa", "sdpa"]
    assert [r["runner"] for r in kinds.values()] == ["dynamic", "static"] * 2
    assert ["profile" in r for r in kinds.values()] == [False, True] * 2
    for r in kinds.values():
        assert set(r["per_length"]) == {"1", "2"} and r["fallback"] is None
    assert decode_profile.parse_args(["--smoke", "--attn", "sdpa", "sdpa"]).attn == ["sdpa"]
    assert decode_profile.parse_args(["--smoke"]).attn is None


@pytest.mark.usefixtures("torch_single_thread")
def test_prefix_attention_cpu_smoke(tmp_path, capsys):
    """``benchmarks/prefix_attention.py`` on the tiny shape: the grid's prefix rows (default and one
    kernel-options variant), the causal FlexAttention row and the causal SDPA reference, each with its
    (query, key) pair count; eager FlexAttention has no backward on CPU, so its rows are forward only."""
    import prefix_attention as pa
    from chain_kernel import make_grid

    out = tmp_path / "p.json"
    rows = pa.main(["--shape", "tiny", "--N", "256", "--repeats", "1", "--options", '{"BLOCK_M": 64}',
                    "--autotune", "--out", str(out)])
    assert [r["impl"] for r in rows] == ["flex", 'flex {"BLOCK_M": 64}', "flex max-autotune", "flex_causal",
                                         "sdpa_causal"]
    assert rows[2]["pairs"] == rows[0]["pairs"] and rows[2]["blocks_partial"] == rows[0]["blocks_partial"]
    written = json.loads(out.read_text())["rows"]
    assert written == rows
    # five cases compile flex_attention again and again: past dynamo's limit the GPU run goes eager and out of memory
    assert torch._dynamo.config.recompile_limit >= pa.recompiles_needed(5) > 3 * 5
    rows = [r for r in rows if r["impl"] != "flex max-autotune"]  # the checks below index the other four
    assert all("error" not in r and r["fwd_ms"] > 0 for r in rows), rows
    grid = make_grid(256, 8, 0.7, 0.2, torch.Generator().manual_seed(0), 1024)
    real = [(int(p), int(d)) for p, d, doc in zip(grid.position_ids, grid.depth, grid.doc) if doc >= 0]
    assert rows[0]["pairs"] == sum(p - d + 1 for p, d in real) > 256 * 257 // 2  # every depth adds queries
    assert rows[2]["pairs"] == rows[3]["pairs"] == 256 * 257 // 2 and rows[3]["rows"] == 256
    assert rows[3]["fwd_bwd_ms"] > 0 and rows[3]["fwd_bwd_tflops"] > 0  # SDPA has a backward on CPU
    assert rows[3]["fwd_gpu_clocks"] is None and rows[3]["fwd_bwd_gpu_clocks"] is None  # no card to sample
    data = json.loads(out.read_text())
    assert data["meta"]["command"].startswith("python benchmarks/prefix_attention.py")
    assert "prefix attention, tiny" in capsys.readouterr().out
    assert rows[0]["blocks_partial"] > 0 and 0.5 < rows[0]["block_fill"] <= 1.0 and "blocks_full" not in rows[2]
    tiling = pa.main(["--shape", "tiny", "--N", "256", "2048", "--blocks-only", "--out", str(out)])
    assert (tiling[0]["pairs"], tiling[0]["blocks_partial"]) == (rows[0]["pairs"], rows[0]["blocks_partial"])
    assert tiling[1]["blocks_full"] > 0 and tiling[1]["block_fill"] > tiling[0]["block_fill"]  # longer: fuller
    with pytest.raises(SystemExit, match="--options .* is not JSON"):
        pa.main(["--shape", "tiny", "--N", "256", "--options", "BLOCK_M=64", "--out", str(out)])
    # --partitions 2: the trainer's two segments, padded to the bucket; the second computes the depth-0 context
    # copies of the first half's anchors again, so the two hold more pairs than the whole grid, and no pair is lost
    segs = pa.main(["--shape", "tiny", "--N", "2048", "--blocks-only", "--partitions", "2", "--out", str(out)])
    assert [r["impl"] for r in segs] == ["flex segment 0/2", "flex segment 1/2"]
    assert all(r["E"] % 1024 == 0 for r in segs) and sum(r["E"] for r in segs) > tiling[1]["E"]
    copies = 1024 * 1025 // 2  # the depth-0 rows of anchors 0..1023 (< N / 2) attend causally among themselves again
    assert sum(r["pairs"] for r in segs) == tiling[1]["pairs"] + copies
    with pytest.raises(SystemExit, match="--partitions must be >= 1"):
        pa.main(["--shape", "tiny", "--N", "256", "--partitions", "0", "--out", str(out)])
    assert all(r["lse_grad"] for r in rows) and data["meta"]["backward_of"] == "sum(out * go) + sum(lse * gl)"


@pytest.mark.usefixtures("torch_single_thread")
def test_prefix_attention_writes_each_row_as_it_ends(tmp_path, monkeypatch):
    """A run killed in a row (a kernel that aborts the process, here an interrupt in the second row's timing) leaves
    ``--out`` whole with the rows that ended before it, and no temporary file."""
    import prefix_attention as pa

    calls = []
    real = pa.timed

    def dying(fn, *a, **k):
        calls.append(1)
        if len(calls) == 3:  # the first row times forward and forward + backward; this is the second row's forward
            raise KeyboardInterrupt
        return real(fn, *a, **k)

    monkeypatch.setattr(pa, "timed", dying)
    out = tmp_path / "p.json"
    with pytest.raises(KeyboardInterrupt):
        pa.main(["--shape", "tiny", "--N", "256", "--repeats", "1", "--options", '{"BLOCK_M": 64}', "--out", str(out)])
    data = json.loads(out.read_text())
    assert [r["impl"] for r in data["rows"]] == ["flex"] and data["meta"]["command"].startswith("python benchmarks/")
    assert not list(tmp_path.glob("*.tmp"))


@pytest.mark.usefixtures("torch_single_thread")
def test_prefix_attention_without_the_lse_gradient(tmp_path):
    """``--no-lse-grad`` (for kernels that cannot differentiate through ``lse``, FlexAttention's ``BACKEND: FLASH``):
    every row is timed on ``sum(out * go)`` alone and says so, FlexAttention is called without ``return_lse``, and the
    gradients equal those of the objective with a zero ``lse`` cotangent (float64, dense reference); with a nonzero
    one they differ, so the flag changes what is differentiated."""
    import prefix_attention as pa

    out = tmp_path / "p.json"
    rows = pa.main(["--shape", "tiny", "--N", "256", "--repeats", "1", "--no-lse-grad", "--options",
                    '{"BLOCK_M": 64}', "--out", str(out)])
    assert [r["impl"] for r in rows] == ["flex", 'flex {"BLOCK_M": 64}', "flex_causal", "sdpa_causal"]
    assert all(r["lse_grad"] is False and "error" not in r for r in rows), rows
    assert rows[3]["fwd_bwd_ms"] > 0  # SDPA has a backward on CPU
    assert json.loads(out.read_text())["meta"]["backward_of"] == "sum(out * go)"
    calls = []

    def fake_flex(q, k, v, block_mask=None, return_lse=False, return_aux=None, **kw):  # causal, dense, float64
        wants = bool(return_lse) or return_aux is not None  # (the lse API of the torch at hand, _flex_call)
        calls.append(wants)
        o = F.scaled_dot_product_attention(q, k.repeat_interleave(2, 1), v.repeat_interleave(2, 1), is_causal=True)
        lse = torch.logsumexp((q @ k.repeat_interleave(2, 1).transpose(-1, -2)) / q.shape[-1] ** 0.5
                              + torch.full((q.shape[2], q.shape[2]), float("-inf"), dtype=q.dtype).triu(1), -1)
        if return_aux is not None:
            return o, SimpleNamespace(lse=lse)
        return (o, lse) if return_lse else o

    g = torch.Generator().manual_seed(0)
    q, go = (torch.randn(1, 4, 8, 16, generator=g, dtype=torch.float64) for _ in range(2))
    k, v = (torch.randn(1, 2, 8, 16, generator=g, dtype=torch.float64) for _ in range(2))
    gl = torch.randn(1, 4, 8, generator=g, dtype=torch.float64)
    without = pa.objective_grads(pa.flex_fn(None, None, fake_flex, lse=False), q, k, v, go, None)
    zero = pa.objective_grads(pa.flex_fn(None, None, fake_flex), q, k, v, go, torch.zeros_like(gl))
    withl = pa.objective_grads(pa.flex_fn(None, None, fake_flex), q, k, v, go, gl)
    assert calls == [False, True, True]
    assert all(torch.allclose(a, b, atol=1e-12) for a, b in zip(without, zero))
    assert not torch.allclose(without[0], withl[0])


def test_flop_recount_restores_every_layers_attention_in_a_one_layer_row(bench, tmp_path):
    """``benchmarks/flop_recount.py``: a row counted the old way (one layer's attention) is recounted to the
    count ``train_step.flops`` gives now, with the pair count recovered exactly; ``meta.frozen`` naming a
    module (``lm_head``) freezes its weight (4 instead of 6 FLOPs per head weight and element); a count that is
    not one of this shape's is refused naming the row."""
    import flop_recount as fr

    for frozen in ([], ["lm_head"]):
        d = fr.meta_drafter("tiny", 256, frozen)
        assert d.lm_head.weight.requires_grad is (not frozen) and d.layers[0].self_attn.q_proj.weight.is_meta
        E, N, pairs = 3 * 1024, 1000, 1_234_567
        old = bench.dense_flops(d, E, N) + bench.attention_flops(d, pairs) / len(d.layers)
        row = {"N": N, "S": 1, "positions": E, "flop": old, "step_ms": 100.0}
        out = fr.recount_row(d, row, matmul_tflops=1.0)
        assert out["attention_pairs"] == pairs and out["flop"] == bench.flops(d, E, pairs, N)
        assert out["tflops"] == pytest.approx(out["flop"] / 0.1 / 1e12) and out["fraction_of_matmul_rate"] == out["tflops"]
    with pytest.raises(ValueError, match="row N = 1000"):
        fr.recount_row(d, dict(row, flop=bench.dense_flops(d, E, N) / 2), None)
    src = tmp_path / "rows.json"
    src.write_text(json.dumps({"meta": {"shape": "tiny", "draft_vocab": 256, "frozen": ["lm_head"],
                                        "bf16_matmul_tflops": 2.0}, "rows": [row, {"N": 5, "error": "OOM"}]}))
    res = fr.main([str(src), "--out", str(tmp_path / "r.json")])  # no meta.trainable_params: not checked
    assert [r["attention_pairs"] for r in res["files"][str(src)]["rows"]] == [pairs]  # the failed row is skipped
    assert json.loads((tmp_path / "r.json").read_text())["meta"]["command"].startswith("python benchmarks/flop_recount.py")
    meta = json.loads(src.read_text())
    meta["meta"]["trainable_params"] = sum(p.numel() for p in fr.meta_drafter("tiny", 256, []).parameters())
    src.write_text(json.dumps(meta))  # the count of a trained head, where the file froze it
    with pytest.raises(SystemExit, match="rows.json: the file trained .* not a file this script can recount"):
        fr.main([str(src), "--out", str(tmp_path / "r.json")])
