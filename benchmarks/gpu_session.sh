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

{ nvidia-smi; nproc; KERAS_BACKEND=jax python3 -c "import jax, torch, keras, sys; print(sys.version); print('jax', jax.__version__, jax.devices()); print('torch', torch.__version__, torch.version.cuda); print('keras', keras.__version__)"; } >"$work/machine.txt" 2>&1
keep

# Phase A. JAX takes what it needs, not 75%: several processes share the GPU. Each failure's traceback is
# written as it happens (a suite stopped at the deadline prints no summary). GPU_SESSION_FIRST: test ids run
# before anything else, one backend each ("jax:tests/x.py::test_y torch:..."), e.g. what failed last time.
export XLA_PYTHON_CLIENT_PREALLOCATE=false
# One compile of each program per call: the benchmarks' children and the suite's workers compile the same XLA
# programs again (the first H200 call's JAX BERT-base child printed no row in 192 s).
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jax_cache} JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS=0
# They run side by side (each its own process and log; GPU_SESSION_FIRST_SECONDS bounds each), then the rest.
n=0
for item in ${GPU_SESSION_FIRST-}; do
  IFS=: read -r backend test <<<"$item"
  n=$((n + 1))
  KERAS_BACKEND=$backend KERAS_RECOMPUTE_TESTS_FAILURES="$work/failures_first_$n.log" \
    timeout -k 10 "${GPU_SESSION_FIRST_SECONDS:-150}" \
    python3 -m pytest "$test" -v -p no:cacheprovider >"$work/suite_first_$n.log" 2>&1 &
done
wait
[ -n "${GPU_SESSION_FIRST-}" ] && keep
lanes=${GPU_SESSION_LANES-"jax:9 torch:5"}  # backend:workers; "" skips the suite
for lane in $lanes; do
  IFS=: read -r backend workers <<<"$lane"
  KERAS_BACKEND=$backend KERAS_RECOMPUTE_TESTS_FAILURES="$work/failures_$backend.log" timeout -k 10 "$phase_a" \
    python3 -m pytest tests -v -n "$workers" --dist load -p no:cacheprovider --durations=25 >"$work/suite_$backend.log" 2>&1 &
done
first_step() {
  local name=$1
  shift
  timeout -k 10 "$phase_a" python3 benchmarks/first_step.py "$@" --out "$work/$name.json" >"$work/$name.log" 2>&1
}
exact_list=${GPU_SESSION_EXACT-"jax:float32 jax:float32:highest jax:mixed_bfloat16 jax:mixed_bfloat16:strict torch:float32 torch:mixed_bfloat16"}
for item in $exact_list; do  # backend:dtype[:highest|:strict|:unfused[:dropout]], the first-step exactness runs; "" skips them
  IFS=: read -r backend dtype precision dropout <<<"$item"
  case "$precision" in
    highest) flags="--matmul-precision highest" ;;
    strict) flags="--excess-precision off" ;;
    # strict, and nothing fused into a matmul's kernel (Triton's GEMM fusions, cuBLASLt's epilogues): whether
    # save_dots' and attention_core's 16x plain's spread in strict bfloat16 (2026-11-28) is that, as on the CPU
    unfused) flags="--excess-precision off --matmul-fusions off" ;;
    *) flags="" ;;
  esac
  # A dropout rate (e.g. 0: no masks kept, and attention_core then recomputes as full does) after the precision.
  [ -n "$dropout" ] && flags="$flags --dropout $dropout"
  # shellcheck disable=SC2086
  first_step "first_step_${backend}_${dtype}${precision:+_$precision}${dropout:+_dropout$dropout}" --backend "$backend" --dtype "$dtype" $flags &
