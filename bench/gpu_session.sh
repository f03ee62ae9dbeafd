#!/usr/bin/env bash
# The whole GPU measurement of issue #17 (items 4-6 and 8) as one device call, prepared on CPU:
#
#   .venv/bin/pip download ... into .whl/ (the wheels tokamax 0.0.12 needs, for Python 3.11-3.14; docs/benchmarks.md,
#   "Full model on one GPU", has the command), then from the session:
#   run(command="bash bench/gpu_session.sh", carry=[".whl"], timeout_s=500)
#
# Prints the machine (Python, GPU), installs tokamax and qwix from .whl/ offline (the image has jax, flax and numpy),
# then runs bench/gpu_full_model.py with its four variants under a time limit, then bench/gpu_train_step.py (the
# medium preset's train step, moe_impl tokamax and dense) under its own, writing each JSON and log under
# $OUT (the device tool's output folder; /tmp/gpu_out elsewhere). Every figure is printed as it is measured, and the
# JSON is rewritten after each variant, so a run cut short still returns what it measured.
set -u
OUT=${OUT:-/tmp/gpu_out}
LIMIT_S=${LIMIT_S:-300}
TRAIN_LIMIT_S=${TRAIN_LIMIT_S:-140}
mkdir -p "$OUT"
python3 -V
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
python3 -c "import jax, flax; print('jax', jax.__version__, 'flax', flax.__version__, jax.devices())"
if [ -d .whl ]; then
  python3 -m pip install -q --no-index --find-links .whl tokamax qwix 2>&1 | tail -3 \
    || python3 -m pip install -q --user --no-index --find-links .whl tokamax qwix 2>&1 | tail -3
fi
python3 -c "import tokamax, qwix; print('tokamax', getattr(tokamax, '__version__', '?'), 'installed')" \
  || echo "tokamax is not importable: the fast variants will be skipped"
timeout "$LIMIT_S" python3 bench/gpu_full_model.py --out="$OUT/full_model.json" "$@" 2>&1 | tee "$OUT/full_model.log"
echo "exit ${PIPESTATUS[0]}"
timeout "$TRAIN_LIMIT_S" python3 bench/gpu_train_step.py --out="$OUT/train_step.json" 2>&1 | tee "$OUT/train_step.log"
echo "exit ${PIPESTATUS[0]}"
