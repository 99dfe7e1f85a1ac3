#!/usr/bin/env bash
# The production recipes end to end at their REAL shapes with RANDOM weights on one GPU (docs/real_shapes.md;
# issue 22): recipes/gpt-oss-20b.yaml against a target built from the real GPT-OSS-20B configuration (mixture of
# experts, alternating sliding-window / full attention, 201,088-token vocabulary) and recipes/llama-3.1-8b.yaml
# against Llama-3.1-8B's (dense, 128,256), each with its stand-in tokenizer (real vocabulary size, special ids and
# chat template). Every stage runs through `peagle-train`; nothing is copied.
#
#   bash benchmarks/throughput_experiment.sh stage          # HERE (CPU): .gpu/ (wheels, ShareGPT prompts)
#   bash benchmarks/real_shape_experiment.sh setup          # GPU: wheels into /tmp/site
#   bash benchmarks/real_shape_experiment.sh run ARCH [override ...]
#        # ARCH = gpt-oss-20b | llama-3.1-8b. In $WORK/ARCH: prepare (regeneration of the prompts by the target,
#        # capped), cache (bf16), train on the cache, export, check, eval (target in float32 on a GPU: see
#        # below); then train with online features on the same prepared data in $WORK/ARCH-online; the cache
#        # again in fp8 in $WORK/ARCH-fp8 (bytes per token). Stages already done are reused (a call may stop
#        # at its time limit and the next call continues). Overrides apply to every stage. Feature shards and
#        # the throughput-only drafters are deleted once used (the disk: see `run`; KEEP_FEATURES=1 keeps them)
#   bash benchmarks/real_shape_experiment.sh online-n ARCH N [override ...]
#        # after `run ARCH`: the online trainer at micro-batches of ~N prepared tokens ($WORK/ARCH-online-N)
#        # beside benchmarks/train_step.py's drafter-only step of the same drafter, micro-batch and sequences
#        # (or with PREPARED=OUT.tar.xz of `pack`, on a fresh machine without `run`)
#   bash benchmarks/real_shape_experiment.sh short ARCH [override ...]
#        # after prepare (or with PREPARED=OUT.tar.xz of `pack`): a short online training (SHORT_STEPS, default 6),
#        # export, check and eval in $WORK/ARCH-short: the late stages alone, in a few minutes of a GPU machine
#   bash benchmarks/real_shape_experiment.sh attn-check ARCH [OUT.json]
#        # does transformers' flex_attention give the target's eager features? benchmarks/target_forward.py in
#        # float32 on one row of 3,439 random tokens, eager against flex_attention on the same weights (and eager
#        # attention with the other experts implementation, as context), each token's choice of experts recorded;
#        # exit 0 when its `verdict` holds: the first tapped layer agrees within 1e-4 (a wrong kernel, e.g. without
#        # the sinks or the sliding window, is off at the first layer already), the median token within 1e-4 at
#        # every tapped layer, <= 1 % of the tokens off by > 1e-2, a larger difference only after some token's
#        # routing changed (a near tie in a router's top-k that rounding flips), >= 99 % equal greedy tokens.
#        # Then `online-n ARCH N target.attn_implementation=flex_attention` trains online with it (GPT-OSS-20B:
#        # the forward of 3 x 3,439 tokens takes 286 ms instead of 1,208 ms in bf16, docs/real_shapes.md)
#   bash benchmarks/real_shape_experiment.sh pack ARCH OUT.tar.xz
#        # after prepare: the run's prepared data (run_config.yaml, data/: a few MB) packed with its sha256 beside
#        # it, to come back from the GPU machine; `PREPARED=OUT.tar.xz bash ... run ARCH` on a fresh machine unpacks
#        # it first (checksum verified) and prepare reuses it (the regeneration of the 20B target takes ~7 minutes)
#   bash benchmarks/real_shape_experiment.sh lease ARCH [ARCH ...]; bash ... wait SECONDS OUT_DIR
#        # everything above for each ARCH (`plan`: attn-check, run, pack, online-n 8192 and 4096, summary after each
#        # step) in the background, so a GPU machine works through calls of a limited length back to back: each
#        # call after the first is `wait SECONDS OUT_DIR`, which brings the log, summary and packs back
#   bash benchmarks/real_shape_experiment.sh summary OUT.json ARCH [ARCH ...]
#        # per stage: wall time and peak GPU memory (logs/stages.jsonl), the trainers' tokens/s and the
#        # planner's predicted peak against the measured one (trainer_throughput.py: "peak"), the cache's
#        # bytes per token (bf16 and fp8), check's verdict
#
# TINY=1 runs the same on a CPU with the tiny configurations of the same architectures (a smoke of this script;
# tests/integration/test_real_shapes_cpu.py pins the pipeline itself).
set -euo pipefail
export WORK=${WORK:-/tmp/peagle_real_shapes}  # (exported: the background plan of `lease` touches $WORK/plan.done)
export PYTHONUNBUFFERED=1 PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}"
cli() { if [ -x .venv/bin/peagle-train ]; then .venv/bin/peagle-train "$@"; else python3 -m peagle_train.cli "$@"; fi; }
py() { if [ -x .venv/bin/python ]; then .venv/bin/python "$@"; else python3 "$@"; fi; }
recipe() {  # EXPR RECIPE [override ...]: print the Python EXPR of `cfg`, the recipe loaded with the overrides (flags dropped)
  local expr=$1; shift
  py -c "import sys
from peagle_train.recipe import load_config
from peagle_train.features.target import materialise_target
cfg = load_config(sys.argv[1], [a for a in sys.argv[2:] if not a.startswith('--')])
print($expr)" "$@"
}

