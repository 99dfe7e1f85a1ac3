#!/usr/bin/env bash
# Throughput of the real trainer on one GPU (docs/benchmarks.md "Trainer throughput"): `peagle-train train`
# on the SmolLM2 GPU recipe, variants side by side, and benchmarks/train_step.py on the same prepared
# sequences, micro-batch and shape in the same call.
#
#   bash benchmarks/throughput_experiment.sh stage          # HERE (CPU): build .gpu/ (inputs the GPU machine lacks;
#                                                           # SPECULATORS=1: also speculators 0.9.0 and its imports)
#   bash benchmarks/throughput_experiment.sh stage-wheels   # HERE (CPU): only the wheels (SPECULATORS=1: + speculators'),
#                                                           # enough for `long`, `gptoss`, `plan` (a minute, no setup.sh)
#   bash benchmarks/throughput_experiment.sh stage-fa4      # HERE (CPU): FlashAttention-4's wheels into .fa4a/, .fa4b/,
#                                                           # .fa4c/ (GPU: fa4-part with each carry, then fa4-setup)
#   bash benchmarks/throughput_experiment.sh setup          # GPU: wheels into /tmp/site, unpack .gpu/ into $WORK
#   bash benchmarks/throughput_experiment.sh plan; ... poll SECONDS
#                                                           # GPU: issue 19's long, prefix-attention and GPT-OSS rows
#                                                           # (and their A/B rows: IS_DIVISIBLE hint, static shapes,
#                                                           # FlashAttention-4) in the background (past one call's
#                                                           # limit; PLAN_STEPS="NAME ..." picks steps); poll sends results
#   bash benchmarks/throughput_experiment.sh trainer NAME [override ...]
#                                                           # GPU: `peagle-train train` in $WORK/runs/NAME
#   bash benchmarks/throughput_experiment.sh cache [override ...]  # GPU: `peagle-train cache` of the prepared data
#                                                           # into $WORK/cache (a trainer run with
#                                                           # train.features=cache reads it)
#   bash benchmarks/throughput_experiment.sh bench NAME [train_step.py flags ...]
#                                                           # GPU: train_step.py --data-from the prepared data
#   bash benchmarks/throughput_experiment.sh strategies OUT.json [override ...]
#                                                           # GPU: 50 steps plain, ZeRO-2, FSDP2; compared
#   bash benchmarks/throughput_experiment.sh gptoss OUT.json | long OUT.json [flags]
#                                                           # GPU: the GPT-OSS-20B-shaped step at N = 8,192 beside
#                                                           # speculators; N = 131,072 with planned partitions
#   bash benchmarks/throughput_experiment.sh regen OUT.json | regen-compare OUT_PREFIX
#                                                           # GPU: regeneration engines (regen_throughput.py)
#   bash benchmarks/throughput_experiment.sh summary OUT.json NAME [NAME ...]
#                                                           # trainer_throughput.py over runs of this machine
#
# The target is SmolLM2-135M-Instruct's architecture with RANDOM weights
# (target.random_init_from_config=pkg:peagle_train/smollm2-135m-instruct.json) and its real tokenizer:
# speed does not depend on the weights, and the 98 MB GGUF need not travel. The data are the first
# 10,036 ShareGPT conversations of the recipe with their own answers (regen.enabled=false: no
# regeneration by a random target), prepared HERE by `peagle-train prepare` (median 382 tokens, as
# the regenerated data of the recipe). .gpu/ holds: tok/ (tokenizer files of the de-quantised GGUF),
# prepared.tar.xz (+ .sha256: run_config.yaml and data/ of that prepare) and whl/ (pydantic and
# DeepSpeed wheels: the GPU image has neither).
set -euo pipefail
WORK=${WORK:-/tmp/peagle_throughput}
R=recipes/smollm2-135m-peagle-gpu.yaml
OVR=(target.gguf_package=null target.gguf_file=null target.gguf_sha256=null
     target.random_init_from_config=pkg:peagle_train/smollm2-135m-instruct.json target.tokenizer=.gpu/tok
     regen.enabled=false "data.mix=[]"  # data.mix=[]: the staged prepare is the first 10,036 conversations (speed only)
     drafter.init_layers=random  # a random-weight target has no layers to start from (and a cached run no target)
     "train.eval_walk_sets=[]"  # speed runs: no eval-set answers from a random target (and a cached run has none)
     "eval.datasets=[mt_bench,humaneval]")  # no held-out set: train.eval_sequences may be below eval.num_prompts