done
# Issue 39 step 4 (memory only, so it may share the GPU): keras-hub BERT-base at seq 512, the largest batch
# predicted for a 16 GiB budget per option, then a step there and one above (the device allocator's peak).
# Items are backend:options (comma-separated); GPU_SESSION_FIT overrides, "" skips.
fit_list=${GPU_SESSION_FIT-"torch:none,full,save_dots,attention_core,plan jax:none,full,plan"}
for item in $fit_list; do
  IFS=: read -r backend options <<<"$item"
  timeout -k 10 "$phase_a" python3 benchmarks/largest_fit.py keras-hub-bert --backend "$backend" --seq 512 \
    --budget-mb 16384 --options ${options//,/ } --verify --out "$work/largest_fit_bert_base_16gib_$backend.json" \
    >"$work/largest_fit_bert_base_16gib_$backend.log" 2>&1 &
done
# What each policy adds to the step by XLA's own count on the GPU's compiler (`xla_costs.py`: nothing timed, so it
# may share the GPU): two BERT-base blocks at batch 32, dropout 0.1 then 0, each policy waiting as it does
# (`add`) and at a barrier (NOTE [ how the recompute waits on JAX ]); each row written as it ends.
# GPU_SESSION_COSTS: dtypes; "" skips.
for dtype in ${GPU_SESSION_COSTS-"mixed_bfloat16"}; do
  timeout -k 10 "$phase_a" python3 benchmarks/xla_costs.py --blocks 2 --batch 32 --dtype "$dtype" --dropout 0.1 0 \
    --wait add barrier \
    --out "$work/xla_costs_bert_blocks_${dtype}_gpu.json" >"$work/xla_costs_$dtype.log" 2>&1 &
done
wait
for log in "$work"/suite_*.log; do echo "== $log"; grep -E "^(FAILED|ERROR)|passed|failed|\[ *[0-9]+%\]" "$log" | tail -n 30; done
cat "$work"/first_step_*.log "$work"/largest_fit_*.log "$work"/xla_costs_*.log 2>/dev/null
keep

# Phase B: one at a time (timed). Each item is shape:backend:dtype:box:methods[:flag]; shapes:
#   bert  BERT-base, seq 512, batch 32 (`backends.py --bert-base`; backend hf: `hf_bert.py`, the peer)
#   bert0 the same without dropout: how much of a policy's time is drawing the dropout masks again
#   long  48 blocks x 768, seq 2048, batch 2: offload's shape (issue 39, step 3); there weights and Adam's
#         slots (5.8 GB) outweigh the 300 MB of inputs offload moves, and it saved nothing (2026-11-26)
#   deep  96 blocks x 256, seq 256, batch 64: a shape where the kept inputs (0.8 GB) are a large part of the
#         activations; the step's peak (2.4 GB) was Adam's update there (2026-11-29), the same with offload
#   deep512  the same at batch 512: the kept inputs (6.4 GB) above Adam's update (about 2.3 GB), where offload
#         can lower the step's peak (plain does not fit in the GPU: ours and offload only), with memory_report's
#         prediction of each beside the allocator's peak
unset XLA_PYTHON_CLIENT_PREALLOCATE
speed_list=${GPU_SESSION_SPEED-"bert:jax:mixed_bfloat16:200:none,ours,save_dots,attention_core deep:torch:mixed_bfloat16:90:none,ours,offload long:jax:mixed_bfloat16:150:ours,offload bert:hf:float32:70:none,checkpoint bert:jax:float32:200:none,ours,save_dots,attention_core bert:jax:float32:150:remat,rematscope bert:torch:float32:90:none,remat"}
for item in $speed_list; do
  IFS=: read -r shape backend dtype box methods flag <<<"$item"
  name="${shape}_${backend}_${dtype}_${methods//,/_}"
  case "$shape:$backend" in
    bert:hf) command="benchmarks/hf_bert.py --seq 512 --batch 32" ;;
    bert:*) command="benchmarks/backends.py --backend $backend --bert-base --seq 512 --batch 32" ;;
    bert0:*) command="benchmarks/backends.py --backend $backend --bert-base --seq 512 --batch 32 --dropout 0" ;;
    long:*) command="benchmarks/backends.py --backend $backend --blocks 48 --hidden 768 --heads 12 --ffn 3072 --seq 2048 --batch 2" ;;
    deep:*) command="benchmarks/backends.py --backend $backend --blocks 96 --hidden 256 --heads 4 --ffn 1024 --seq 256 --batch 64" ;;
    deep512:*) command="benchmarks/backends.py --backend $backend --blocks 96 --hidden 256 --heads 4 --ffn 1024 --seq 256 --batch 512 --steps 2 --predict" ;;
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