drop() {  # DIR: a feature cache's shards (its manifests stay) or a drafter folder, unless KEEP_FEATURES=1
  [ "${KEEP_FEATURES:-0}" = 1 ] && return 0
  if [ "$(basename "$1")" = features ]; then find "$1" -type f ! -name manifest.json -delete 2>/dev/null || true
  else rm -rf "$1"; fi
  echo "dropped $1 ($(df -h --output=avail "$WORK" | tail -n 1 | tr -d ' ') free)"
}

unpack() {  # RUN_DIR: with PREPARED=OUT.tar.xz (packed by `pack` on an earlier machine), its prepared data, checksum
  # verified first, unless RUN_DIR holds prepared data already
  if [ -n "${PREPARED:-}" ] && [ ! -f "$1/data/meta.json" ]; then
    (cd "$(dirname "$PREPARED")" && sha256sum -c "$(basename "$PREPARED").sha256")
    mkdir -p "$1" && tar -C "$1" -xJf "$PREPARED" && echo "prepared data unpacked from $PREPARED"
  fi
}

need_prepared() {  # RUN_DIR STEP: exit 2 with a message when RUN_DIR holds no prepared data (after `unpack`)
  [ -f "$1/data/meta.json" ] || { echo "$2: no prepared data in $1/data: run \`prepare ARCH\` or \`run ARCH\` there first, or set PREPARED=OUT.tar.xz (from \`pack\`)" >&2; exit 2; }
}

arch_overrides() {  # ARCH -> the recipe and the overrides that make it run here (printed one per line)
  local tiny=""; [ "${TINY:-0}" = 1 ] && tiny="-tiny"
  case "$1" in
    gpt-oss-20b) echo recipes/gpt-oss-20b.yaml; echo "target.random_init_from_config=pkg:peagle_train/gpt-oss-20b$tiny.json"
                 echo "target.tokenizer=stand-in:gpt-oss" ;;
    llama-3.1-8b) echo recipes/llama-3.1-8b.yaml
                  if [ -n "$tiny" ]; then echo target.random_init_from_config=pkg:peagle_train/llama-3.1-8b-tiny.json; else echo target.random_init_from_config=pkg:peagle_train/llama-3.1-8b-instruct.json; fi
                  echo "target.tokenizer=stand-in:llama-3.1" ;;
    *) echo "unknown ARCH $1 (gpt-oss-20b | llama-3.1-8b)" >&2; return 2 ;;
  esac
  echo target.path=null
  if [ "${TINY:-0}" = 1 ]; then
    printf '%s\n' target.dtype=float32 target.device=cpu target.attn_implementation=eager \
      target.feature_attn_implementation=null data.source=sharegpt \
      data.num_conversations=6 data.max_length=640 data.eval_fraction=0.34 regen.max_new_tokens=8 \
      drafter.draft_vocab_size=1024 train.K=3 train.partitions=1 "train.mixed_precision='no'" \
      train.activation_checkpointing=false train.max_steps=8 eval.max_new_tokens=6
  else  # one GPU, a few hundred prompts, answers capped; the recipe's drafter, K and partitions otherwise
    printf '%s\n' target.dtype=bfloat16 data.source=sharegpt data.path=.gpu/sharegpt_prompts.json \
      data.num_conversations=256 data.max_length=8192 data.eval_fraction=0.05 regen.max_new_tokens=256 \
      train.max_steps=40 eval.max_new_tokens=32
  fi
  printf '%s\n' data.max_prompt_tokens=2048 regen.batch_size=64 train.epochs=1 train.global_batch_size=null \
    "train.report_to=[]" train.eval_sequences=2 train.eval_every=null train.save_every=null \
    "eval.datasets=[mt_bench]" eval.num_prompts=2 eval.k_max=3 eval.both_turns=false
}