# /tmp/site/nvidia_cutlass_dsl/dsl_packages: where the CUTLASS DSL (fa4-setup) keeps its `cutlass` package; its wheel
# adds it by a .pth file, which Python reads in site directories only, not on PYTHONPATH (harmless where absent)
export PYTHONUNBUFFERED=1 \
  PYTHONPATH="/tmp/site:/tmp/site/nvidia_cutlass_dsl/dsl_packages:$PWD${PYTHONPATH:+:$PYTHONPATH}"
# PEAGLE_CLI: another executable with the same arguments (tests/integration/test_throughput_script.py)
cli() { if [ -n "${PEAGLE_CLI:-}" ]; then "$PEAGLE_CLI" "$@"; elif [ -x .venv/bin/peagle-train ]; then
  .venv/bin/peagle-train "$@"; else python3 -m peagle_train.cli "$@"; fi; }
py() { if [ -x .venv/bin/python ]; then .venv/bin/python "$@"; else python3 "$@"; fi; }
# wheels DEST SPEC...: each SPEC's wheel for the GPU image's Python (3.12, x86-64 manylinux), no dependencies
wheels() { local dest=$1; shift; mkdir -p "$dest"
  for p in "$@"; do
    python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
      --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d "$dest" "$p"
  done; }

case "${1:?step}" in
  stage)  # on the CPU machine, after `bash setup.sh`
    mkdir -p .gpu/tok .gpu/whl .gpu/prep
    py - <<'PY'
import shutil
from peagle_train.recipe import load_config
from peagle_train.features.target import materialise_target
src = materialise_target(load_config("recipes/smollm2-135m.yaml").target)  # the GGUF, de-quantised once
for f in ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja"):
    shutil.copy(src / f, ".gpu/tok/" + f)
PY
    [ -f .gpu/prep/data/meta.json ] || cli prepare "$R" "${OVR[@]}" output_dir=.gpu/prep --quiet
    tar -C .gpu/prep -cJf .gpu/prepared.tar.xz run_config.yaml data
    (cd .gpu && sha256sum prepared.tar.xz > prepared.tar.xz.sha256)
    rm -rf .gpu/prep
    v() { py -c "import importlib.metadata as m; print(m.version('$1'))"; }
    for p in pydantic pydantic-core annotated-types typing-inspection hjson; do wheels .gpu/whl "$p==$(v "$p")"; done
    ls .gpu/whl/deepspeed-*.whl >/dev/null 2>&1 || DS_BUILD_OPS=0 py -m pip wheel -q --no-deps --no-build-isolation \
      "deepspeed==$(v deepspeed)" -w .gpu/whl  # from the sdist: no CUDA ops needed for ZeRO-2 with a torch optimizer
    if [ "${SPECULATORS:-0}" = 1 ]; then bash "$0" spec-wheels; fi
    py - <<'PY'  # .gpu/sharegpt_prompts.json for `regen`: the first 2,000 first user turns under 3,000 characters
import json
from data_prep.config import DataConfig
from data_prep.sources import load_conversations
convs, _ = load_conversations(DataConfig(source="sharegpt", num_conversations=2400, max_turns=1))
def sharegpt(turns):  # chat messages -> ShareGPT's turns
    return [{"from": {"user": "human", "assistant": "gpt"}.get(m["role"], m["role"]), "value": m["content"]} for m in turns]
rows = [sharegpt(c[:-1]) for c in convs]
rows = [r for r in rows if len(r[-1]["value"]) < 3000][:2000]  # answer: a placeholder (regen uses prompts only)
json.dump([{"conversations": [*r, {"from": "gpt", "value": "(answer omitted)"}]} for r in rows],
          open(".gpu/sharegpt_prompts.json", "w"))
