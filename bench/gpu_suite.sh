#!/usr/bin/env bash
# Everything that needs a GPU, in one pass of about ten minutes on one H200:
#   1. the compiled Pallas kernels, the compression and the engine against their references
#      (the `gpu`-marked tests, skipped on CPU, and the engine and policy suites on the GPU);
#   2. the redundancy kernel against the jnp path (time and compiled memory vs n);
#   3. decode speed of a random-init DeepSeek-R1-Distill-Qwen-1.5B-shaped model in bfloat16,
#      rkvjax against transformers on the same GPU, and R-KV against FullKV as the context grows;
#   4. loading that model onto the GPU from safetensors and from an `rkvjax convert` folder.
#
#   bash bench/gpu_suite.sh [OUT_DIR [STEP...]]   # default bench/results/gpu, every step
#
# STEP is one of tests, kernel, checkpoint, decode, memory_speed, load_time; named steps run in
# the order given (decode, memory_speed and load_time need checkpoint, in this run or an earlier
# one). Each step has its own time limit and log, and a failing step does not stop the next one.
# Assumes jax with CUDA, flax, orbax, torch and transformers are installed; installs rkvjax
# itself (editable, without dependencies) when it is not importable. Run from the repository
# root (`python -m bench`). Results: OUT_DIR/<suite>/ (results.jsonl, table.md, plot.png) and a
# log per step in OUT_DIR, summarised in bench/README.md.
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
	timeout "$secs" "$@" >"$out/$name.log" 2>&1
	local rc=$?
	echo "=== $name rc=$rc in $((SECONDS - t0))s"
	tail -n 30 "$out/$name.log"
}

# Editable: the tests import `rkvjax` from the source tree, where only an editable install maps
# `rkvjax.models` and `rkvjax.convert` (models/, convert/).
if ! (cd / && $py -c "import rkvjax.convert" 2>/dev/null); then
	$py -m pip install -q --no-deps --no-build-isolation -e . || exit 1
fi
$py - <<'EOF'
import jax, flax, torch, transformers
print("jax", jax.__version__, "flax", flax.__version__, "torch", torch.__version__,
      "transformers", transformers.__version__, jax.devices())
EOF

run_step() {
	case $1 in
	tests) step tests 200 $py -m pytest -q -p no:cacheprovider -m "not slow" -o "addopts=" -rs \
		tests/test_kernels.py tests/test_compression.py tests/test_policy.py tests/test_engine.py ;;
	kernel) step kernel 60 $py -m bench kernels --out "$out" --sizes 1024 4096 8192 --batch 4 \
		--kv-heads 8 ;;
	checkpoint) step checkpoint 45 $py -m bench.checkpoints r1-distill-qwen-1.5b "$ckpt" \
		--dtype bfloat16 --std 0.02 ;;
	decode) step decode 180 $py -m bench decode --out "$out" --model "$ckpt" --dtype bfloat16 \
		--batch 1 32 --new-tokens 256 --repeats 3 --hf-threads 16 --hf-bf16-repeats 3 \
		--bandwidth-mib 4096 ;;
	memory_speed) step memory_speed 120 $py -m bench memory --out "$out" --model "$ckpt" \
		--dtype bfloat16 --methods full rkv --budget 1024 --contexts 4096 16384 --new-tokens 256 \
		--repeats 3 --skip-capacity ;;
	# Several processes share the GPU here, so none may take JAX's default 75% up front.
	load_time) step load_time 120 env XLA_PYTHON_CLIENT_PREALLOCATE=false $py -m bench load \
		--out "$out" --model "$ckpt" --dtype bfloat16 --repeats 3 ;;
	*) echo "unknown step: $1" >&2 ;;
	esac
}

shift $(($# > 0 ? 1 : 0))
steps=("$@")
[ ${#steps[@]} -gt 0 ] || steps=(tests kernel checkpoint decode memory_speed load_time)
for name in "${steps[@]}"; do run_step "$name"; done