check_eval() {  # DIR [override ...] (with A set): `check` of DIR's export against the target's configuration, then
  # eval; on a GPU the target runs in float32 (`run`); returns eval's status
  local d=$1; shift
  cli check "$d/export" --target "$(recipe "materialise_target(cfg.target) / 'config.json'" "${A[@]}" "$@")" \
    > "$d/logs/check.txt" 2>&1 && echo "check: passed" || { echo "check: FAILED"; tail -n 20 "$d/logs/check.txt"; }
  local ev=(); [ "${TINY:-0}" = 1 ] || ev=(target.dtype=float32)
  cli eval "${A[@]}" "output_dir=$d" "$@" "${ev[@]}" || { local rc=$?; echo "eval: FAILED"; return $rc; }
}

case "${1:?step}" in
  setup)
    python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .gpu/whl/*.whl
    python3 -c "import torch, transformers; print('torch', torch.__version__, 'transformers', transformers.__version__,
      torch.cuda.get_device_name())" ;;
  run)  # ARCH [override ...]
    arch=${2:?arch}; shift 2
    mapfile -t A < <(arch_overrides "$arch")
    d="$WORK/$arch"
    unpack "$d"
    # stage by stage (each reuses what an earlier call finished); eval runs the target in float32 on a GPU: a
    # random-weight target's logits are near ties that bf16 rounding flips between the speculative and the
    # target-alone paths (docs/real_shapes.md), which would fail the lossless check for no fault of the drafter.
    # The GPU machine's disk (64 GiB) holds one 20B-shaped cache, not a cache, its fp8 copy and five fp32
    # drafters of up to 8 GB (Llama-3.1-8B's: 2.0B parameters in fp32): each cache's shards are deleted once its consumer is done (the manifests stay: bytes
    # per token), and so is the online run's drafter (its step times are the result); KEEP_FEATURES=1 keeps all
    read -r -a P <<< "${PREPARE_OVERRIDES:-}"  # prepare's own (after the others, so they win), e.g. the default
    # attention kernel for the regeneration while the feature forwards run on flex_attention (`plan`)
    bash "$0" prepare "$arch" "$@" "${P[@]}"
    # a stage whose output was dropped is not redone when a later call runs `run` again: the cache and its
    # training are done once train_metrics.json exists, the online run likewise, the fp8 cache once both
    # manifests say complete
    if [ ! -f "$d/train_metrics.json" ]; then
      for stage in cache train; do cli "$stage" "${A[@]}" "output_dir=$d" train.features=cache "$@"; done
    fi
    drop "$d/features"
    { [ ! -d "$d/drafter" ] && [ -f "$d/export/config.json" ]; } \
      || cli export "${A[@]}" "output_dir=$d" train.features=cache "$@"  # (the plan drops drafter/ after export)
    ev_rc=0; check_eval "$d" train.features=cache "$@" || ev_rc=$?
    o="$WORK/$arch-online"  # the same prepared data, features computed by the target inside the training loop
    mkdir -p "$o" && { [ -d "$o/data" ] || cp -r "$d/data" "$o/"; }
    [ -f "$o/train_metrics.json" ] || cli train "${A[@]}" "output_dir=$o" train.features=online "$@"
    drop "$o/drafter"
    f="$WORK/$arch-fp8"  # the same features stored in fp8 (data.cache_dtype): its bytes per token
    mkdir -p "$f" && { [ -d "$f/data" ] || cp -r "$d/data" "$f/"; }
    if ! cat "$f"/features/{train,eval}/manifest.json 2>/dev/null | grep -c '"complete": *true' | grep -qx 2; then
      cli cache "${A[@]}" "output_dir=$f" train.features=cache data.cache_dtype=fp8 "$@"
    fi
    drop "$f/features"
    exit "$ev_rc" ;;  # a failed eval fails the step, after the online and fp8 runs
  short)  # ARCH [override ...]: the stages after prepare on a short online training, in $WORK/ARCH-short: train
    # (SHORT_STEPS steps, default 6), export, check, eval (what a machine with a few minutes left can finish;
    # PREPARED=OUT.tar.xz of `pack` on a fresh machine)
    arch=${2:?arch}; shift 2
    mapfile -t A < <(arch_overrides "$arch")
    d="$WORK/$arch"; o="$WORK/$arch-short"
    unpack "$d"
    need_prepared "$d" short
    mkdir -p "$o" && { [ -d "$o/data" ] || cp -r "$d/data" "$o/"; }
    S=(train.features=online "train.max_steps=${SHORT_STEPS:-6}" "$@")
    cli train "${A[@]}" "output_dir=$o" "${S[@]}" > "$o/train.log" 2>&1 || { tail -n 20 "$o/train.log"; exit 1; }
    cli export "${A[@]}" "output_dir=$o" "${S[@]}"
    check_eval "$o" "${S[@]}"
    drop "$o/drafter" ;;
  prepare)  # ARCH [override ...]: the prepare stage of `run` alone, e.g. with regen.enabled=false
    # data.path=.gpu/sharegpt_answers.json (ShareGPT's own answers, no regeneration) before `online-n`
    arch=${2:?arch}; shift 2
    mapfile -t A < <(arch_overrides "$arch")
    cli prepare "${A[@]}" "output_dir=$WORK/$arch" train.features=cache "$@" ;;
  online-n)  # ARCH N [override ...]: the online trainer (the target's forward inside the step) with micro-batches of
    # ~N tokens of the prepared data of `run ARCH`, in $WORK/ARCH-online-N, and benchmarks/train_step.py's
    # drafter-only step (the trainer's own step on random features) for the same drafter (shape ARCH-recipe),
    # micro-batch, sequences, K and partitions, in $WORK/bench-ARCH-N.json (issue 22's N = 4,096 / 8,192 rows)
    arch=${2:?arch}; n=${3:?tokens}; shift 3
    mapfile -t A < <(arch_overrides "$arch")
    d="$WORK/$arch"; o="$WORK/$arch-online-$n"
    unpack "$d"  # PREPARED: online-n alone on a fresh machine
    need_prepared "$d" online-n
    m=$(py - "$d" "$n" <<'PY'
import sys
from pathlib import Path
from peagle_train.features.tokenized import load_tokenized
lengths = [len(x) for x in load_tokenized(Path(sys.argv[1]) / "data" / "train.safetensors")["input_ids"]]
print(max(1, round(int(sys.argv[2]) / (sum(lengths) / len(lengths)))))  # sequences per micro-batch for ~N tokens
PY
)
    echo "online-n $arch N=$n: micro-batch $m sequences"
    mkdir -p "$o" && { [ -d "$o/data" ] || cp -r "$d/data" "$o/"; }
    [ -f "$o/train_metrics.json" ] || cli train "${A[@]}" "output_dir=$o" train.features=online \
      "train.micro_batch_size=$m" train.max_steps=30 "$@"
    drop "$o/drafter"  # the step times are the result
    read -r k s ckpt <<< "$(recipe "cfg.train.K, cfg.train.partitions, str(cfg.train.activation_checkpointing)" \
      "${A[@]}" "$@" | tr -d "(),'")"
    fl=(); [ "$ckpt" = True ] && fl=(--checkpointing); [ "$ckpt" = selective ] && fl=(--checkpointing selective)
    shape="$arch-recipe"; [ "${TINY:-0}" = 1 ] && shape="$arch-tiny-recipe"  # CPU smoke: the tiny drafter
    py benchmarks/train_step.py --shape "$shape" --K "$k" --partitions "$s" "${fl[@]}" \
      --micro-batch "$m" --data-from "$d" --steps 6 --warmup 2 --out "$WORK/bench-$arch-$n.json" 2>&1 | tail -n 3 ;;
  attn-check)  # ARCH [OUT.json]: flex_attention against eager, float32 (header)
    arch=${2:?arch}; out=${3:-$WORK/attn-check-$arch.json}
    mapfile -t A < <(arch_overrides "$arch")
    mkdir -p "$(dirname "$out")"
    py benchmarks/target_forward.py "${A[0]}" "${A[@]:1}" target.dtype=float32 --batch 1 --length "${LENGTH:-3439}" \
      --variants eager/keep flex_attention/keep eager/eager --steps 3 --warmup 1 --out "$out" | tail -n 3
    py benchmarks/target_forward.py --verdict "$out" ;;
  pack)  # ARCH OUT.tar.xz: the prepared data of `run ARCH`, and OUT.tar.xz.sha256
    arch=${2:?arch}; out=${3:?out.tar.xz}
    tar -C "$WORK/$arch" -cJf "$out" run_config.yaml data
    (cd "$(dirname "$out")" && sha256sum "$(basename "$out")" > "$(basename "$out").sha256")
    echo "packed $(du -b "$out" | cut -f1) bytes: $out" ;;
  summary)  # OUT.json ARCH [ARCH ...]
    out=${2:?out.json}; shift 2
    py - "$out" "$WORK" "$@" <<'PY'
import json, subprocess, sys
from pathlib import Path
out, work, arches = sys.argv[1], Path(sys.argv[2]), sys.argv[3:]
rows = {}
for arch in arches:
    row = {}
    online_n = sorted(p.name for p in work.glob(f"{arch}-online-*") if p.is_dir())  # online-n runs
    for name in (arch, f"{arch}-fp8", f"{arch}-online", *online_n):
        d = work / name
        f = d / "logs" / "stages.jsonl"
        row[name] = {"stages": [json.loads(x) for x in f.read_text().splitlines()] if f.is_file() else []}
        if (d / "train_metrics.json").is_file() or (d / "logs" / "steps.jsonl").is_file():
            s = subprocess.run([sys.executable, "benchmarks/trainer_throughput.py", str(d), "--names", name,
                                "--skip", "5", "--out", str(d / "logs" / "throughput.json")], capture_output=True, text=True)
            t = d / "logs" / "throughput.json"
            row[name]["trainer"] = json.loads(t.read_text())[0] if t.is_file() else {"error": s.stderr[-500:]}
        manifest = sorted((d / "features").glob("*/manifest.json"))
        row[name]["cache"] = [{"split": m.parent.name, **{k: json.loads(m.read_text()).get(k) for k in
                               ("dtype", "total_tokens", "total_bytes", "bytes_per_token")}} for m in manifest]
        check = d / "logs" / "check.txt"
        row[name]["check"] = check.read_text()[-2000:] if check.is_file() else None
    row["drafter_only"] = {b.stem: json.loads(b.read_text()) for b in sorted(work.glob(f"bench-{arch}-*.json"))}
    rows[arch] = row