# .gpu/sharegpt_answers.json: the first 600 first turns WITH their ShareGPT answers, for runs whose data is prepared
# without regeneration (regen.enabled=false: real_shape_experiment.sh's `online-n` when the 20B regeneration does
# not fit a call)
rows = [sharegpt(c) for c in convs[:600]]
json.dump([{"conversations": r} for r in rows], open(".gpu/sharegpt_answers.json", "w"))
PY
    du -sh .gpu ;;
  setup)  # after `stage` (everything) or `stage-wheels` (the kernel and step benchmarks only: no prepared data)
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .gpu/whl/*.whl
    if ls .gpu/whl_spec/*.whl >/dev/null 2>&1; then  # staged with SPECULATORS=1
      python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site .gpu/whl_spec/*.whl
      python3 -c "import importlib.metadata as m, speculators.models.peagle; print('speculators', m.version('speculators'))" \
        || echo "speculators does not import: the gptoss step's reference will fail (the other steps run)"
    fi
    if [ -f .gpu/prepared.tar.xz ]; then
      (cd .gpu && sha256sum -c prepared.tar.xz.sha256)
      mkdir -p "$WORK/prep" && tar -C "$WORK/prep" -xJf .gpu/prepared.tar.xz
    else echo "no .gpu/prepared.tar.xz (stage-wheels): the trainer, cache, bench and strategies steps need stage's"; fi
    python3 -c "import torch, transformers, accelerate; print('torch', torch.__version__, 'transformers',
      transformers.__version__, 'accelerate', accelerate.__version__, torch.cuda.get_device_name())" ;;
  trainer)  # NAME [override ...]; under a launcher, e.g. ZeRO-2 on one GPU:
    # LAUNCH="accelerate launch --config_file launch/accelerate/deepspeed_zero2.yaml --num_processes 1 -m peagle_train.cli"
    name=${2:?name}; shift 2
    d="$WORK/runs/$name"
    rm -rf "$d" && mkdir -p "$d" && cp -r "$WORK/prep/data" "$d/"
    if [[ " $* " == *" train.features=cache "* ]]; then ln -s "$WORK/cache/features" "$d/features"; fi
    ${LAUNCH:-cli} train "$R" "${OVR[@]}" "output_dir=$d" "$@" --quiet > "$d.out" 2> "$d.err" \
      || { echo "trainer $name failed:"; tail -c 1500 "$d.err"; }
    py benchmarks/trainer_throughput.py "$d" --names "$name" --out "$d.summary.json" || true ;;
  cache)  # [override ...]: the offline feature cache of the prepared data (bf16 target forward unless overridden)
    shift
    rm -rf "$WORK/cache" && mkdir -p "$WORK/cache" && cp -r "$WORK/prep/data" "$WORK/cache/"
    t0=$(date +%s.%N)
    cli cache "$R" "${OVR[@]}" "output_dir=$WORK/cache" target.dtype=bfloat16 train.features=cache "$@" --quiet
    python3 -c "import sys; print(f'cache: {float(sys.argv[2]) - float(sys.argv[1]):.1f} s')" "$t0" "$(date +%s.%N)"
    du -sb "$WORK/cache/features" ;;
  bench)  # NAME [flags]: the benchmark's step on the prepared sequences (micro-batch 8 unless flags say otherwise)
    name=${2:?name}; shift 2
    py benchmarks/train_step.py --shape smollm2-135m --data-from "$WORK/prep" --micro-batch 8 \
      --out "$WORK/bench-$name.json" "$@" 2>&1 | tail -n 8 ;;
  summary)  # OUT NAME...: one JSON of the named trainer runs' summaries
    out=${2:?out}; shift 2
    runs=(); for n in "$@"; do runs+=("$WORK/runs/$n"); done
    py benchmarks/trainer_throughput.py "${runs[@]}" --names "$@" --out "$out" ;;
  regen)  # OUT.json [flags]: regeneration tokens/s of the static-cache engine (one batch of 512 prompts to a
    # 2,048-token cap) and plain generate (64 prompts, cap 256; the identity count), regen_throughput.py, on the
    # random-weight SmolLM2 (answers run to the cap). An engine answers a whole batch at once, so --max-seconds
    # cannot stop it mid-batch: add `--engines static continuous` only with few prompts and a short cap
    # (without flash attention continuous batching's step grows with the square of the batch: docs/data.md)
    out=${2:?out.json}; shift 2
    py benchmarks/regen_throughput.py --random-init-from-config pkg:peagle_train/smollm2-135m-instruct.json \
      --tokenizer .gpu/tok --prompts-file .gpu/sharegpt_prompts.json --engines static --prompts 512 \
      --engine-batch 512 --cap 2048 --subset 64 --batch 64 --generate-cap 256 --dtypes bfloat16 --max-seconds 60 \
      --out "$out" "$@" ;;
  regen-compare)  # OUT_PREFIX: the engines side by side at a shorter cap (512 prompts x 512 tokens, batch 512):
    # static and continuous batching with SDPA, then the static engine with FlexAttention (grouped KV heads
    # without expansion); plain generate on 128 of the prompts for the identity count. Two JSON files.
    out=${2:?out_prefix}; shift 2
    A=(--random-init-from-config pkg:peagle_train/smollm2-135m-instruct.json --tokenizer .gpu/tok
       --prompts-file .gpu/sharegpt_prompts.json --prompts 512 --engine-batch 512 --cap 512 --dtypes bfloat16
       --max-seconds 45)
    py benchmarks/regen_throughput.py "${A[@]}" --engines static continuous --subset 128 --batch 128 \
      --generate-cap 128 --out "$out-sdpa.json" "$@" | tail -n 1
    py benchmarks/regen_throughput.py "${A[@]}" --engines static --attn flex_attention --skip-generate \
      --out "$out-flex.json" "$@" | tail -n 1 ;;
  strategies)  # OUT.json [override ...]: the same 50 steps plain, under ZeRO-2 and under FSDP2 (accelerate launch,
    # one process), then trainer_throughput.py --reference plain: tokens/s ratio and how the losses follow (issue 19)
    out=${2:?out.json}; shift 2
    A="accelerate launch --num_processes 1 --config_file"
    bash "$0" trainer plain train.max_steps=50 train.max_minutes=null train.schedule=steps "$@"
    LAUNCH="$A launch/accelerate/deepspeed_zero2.yaml -m peagle_train.cli" bash "$0" trainer zero2 train.max_steps=50 \
      train.max_minutes=null train.schedule=steps "$@"
    LAUNCH="$A launch/accelerate/fsdp2.yaml -m peagle_train.cli" bash "$0" trainer fsdp2 train.max_steps=50 \
      train.max_minutes=null train.schedule=steps "$@"
    py benchmarks/trainer_throughput.py "$WORK/runs/plain" "$WORK/runs/zero2" "$WORK/runs/fsdp2" \
      --names plain zero2 fsdp2 --skip 10 --reference plain --out "$out" ;;
  gptoss)  # OUT.json [flags]: the trainer's step at the GPT-OSS-20B drafter shape, N = 8,192, beside speculators 0.9.0
    # in the same process (stage with SPECULATORS=1); issue 19's 1.8x row. The same trainable set as speculators'
    # reference step: embeddings trained, lm_head frozen (--lm-head frozen; drafter.lm_head in a recipe)
    out=${2:?out.json}; shift 2
    py benchmarks/train_step.py --shape gpt-oss-20b --seq-len 8192 --lm-head frozen --compile on --attention flex \
      --chain-kernel triton \
      --chain-tiling docs/data/chain_kernel_s6.json --reference speculators --steps 10 --warmup 3 --out "$out" "$@" ;;
  long)  # OUT.json [flags]: the long-context rows, N = 131,072 (and 262,144 with --seq-len), partitions planned
    out=${2:?out.json}; shift 2
    PYTORCH_CUDA_ALLOC_CONF=expandable_segments:True py benchmarks/train_step.py --shape gpt-oss-20b \
      --seq-len 131072 --partitions auto --compile on --attention flex --chain-kernel triton \
      --chain-tiling docs/data/chain_kernel_s6.json --steps 3 --warmup 1 --out "$out" "$@" ;;
  spec-wheels)  # HERE (CPU): the reference of the GPT-OSS 8K comparison (benchmarks/speculators_ref.py):
    # speculators and what its import chain loads that the GPU image lacks (checked with -X importtime here)
    wheels .gpu/whl_spec speculators==0.9.0 hs-connectors==0.9.0 openai==3.57.0 distro==1.9.0 jiter==0.19.0 \
      sniffio==1.3.1 loguru==0.7.3 pydantic-settings==2.16.3 python-dotenv==1.2.4 datasets==5.1.0 dill==0.4.1 \
      multiprocess==0.70.19 httpx2==2.16.2 httpcore2==2.16.2 truststore ;;  # openai 3.x imports httpx2
  stage-wheels)  # HERE (CPU), no setup.sh needed: only the wheels the kernel and step benchmarks need on the GPU
    # machine (pydantic and its imports into .gpu/whl; with SPECULATORS=1 speculators' set into .gpu/whl_spec), for
    # `plan`, `long`, `gptoss` (the trainer steps need `stage`'s tokenizer and prepared data as well)
    wheels .gpu/whl pydantic==2.14.4 pydantic-core==2.50.5 annotated-types==0.8.0 typing-inspection==0.4.5 \
      typing-extensions==4.16.0
    if [ "${SPECULATORS:-0}" = 1 ]; then bash "$0" spec-wheels; fi
    du -sh .gpu ;;
  stage-fa4)  # HERE (CPU): FlashAttention-4's CuTe kernels, which FlexAttention runs with kernel option BACKEND: FLASH
    # (plan step prefix_flash), and their imports for the GPU image's Python (torch excluded): none of them is there.
    # A carry travels with the tracked files under one size limit, so the 92 MB CUDA 13 library wheel of the CUTLASS
    # DSL is cut in pieces of FA4_PIECE (default 40M, split -b) with its sha256 and a list of where each piece went:
    # .fa4a/ (the other wheels, the last, smallest piece, the sha256 and the list), .fa4b/, .fa4c/, ... (one piece
    # each). Each carry is checked against the room left beside the files that travel with it (tracked, and untracked
    # ones not ignored); one without room removes them all and asks for smaller pieces. On the GPU machine: `fa4-part`
    # once per carry (carry .fa4a, then .fa4b, ...; the last one may be `fa4-setup`'s own carry), then `fa4-setup`
    rm -rf .fa4? && mkdir -p .fa4a/whl .fa4b
    wheels .fa4a/whl flash-attn-4==4.0.0b40 nvidia-cutlass-dsl==4.8.1 nvidia-cutlass-dsl-libs-base==4.8.1 \
      nvidia-cutlass-dsl-libs-core==4.8.1 apache-tvm-ffi==0.1.15.post2 torch-c-dlpack-ext==0.1.5 \
      quack-kernels==0.6.5 einops==0.8.2 cuda-bindings==13.5.0 cuda-pathfinder==1.9.1 protobuf==7.36.2
    wheels .fa4b nvidia-cutlass-dsl-libs-cu13==4.8.1
    big=$(cd .fa4b && ls nvidia_cutlass_dsl_libs_cu13-*.whl)
    (cd .fa4b && sha256sum "$big" > ../.fa4a/"$big.sha256" && split -b "${FA4_PIECE:-40M}" "$big" "$big.part" \
      && rm "$big")
    pieces=(.fa4b/"$big".part*); carries=(b c d e f g h)
    if [ ${#pieces[@]} -gt $(( ${#carries[@]} + 1 )) ]; then
      rm -rf .fa4?; echo "stage-fa4: ${#pieces[@]} pieces, more than the $(( ${#carries[@]} + 1 )) carries" \
        ".fa4a-.fa4h: set FA4_PIECE larger" >&2; exit 1; fi
    : > .fa4a/"$big.pieces"
    for i in "${!pieces[@]}"; do  # the last piece with the small wheels, the others one per carry
      if [ "$i" = $(( ${#pieces[@]} - 1 )) ]; then dir=.fa4a; else dir=.fa4${carries[$i]}; fi
      mkdir -p "$dir"; name=$(basename "${pieces[$i]}")
      if [ "$dir" != .fa4b ] || [ "$i" != 0 ]; then mv "${pieces[$i]}" "$dir/"; fi
      echo "$name $dir" >> .fa4a/"$big.pieces"
    done
    rmdir .fa4b 2> /dev/null || true  # a wheel in one piece: no .fa4b
    travels=0  # the bytes that travel with any carry (none outside a git checkout): tracked and untracked files
    if git rev-parse --git-dir > /dev/null 2>&1; then  # not ignored, as they are on the working tree now
      travels=$(git ls-files -z --cached --others --exclude-standard | { grep -zv '^\.fa4[a-h]/' || true; } \
        | xargs -0 -r stat -c %s -- 2> /dev/null \
        | awk '{s += $1} END {print s + 0}' || true); fi
    room=$(( 64 * 2**20 - ${travels:-0} - 2**20 ))
    for dir in .fa4?; do  # each carry must fit beside them (1 MiB kept free)
      size=$(du -sb "$dir" | cut -f1)
      if [ "$size" -gt "$room" ]; then
        rm -rf .fa4?
        echo "stage-fa4: $dir would be $size bytes, more than the $room a carry has room for beside the files that" \
          "travel with it: run again with smaller pieces (FA4_PIECE=30M)" >&2; exit 1; fi
    done
    du -sh .fa4? ;;
  fa4-part)  # GPU, carry one of .fa4a, .fa4b, ...: the files of every .fa4? here into $WORK/fa4 (then fa4-setup)
    n=0; mkdir -p "$WORK/fa4"
    for dir in .fa4?; do if [ -d "$dir" ]; then cp -r "$dir"/. "$WORK/fa4/"; n=$((n + 1)); fi; done
    [ "$n" -gt 0 ] || { echo "fa4-part: no .fa4? here: carry one of the stage-fa4 folders (.fa4a, ...)" >&2; exit 2; } ;;
  fa4-setup)  # GPU, after fa4-part for every carry (its own carry, if any, is taken in too): the big wheel joined
    # from the pieces its list names, in that order, in a temporary file, checked, then put in place (a failed check
    # keeps the pieces; a second run finds the checked wheel and joins nothing), every wheel into /tmp/site (where
    # `setup` puts its own), then the imports FlexAttention's FLASH backend makes. A wheel whose package the image
    # already has at a version the CUTLASS DSL takes (cuda-bindings >= 13, protobuf >= 5) is left out, so the
    # image's own stays in use
    for dir in .fa4?; do if [ -d "$dir" ]; then mkdir -p "$WORK/fa4" && cp -r "$dir"/. "$WORK/fa4/"; fi; done
    [ -d "$WORK/fa4/whl" ] || { echo "fa4-setup: no $WORK/fa4/whl: run fa4-part first (carry .fa4a)" >&2; exit 2; }
    sums=("$WORK"/fa4/*.sha256)
    [ -f "${sums[0]}" ] || { echo "fa4-setup: no .sha256 in $WORK/fa4: stage-fa4 again and carry .fa4a" >&2; exit 2; }
    (cd "$WORK/fa4"
     for f in *.sha256; do
       w=${f%.sha256}
       if [ -f "whl/$w" ] && (cd whl && sha256sum -c --quiet "../$f"); then continue; fi
       [ -f "$w.pieces" ] || { echo "fa4-setup: no $w.pieces (an older stage-fa4): stage-fa4 again," \
         "rm -rf $WORK/fa4 here and carry every .fa4? again" >&2; exit 2; }
       listed=(); missing=()
       while read -r piece dir; do
         listed+=("$piece"); [ -f "$piece" ] || missing+=("$piece (carry $dir)"); done < "$w.pieces"
       if [ ${#missing[@]} -gt 0 ]; then
         echo "fa4-setup: pieces not here yet; run fa4-part with their carries: ${missing[*]}" >&2; exit 2; fi
       if ! { cat "${listed[@]}" > "whl/$w.tmp" && mv "whl/$w.tmp" "whl/$w" && (cd whl && sha256sum -c "../$f"); }
       then
         rm -f "whl/$w" "whl/$w.tmp"
         echo "fa4-setup: $w does not match its sha256: stage-fa4 again, rm -rf $WORK/fa4 here and carry every" \
           ".fa4? again" >&2; exit 1
       fi
       rm -f "${listed[@]}"
     done)
    has() { python3 -c "import importlib.metadata as m, sys; sys.exit(int(m.version('$1').split('.')[0]) < $2)" \
      2>/dev/null; }  # has PACKAGE MAJOR: installed in the image at that major version or later
    skip=()
    if has cuda-bindings 13; then skip+=(cuda_bindings cuda_pathfinder); fi
    if has protobuf 5; then skip+=(protobuf); fi
    whls=()
    for w in "$WORK"/fa4/whl/*.whl; do
      b=$(basename "$w"); keep=1; for x in ${skip[@]+"${skip[@]}"}; do [[ $b == "$x"-* ]] && keep=0; done
      if [ "$keep" = 1 ]; then whls+=("$w"); fi
    done
    python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site "${whls[@]}"
    python3 -c "import cutlass, flash_attn.cute, importlib.metadata as m; print('flash-attn-4', m.version('flash-attn-4'))" ;;
  plan)  # GPU: issue 19's measurements in a new process session (they outlive the call that starts them and its
    # 10-minute limit): N = 262,144 (H200 only), N = 131,072 (with --checkpointing where the GPU is not an H200),
    # again with train.prefix_kernel_options, and its profile, the GPT-OSS 8K step beside speculators, then the prefix
    # attention of each of that step's two segments alone with the kernel options that measured fastest (not
    # autotuned: Inductor's benchmarking of FlexAttention's choices alone took 384 s at N = 65,536 on an H100,
    # plan_7a2a50b_h100_logs.tar.gz); the N = 131,072 and 8K steps again without FlexAttention's IS_DIVISIBLE hint
    # (long131072_nohint, gptoss_nohint) and with one graph per grid bucket (long131072_static); FlashAttention-4's
    # kernels on the prefix (prefix_flash, after stage-fa4), and the trainer's steps with train.attention: flex_flash
    # (long131072_flash, gptoss_flash, after stage-fa4). JSON and logs under $RES (default /tmp/res);
    # $RES/progress.txt gets each step's exit status. Then `poll SECONDS`. Each step has its own time limit (600-900
    # s; the limits add up to about two hours), so PLAN_STEPS="long131072 long131072_nohint" (in plan's
    # environment) runs only the steps it names, for a GPU held for less time than the whole plan takes.
    RES=${RES:-/tmp/res}; mkdir -p "$RES"
    rm -f "$RES"/*.json "$RES"/*.log && : > "$RES/progress.txt"  # an earlier plan's results and `done` are gone
    setsid nohup bash "$0" plan-run > "$RES/plan.log" 2>&1 < /dev/null &
    echo "plan started in the background; results in $RES" ;;
  plan-run)  # the steps of `plan`, in this process (PLAN_DRY=1: print each command instead of running it)
    RES=${RES:-/tmp/res}; mkdir -p "$RES"
    # PLAN_STEPS="NAME ...": only the steps named (in the plan's order; the others are noted as skipped); any
    # whitespace separates names, and a name that is not a step of the plan stops it before anything runs
    steps=" $(echo ${PLAN_STEPS:-}) "
    ALL_STEPS="long262144 long131072 long131072_selective long131072_nohint long131072_static long131072_kopts"
    ALL_STEPS+=" long131072_apart"
    ALL_STEPS+=" profile131072 gptoss gptoss_nohint prefix prefix_flash long131072_flash gptoss_flash"
    for name in ${PLAN_STEPS:-}; do
      case " $ALL_STEPS " in *" $name "*) ;;
        *) echo "PLAN_STEPS: $name is not a step of the plan ($ALL_STEPS)" >&2; exit 2 ;; esac
    done
    run() { local name=$1 limit=$2 rc=0; shift 2  # a step that fails or runs out of time: noted, the next runs
      if [ "$steps" != "  " ] && [[ $steps != *" $name "* ]]; then
        echo "$name skipped (PLAN_STEPS)" >> "$RES/progress.txt"; return; fi
      if [ "${PLAN_DRY:-0}" = 1 ]; then echo "$name: $*" >> "$RES/progress.txt"; return; fi
      timeout -k 60 "$limit" "$@" > "$RES/$name.log" 2>&1 || rc=$?  # -k: killed if it ignores the TERM
      echo "$name rc $rc $(date +%T)" >> "$RES/progress.txt"; }
    P=python3; [ -x .venv/bin/python ] && P=.venv/bin/python
    gpu=$(nvidia-smi --query-gpu=name --format=csv,noheader | head -n 1)
    echo "start $(date +%T) on $gpu" >> "$RES/progress.txt"
    ck=""
    if [[ $gpu == *H200* ]]; then  # each step runs under its own time limit (the second argument of run)
      run long262144 900 bash "$0" long "$RES/long262144.json" --seq-len 262144 --steps 2 --warmup 1 --checkpointing
    else  # N = 131,072 needs checkpointing on an 80 GB card (the planner's figures, docs/benchmarks.md)
      ck=--checkpointing
      if [ "$steps" = "  " ] || [[ $steps == *" long262144 "* ]]; then
        echo "long262144 not run (not an H200)" >> "$RES/progress.txt"
      else echo "long262144 skipped (PLAN_STEPS)" >> "$RES/progress.txt"; fi; fi
    # train.prefix_kernel_options: the forward block (auto's on an H100 / H200) and with the backward block too
    fwd='"fwd_BLOCK_M": 64, "fwd_BLOCK_N": 128, "fwd_num_warps": 4, "fwd_num_stages": 3'
    bwd='"BLOCK_M1": 32, "BLOCK_N1": 128, "BLOCK_M2": 128, "BLOCK_N2": 32, "num_warps": 4, "num_stages": 3'
    run long131072 600 bash "$0" long "$RES/long131072.json" $ck
    # selective activation checkpointing (train.activation_checkpointing: selective): the attention kernels'
    # outputs kept through the backward, their forward not run again (~5.9 s of the H100's 33.7 s step at ceaa944);
    # the planner picks S for the memory it costs (on 80 GB: S = 3 against long131072's S = 2 with full
    # checkpointing; on an H200 S = 1 against S = 4 without checkpointing), so the row changes S with the mode
    run long131072_selective 600 bash "$0" long "$RES/long131072_selective.json" --checkpointing selective
    # the same step without the IS_DIVISIBLE option the trainer gives FlexAttention on its padded grids (under the
    # default dynamic shapes Inductor cannot prove the lengths divisible by 128 and takes the bounds-checked kernels:
    # on an H100 at ceaa944 41.06 s against 33.73 s with it: it was the prefix kernels' 0.77 of their alone speed in
    # this step, docs/benchmarks.md), and with one compiled graph per grid bucket (train.dynamic_shapes: false:
    # static lengths, as prefix_attention.py compiles the kernels alone)
    run long131072_nohint 600 bash "$0" long "$RES/long131072_nohint.json" $ck --divisible-hint off
    run long131072_static 600 bash "$0" long "$RES/long131072_static.json" $ck --dynamic-shapes off
    # the same step with the backward block too (train.prefix_kernel_options: the default auto has the forward block
    # on an H100 / H200; with the backward one the H100 took 38.1 s against 40.9, docs/benchmarks.md, 47e0feb)
    run long131072_kopts 600 bash "$0" long "$RES/long131072_kopts.json" $ck \
      --prefix-kernel-options "{$fwd, $bwd}"
    # the default step with the prefix FlexAttention compiled apart from the layers' graphs, behind a graph break
    # (train.prefix_compiled_apart): inside the step its kernels ran at 0.77 of their alone speed at equal clocks
    # (docs/benchmarks.md, c050930); against long131072: a faster row points at the layer's graph (no gain would not
    # rule it out: the break also splits the layer's other fusions)
    run long131072_apart 600 bash "$0" long "$RES/long131072_apart.json" $ck --prefix-compiled-apart
    # where the 131,072 step's time goes with the default options (auto): one timed step, then the profiled ones
    # (kernels and GPU timeline; without options at 47e0feb the prefix attention was 92 % of the step)
    run profile131072 900 bash "$0" long "$RES/long131072_profile.json" $ck --steps 1 --warmup 1 --profile
    run gptoss 900 bash "$0" gptoss "$RES/gptoss.json" --compile on+autotune
    # the same 8K step without the IS_DIVISIBLE option (its grids change bucket from step to step, so it runs the
    # dynamic-shape kernels too); no speculators row (the gptoss step has it)
    run gptoss_nohint 900 bash "$0" gptoss "$RES/gptoss_nohint.json" --compile on+autotune --divisible-hint off \
      --reference none
    # each of the N = 131,072 step's two segments alone (the trainer's own sub-grids): inside the step the prefix
    # kernels ran at 192 / 169 TFLOP/s forward / backward against 284 / 234 alone on the N = 65,536 grid
    # (docs/benchmarks.md, 47e0feb); the segment's shape or the step around it: this row tells
    run prefix 600 "$P" benchmarks/prefix_attention.py --N 131072 --partitions 2 --repeats 2 \
      --options "{$fwd}" "{$fwd, $bwd}" \
      --out "$RES/prefix_attention.json"
    # FlashAttention-4's kernels through FlexAttention (BACKEND: FLASH, after stage-fa4 / fa4-part / fa4-setup) on the
    # grid's prefix mask beside Triton's, at N = 65,536 (the kernels alone; the split form's merge differentiates
    # through lse, which the FLASH backward does not take, so every row here is timed without that gradient)
    run prefix_flash 600 "$P" benchmarks/prefix_attention.py --N 65536 --repeats 2 --no-lse-grad \
      --options "{$fwd}" '{"BACKEND": "FLASH"}' --out "$RES/prefix_flash.json"
    # the trainer's steps with train.attention: flex_flash (after stage-fa4 / fa4-part / fa4-setup): the whole rule in
    # one FlexAttention kernel run by FlashAttention-4 (no lse merge to differentiate), compiled for static shapes as
    # the trainer does for that kind; N = 131,072 with selective checkpointing (against long131072_selective) and the
    # 8K step beside speculators (against gptoss)
    run long131072_flash 600 bash "$0" long "$RES/long131072_flash.json" --checkpointing selective \
      --attention flex_flash --dynamic-shapes off
    run gptoss_flash 900 bash "$0" gptoss "$RES/gptoss_flash.json" --compile on+autotune --attention flex_flash \
      --dynamic-shapes off
    echo "done $(date +%T)" >> "$RES/progress.txt" ;;
  poll)  # SECONDS: wait until `plan` is done or SECONDS have passed, then send what it wrote so far to $OUT: the
    # JSON files and progress.txt as they are, the logs in one logs.tar.gz (a device call returns at most 8 files)
    RES=${RES:-/tmp/res}; end=$((SECONDS + ${2:?seconds}))
    while [ $SECONDS -lt $end ] && ! grep -q '^done' "$RES/progress.txt" 2>/dev/null; do sleep 5; done
    mkdir -p "${OUT:?set OUT}"
    cp "$RES"/*.json "$RES/progress.txt" "$OUT/" 2>/dev/null || true
    (cd "$RES" && tar -czf "$OUT/logs.tar.gz" --ignore-failed-read ./*.log 2>/dev/null) || true
    cat "$RES/progress.txt" 2>/dev/null || echo "no progress yet" ;;
  *) echo "unknown step $1" >&2; exit 2 ;;
esac
