#!/usr/bin/env bash
# The reference loop on this machine's CPU for a drafter trained on a GPU machine, so that the lease trains
# instead of evaluating (docs/results.md, runs 10 and 11): fp32 target, eager forward, W workers (default 2, one
# per core) claiming prompts under one name, then their parts merged into RUN/eval/eval.{json,md}.
#   bash benchmarks/eval_cpu.sh RUN [RECIPE]
# RUN: an output_dir holding export/ (ferry.py join, then copied there) and data/eval_prompts.json; logs go
# beside it (RUN.eval-R.out/.err). GGUF and PROMPTS (default: those the quality experiment's setup leaves in
# /tmp/peagle_quality) name the target file and ShareGPT prompts; SETS the sets (default mt_bench,humaneval).
set -u
run=$(realpath -m "${1:?RUN: the output_dir with export/}"); recipe=${2:-recipes/smollm2-135m-peagle-gpu.yaml}
cd "$(dirname "$0")/.."
[ -f "$run/export/config.json" ] || { echo "eval_cpu: $run/export/config.json missing: join the export there" >&2; exit 2; }
GGUF=${GGUF:-/tmp/peagle_quality/SmolLM2-135M-Instruct.Q4_1.gguf}
PROMPTS=${PROMPTS:-/tmp/peagle_quality/sharegpt_prompts.json}
O=("$recipe" target.gguf_package=null "target.gguf_file=$GGUF" "data.path=$PROMPTS" "output_dir=$run"
   target.dtype=float32 eval.compile_target=false "eval.datasets=[${SETS:-mt_bench,humaneval}]")
W=${W:-2}
CLI=${PEAGLE_CLI:-.venv/bin/peagle-train}  # (the tests: a fake)
pids=()
for r in $(seq 0 $((W-1))); do
  OMP_NUM_THREADS=1 $CLI eval "${O[@]}" --eval-worker "$r/$W" --eval-claim "$(basename "$run")-cpu" \
    --quiet > "$run.eval-$r.out" 2> "$run.eval-$r.err" &
  pids+=($!)
done
for r in "${!pids[@]}"; do  # a failed worker is named; the merge then reports what the others finished
  wait "${pids[$r]}" || echo "eval_cpu: worker $r/$W failed ($run.eval-$r.err)" >&2
done
$CLI eval "${O[@]}" --eval-merge "$W" --quiet > "$run.eval-merge.out" 2> "$run.eval-merge.err"
rc=$?
echo "eval_cpu: merged rc=$rc ($run/eval/eval.json)"
exit $rc
