#!/usr/bin/env bash
# CPU evaluation of run 11's export (the loop on this side's CPU left the lease to training), as it ran: a copy
# of run 10's script with run 11's folder; the recipe as of d835085 (with the code requests' data.mix entry).
# The same loop for a later run: bash benchmarks/eval_cpu.sh RUN_DIR
set -u
cd /work/main
O=(recipes/smollm2-135m-peagle-gpu.yaml target.gguf_package=null target.gguf_file=/tmp/peagle_quality/SmolLM2-135M-Instruct.Q4_1.gguf
   data.path=/tmp/peagle_quality/sharegpt_prompts.json output_dir=/tmp/run11/peagle target.dtype=float32 eval.compile_target=false
   "eval.datasets=[mt_bench,humaneval]")
W=${W:-2}
for r in $(seq 0 $((W-1))); do
  OMP_NUM_THREADS=1 .venv/bin/peagle-train eval "${O[@]}" --eval-worker $r/$W --eval-claim run11cpu --quiet > /tmp/run11/eval-$r.out 2> /tmp/run11/eval-$r.err &
done
wait
.venv/bin/peagle-train eval "${O[@]}" --eval-merge $W --quiet > /tmp/run11/eval-merge.out 2> /tmp/run11/eval-merge.err
echo "merged rc=$?"
date
