#!/usr/bin/env bash
# Everything that needs a GPU, in one pass whose step limits add up to 7 minutes on one H200,
# most important first (../shared/GPU_PLAN.md), each step appending its JSON line to
# OUT_DIR/steps.jsonl as it ends, so a pass cut short loses only its tail:
#   1. tests: the compiled Pallas kernels, the compression and the engine against their
#      references (the `gpu`-marked tests, skipped on CPU, and the engine and policy suites),
#      four pytest workers, since compiling, not running, is most of their time;
#   2. scale: the paper's throughput table at full shape: an R1-Llama-8B-shaped random-weight
#      model in bfloat16, FullKV at its largest batch against R-KV (budget 1024, and 10%) at
#      theirs, and R-KV at FullKV's batch, 16K then 8K generated tokens (bench/scale.py);
#   3. kernel: the redundancy kernel against the jnp path at decode-time sizes (n = budget +
#      buffer for budgets 1024 and 4096) over a sweep of tiles, time and compiled memory;
#   4. kv_int8: an int8 cache at the scale step's shape, FullKV at 16K generated tokens at its
#      own largest batch (about twice bfloat16's), timed as the scale step times its bfloat16
#      FullKV row, which is the other half of the pair;
#   5. host: the host's CPU time per token against the GPU's chunk time at 256 and 1,024 slots.
# Not in the default pass (name them): kv_int8_invariant (kv_int8 with the engine's batch
# invariance on, its default for an 8-bit cache), checkpoint (the random-init DeepSeek-R1-Distill-Qwen-1.5B
# folder the next four read), decode (rkvjax against transformers at batch 1 and 32),
# memory_speed (R-KV against FullKV as one row's context grows), tail (a run's tail decoded
# narrow against every slot, 64 slots), load_time (loading from safetensors and from an
# `rkvjax convert` folder) and moe (the scale step for Qwen3-30B-A3B's shape: 61 GB of
# random bfloat16 weights, 3.35B of 30.5B parameters active; an H200's 141 GB, not an 80 GB
# card).
#
#   bash bench/gpu_suite.sh [OUT_DIR [STEP...]]   # default bench/results/gpu, the default pass
#
# STEP is one of tests, scale, kernel, kv_int8, host, kv_int8_invariant, checkpoint, decode, memory_speed, tail,
# load_time, moe; named steps run in the order given (decode, memory_speed, tail and load_time need
# checkpoint, in this run or an earlier one). Each step has its own time limit and log, and a
# failing step does not stop the next one. Assumes jax with CUDA, flax, orbax, torch and
# transformers are installed; installs rkvjax itself (editable, without dependencies) when it
# is not importable. Run from the repository root (`python -m bench`); the scale steps read the
# published configs under RKVJAX_DATA's folder (real_configs/). Results: OUT_DIR/<suite>/
# (results.jsonl, table.md, plot.png; kv_int8 writes OUT_DIR/kv_int8/scale/), a log per step
# in OUT_DIR and OUT_DIR/steps.jsonl, summarised in bench/README.md.
set -u
out=${1:-${OUT:-bench/results/gpu}}
mkdir -p "$out"
py=${PYTHON:-python3}
export PYTHONUNBUFFERED=1 JAX_PLATFORMS=cuda
ckpt=${RKVJAX_GPU_CKPT:-/tmp/rkvjax-r1-distill-qwen-1.5b-random}

step() {  # step NAME SECONDS CMD...: output to $out/NAME.log, status and tail on stdout
	local name=$1 secs=$2 t0=$SECONDS
	shift 2
	echo "=== $name (limit ${secs}s): $*"
	timeout -k 5 "$secs" "$@" >"$out/$name.log" 2>&1
	local rc=$?
	echo "=== $name rc=$rc in $((SECONDS - t0))s"
	printf '{"step": "%s", "rc": %d, "seconds": %d, "limit_s": %d, "timed_out": %s, "date": "%s"}\n' \
		"$name" "$rc" "$((SECONDS - t0))" "$secs" "$([ $rc = 124 ] || [ $rc = 137 ] && echo true || echo false)" \
		"$(date -u +%FT%TZ)" >>"$out/steps.jsonl"
	tail -n 30 "$out/$name.log"
}

# Editable: the tests import `rkvjax` from the source tree, where only an editable install maps
# `rkvjax.models` and `rkvjax.convert` (models/, convert/).
if ! (cd / && $py -c "import rkvjax.convert" 2>/dev/null); then
	$py -m pip install -q --no-deps --no-build-isolation -e . || exit 1