Path(out).write_text(json.dumps({"random_weights": True, "work": str(work), "runs": rows}, indent=1))
print(json.dumps({a: {n: [(s["stage"], s["seconds"], s["peak_gpu_bytes"]) for s in r["stages"]]
                      + [("train peak: predicted vs measured", r.get("trainer", {}).get("peak"))]
                      for n, r in row.items() if n != "drafter_only"} for a, row in rows.items()}))
PY
    ;;
  plan)  # ARCH [ARCH ...]: the whole measurement of each ARCH, one step after the other (foreground; `lease` runs it
    # in the background). Per ARCH: attn-check (for the ARCHs in ATTN_CHECK, default gpt-oss-20b: the feature
    # forwards then run on flex_attention when it agrees with eager, the regeneration on the default kernel), run,
    # pack ($WORK/ARCH-prepared.tar.xz), online-n at N = 8,192 and 4,096 (PLAN_N; per ARCH PLAN_N_<ARCH>, the
    # ARCH with "-" and "." as "_", e.g. PLAN_N_gpt_oss_20b="" for none), PLAN_OVERRIDES and then
    # PLAN_OVERRIDES_<ARCH> added to the steps but pack (e.g. PLAN_OVERRIDES_gpt_oss_20b="regen.enabled=false
    # data.path=.gpu/sharegpt_answers.json": that ARCH's data without regeneration); after every step the summary
    # of all ARCHs
    # so far ($WORK/summary.json); at the end of an ARCH its feature shards are deleted (the disk holds one 20B
    # cache, not two; the manifests stay for the summary). A failed step is logged and the plan goes on.
    shift; done_arches=()
    for arch in "$@"; do
      X=()
      if [[ " ${ATTN_CHECK-gpt-oss-20b} " == *" $arch "* ]]; then
        if bash "$0" attn-check "$arch"; then X=(target.attn_implementation=flex_attention); fi
      fi
      done_arches+=("$arch")
      steps=("run $arch" "pack $arch $WORK/$arch-prepared.tar.xz")
      v=PLAN_N_${arch//[-.]/_}; for n in ${!v-${PLAN_N:-8192 4096}}; do steps+=("online-n $arch $n"); done
      v=PLAN_OVERRIDES_${arch//[-.]/_}; read -r -a PO <<< "${PLAN_OVERRIDES:-} ${!v:-}"
      for step in "${steps[@]}"; do
        read -r -a S <<< "$step"; ov=(); [ "${S[0]}" = pack ] || ov=("${X[@]}" "${PO[@]}")
        echo "plan: ${S[*]} ${ov[*]} ($(date -u +%T))"
        PREPARE_OVERRIDES=target.attn_implementation=null bash "$0" "${S[@]}" "${ov[@]}" \
          || echo "plan: FAILED: ${S[*]}"
        bash "$0" summary "$WORK/summary.json" "${done_arches[@]}" > /dev/null || echo "plan: summary FAILED"
      done
      for x in "$WORK/$arch"*/features "$WORK/$arch"*/drafter; do  # a failed step's too; the export stays
        if [ -d "$x" ]; then drop "$x"; fi
      done
    done
    echo "plan: finished ($(date -u +%T))" ;;
  lease)  # ARCH [ARCH ...]: `plan` in the background, from a copy of the repository (the device machine's copy of the
    # working tree is refreshed by every call), in its own process session so that it outlives the call that started
    # it; its log is $WORK/plan.log; `wait` follows it
    shift; mkdir -p "$WORK"; rm -rf "$WORK/repo" "$WORK/plan.done"
    mkdir -p "$WORK/repo" && tar -C "$PWD" --exclude=./.venv --exclude=./.git -cf - . | tar -C "$WORK/repo" -xf -
    [ -d .venv ] && ln -s "$PWD/.venv" "$WORK/repo/.venv"  # a CPU checkout's environment (the GPU machine has none)
    setsid bash -c 'cd "$1" && shift && bash benchmarks/real_shape_experiment.sh plan "$@"; touch "$WORK/plan.done"' \
      plan "$WORK/repo" "$@" > "$WORK/plan.log" 2>&1 < /dev/null &  # (no subshell around it: that would hold our stdout)
    echo "lease: plan $* started in the background, log $WORK/plan.log" ;;
  wait)  # SECONDS OUT_DIR: follow `lease` until its plan finishes or SECONDS pass; then the plan's log, summary, the
    # step logs and the packed prepared data go to OUT_DIR (what comes back from the device machine)
    secs=${2:?seconds}; out=${3:?out dir}; end=$((SECONDS + secs)); seen=0
    while [ ! -f "$WORK/plan.done" ] && [ $SECONDS -lt $end ]; do
      n=$(wc -l < "$WORK/plan.log"); [ "$n" -gt "$seen" ] && grep -E '^(plan|attn-check|check|online-n)|: (started|done|reused)' \
        <(tail -n +$((seen + 1)) "$WORK/plan.log") || true; seen=$n; sleep 10
    done
    mkdir -p "$out"; cp "$WORK/plan.log" "$out/" 2>/dev/null || true
    [ -f "$WORK/summary.json" ] && cp "$WORK/summary.json" "$out/"
    cp "$WORK"/*-prepared.tar.xz* "$out/" 2>/dev/null || true
    (cd "$WORK" && tar -cJf "$out/logs.tar.xz" --exclude=repo $(ls -d */logs *.json 2>/dev/null)) || true
    [ -f "$WORK/plan.done" ] && echo "wait: the plan finished" || echo "wait: the plan is still running" ;;
  *) echo "unknown step $1" >&2; exit 2 ;;
esac
