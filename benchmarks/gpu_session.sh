#!/usr/bin/env bash
# One GPU session's runs, in issue 39's order, time-boxed to fit one device call (at most 10 minutes).
#
# On the device machine (it has pytest-xdist and transformers), after the install line
# `../shared/gpu/prepare.sh` prints, with .whl/ carried:
#   bash benchmarks/gpu_session.sh            # everything in $OUT/session.tgz (default gpu_out/)
# The device tool brings back only a few files from $OUT: every log and JSON goes into one archive,
# written again after each step, so a call cut short still returns what it finished.
# Phase A (the suite on JAX and PyTorch, in parallel pytest workers, and the first-step exactness of every
# policy and offload in float32 and mixed_bfloat16) shares the GPU and the CPUs: nothing there is timed.
# Phase B (speed and offload) runs one benchmark at a time, each in its own time box, until the session's
# deadline: a box that runs out loses only its own figures. Its list is in the order the figures are still
# missing (GPU_SESSION_SPEED overrides it, items as below; flag `profile` adds `--profile`: PyTorch's step
# time by op kind, where a speed target was missed; backend `hf` is Hugging Face transformers' BERT-base with
# and without gradient checkpointing, `benchmarks/hf_bert.py`).
set -u
out=${OUT:-gpu_out}
work=$(mktemp -d)
mkdir -p "$out"
deadline=$((SECONDS + ${GPU_SESSION_SECONDS:-560}))
phase_a=${GPU_PHASE_A_SECONDS:-240}
keep() { tar czf "$out/session.tgz" -C "$work" . ; }

{ nvidia-smi; nproc; python3 -c "import jax, torch, keras, sys; print(sys.version); print('jax', jax.__version__, jax.devices()); print('torch', torch.__version__, torch.version.cuda); print('keras', keras.__version__)"; } >"$work/machine.txt" 2>&1
keep

# Phase A. JAX takes what it needs, not 75%: several processes share the GPU.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
for lane in "jax 9" "torch 5"; do
  set -- $lane
  KERAS_BACKEND=$1 timeout -k 10 "$phase_a" python3 -m pytest tests -v -n "$2" --dist load -p no:cacheprovider \
    --durations=25 >"$work/suite_$1.log" 2>&1 &
done
first_step() {
  local name=$1
  shift
  timeout -k 10 "$phase_a" python3 benchmarks/first_step.py "$@" --out "$work/$name.json" >"$work/$name.log" 2>&1
}
first_step first_step_jax_float32 --backend jax --dtype float32 &
first_step first_step_jax_float32_highest --backend jax --dtype float32 --matmul-precision highest &
first_step first_step_jax_mixed_bfloat16 --backend jax --dtype mixed_bfloat16 &
first_step first_step_torch_float32 --backend torch --dtype float32 &
first_step first_step_torch_mixed_bfloat16 --backend torch --dtype mixed_bfloat16 &
wait
for backend in jax torch; do grep -E "^(FAILED|ERROR)|passed|failed" "$work/suite_$backend.log" | tail -n 30; done
cat "$work"/first_step_*.log
keep

# Phase B: one at a time (timed). Each item is shape:backend:dtype:box:methods[:flag]; shapes:
#   bert  BERT-base, seq 512, batch 32 (`backends.py --bert-base`; backend hf: `hf_bert.py`, the peer)
#   long  48 blocks x 768, seq 2048, batch 2: offload's shape (issue 39, step 3)
unset XLA_PYTHON_CLIENT_PREALLOCATE
speed_list=${GPU_SESSION_SPEED:-"bert:jax:float32:240:none,ours,save_dots,attention_core bert:jax:mixed_bfloat16:200:none,ours,save_dots,attention_core bert:torch:mixed_bfloat16:150:none,ours,save_dots,attention_core:profile bert:hf:float32:90:none,checkpoint bert:hf:mixed_bfloat16:90:none,checkpoint long:torch:mixed_bfloat16:150:ours,offload long:jax:mixed_bfloat16:200:ours,offload bert:jax:float32:150:remat,rematscope bert:torch:float32:120:none,remat"}
for item in $speed_list; do
  IFS=: read -r shape backend dtype box methods flag <<<"$item"
  name="${shape}_${backend}_${dtype}_${methods//,/_}"
  case "$shape:$backend" in
    bert:hf) command="benchmarks/hf_bert.py --seq 512 --batch 32" ;;
    bert:*) command="benchmarks/backends.py --backend $backend --bert-base --seq 512 --batch 32" ;;
    long:*) command="benchmarks/backends.py --backend $backend --blocks 48 --hidden 768 --heads 12 --ffn 3072 --seq 2048 --batch 2" ;;
    *) echo "unknown shape in $item"; continue ;;
  esac
  left=$((deadline - SECONDS))
  if [ "$left" -lt 60 ]; then echo "skipped $name: ${left}s left"; continue; fi
  [ "$box" -gt "$left" ] && box=$left
  echo "== $name (box ${box}s)"
  # shellcheck disable=SC2086
  timeout -k 5 "$box" python3 $command --dtype "$dtype" --methods ${methods//,/ } ${flag:+--$flag} \
    --out "$work/$name.json" 2>&1 | tee "$work/$name.log"
  keep
done
echo "done at ${SECONDS}s"