fi
# The published configs the scale steps read (RKVJAX_DATA's folder, as bench/common.py has it).
configs=$($py -c 'from bench import common; print(common.DATA.parent / "real_configs")')
$py - <<'EOF'
import jax, flax, torch, transformers
print("jax", jax.__version__, "flax", flax.__version__, "torch", torch.__version__,
      "transformers", transformers.__version__, jax.devices())
EOF

run_step() {
	case $1 in
	# Without preallocation, so that the four workers share the GPU.
	tests) step tests 110 env XLA_PYTHON_CLIENT_PREALLOCATE=false $py -m pytest -q -n 4 \
		-p no:cacheprovider -m "not slow" -o "addopts=" -rs tests/test_kernels.py \
		tests/test_compression.py tests/test_policy.py tests/test_engine.py ;;
	# One process owns the GPU here: let it have 95% (JAX takes 75% by default), of which the
	# suite sizes its batches to 90%. It starts no setting after 100 s; each takes ~30-60 s.
	scale) step scale 170 env XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 $py -m bench scale \
		--out "$out" --gen-tokens 16384 8192 --warmup-steps 64 --timed-steps 128 \
		--time-limit-s 100 ;;
	# Sizes ascending, rows written as they finish: a slow tile at 4224 cannot hide 1152's.
	kernel) step kernel 50 $py -m bench kernels --out "$out" --sizes 1152 4224 --batch 8 \
		--kv-heads 8 --repeats 3 --tiles 16x64 32x32 32x64 64x32 64x64 32x128 128x32 64x128 \
		128x64 ;;
	# Batch invariance off, as the bfloat16 row is (it is on by default for an 8-bit cache and
	# costs decode speed: kv_int8_invariant times that).
	kv_int8) step kv_int8 60 env XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 $py -m bench scale \
		--out "$out/kv_int8" --methods full --kv-dtype int8 --gen-tokens 16384 \
		--warmup-steps 64 --timed-steps 128 --batch-invariant off ;;
	kv_int8_invariant) step kv_int8_invariant 60 env XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 \
		$py -m bench scale --out "$out/kv_int8_invariant" --methods full --kv-dtype int8 \
		--gen-tokens 16384 --warmup-steps 64 --timed-steps 128 --batch-invariant on ;;
	# Whether the host keeps up with the device at many slots: main-thread CPU per token next
	# to the wall time of the same runs, the tiny model (its device time is least, so the
	# host's share is most).
	host) step host 30 $py -m bench host --out "$out" --slots 256 1024 --default-model-slots \
		--repeats 1 ;;
	checkpoint) step checkpoint 45 $py -m bench.checkpoints r1-distill-qwen-1.5b "$ckpt" \
		--dtype bfloat16 --std 0.02 ;;
	decode) step decode 120 $py -m bench decode --out "$out" --model "$ckpt" --dtype bfloat16 \
		--batch 1 32 --new-tokens 256 --repeats 3 --hf-threads 16 --hf-bf16-repeats 3 \
		--bandwidth-mib 4096 ;;
	memory_speed) step memory_speed 120 $py -m bench memory --out "$out" --model "$ckpt" \
		--dtype bfloat16 --methods full rkv --budget 1024 --contexts 4096 16384 --new-tokens 256 \
		--repeats 3 --skip-capacity ;;
	# Whether the narrow tail repays compiling each width at scale: 64 requests in 64 slots,
	# one at 2048 tokens, the rest 128..1024 (its CPU run is 16 slots of the 135M model). The
	# batch scenario only: online runs the 63 short requests one after another.
	tail) step tail 180 $py -m bench tail --out "$out" --model "$ckpt" --dtype bfloat16 \
		--slots 64 --long-tokens 2048 --short-tokens 128 1024 --prompt 256 --budget 1024 \
		--buffer 128 --repeats 1 --scenarios batch ;;
	# Several processes share the GPU here, so none may take JAX's default 75% up front.
	load_time) step load_time 120 env XLA_PYTHON_CLIENT_PREALLOCATE=false $py -m bench load \
		--out "$out" --model "$ckpt" --dtype bfloat16 --repeats 3 ;;
	# A mixture of experts at full shape: whether the grouped expert products (gathered per
	# tile) keep decode near a dense model of its active size, FullKV against R-KV, 8K tokens.
	moe) step moe 240 env XLA_PYTHON_CLIENT_MEM_FRACTION=0.95 $py -m bench scale \
		--out "$out/moe" --config "$configs/moe/Qwen3-30B-A3B.json" \
		--gen-tokens 8192 --warmup-steps 32 --timed-steps 64 --time-limit-s 150 ;;
	*) echo "unknown step: $1" >&2 ;;
	esac
}

shift $(($# > 0 ? 1 : 0))
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(tests scale kernel kv_int8 host)
for name in "${steps[@]}"; do run_step "$name"; done
