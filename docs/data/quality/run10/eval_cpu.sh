#!/usr/bin/env bash
# CPU evaluation of run 10's export (the GPU lease ran out): the reference loop, fp32 target, eager forward
set -u
cd /work/main
O=(recipes/smollm2-135m-peagle-gpu.yaml target.gguf_package=null target.gguf_file=/tmp/peagle_quality/SmolLM2-135M-Instruct.Q4_1.gguf
   data.path=/tmp/peagle_quality/sharegpt_prompts.json output_dir=/tmp/run10/peagle target.dtype=float32 eval.compile_target=false
   "eval.datasets=[mt_bench,humaneval]")
W=${W:-2}
for r in $(seq 0 $((W-1))); do
  OMP_NUM_THREADS=1 .venv/bin/peagle-train eval "${O[@]}" --eval-worker $r/$W --eval-claim run10cpu --quiet > /tmp/run10/eval-$r.out 2> /tmp/run10/eval-$r.err &
done
wait
.venv/bin/peagle-train eval "${O[@]}" --eval-merge $W --quiet > /tmp/run10/eval-merge.out 2> /tmp/run10/eval-merge.err
echo "merged rc=$?"
date
