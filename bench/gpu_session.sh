#!/usr/bin/env bash
# On a machine with a GPU and jax[cuda13]: the full model's denoising step (bench/gpu_full_model.py, its four
# variants), the medium preset's train step (bench/gpu_train_step.py, moe_impl tokamax and dense) and the QLoRA
# recipe's step on the full model (bench/gpu_qlora_train.py), each under a time limit (docs/benchmarks.md
# "Full model on one GPU"; docs/gpu.md has the setup):
#
#   bash bench/gpu_session.sh       # OUT=/tmp/gpu_out LIMIT_S=300 TRAIN_LIMIT_S=140 QLORA_LIMIT_S=240 (defaults)
#
# Prints the machine (Python, GPU); on a host without internet, installs tokamax and qwix from the wheels in .whl/
# (docs/gpu.md says how to fill it); then writes each JSON and log under $OUT. Every figure is printed as it is
# measured, and the JSON is rewritten after each variant, so a run cut short still keeps what it measured.
set -u
OUT=${OUT:-/tmp/gpu_out}
LIMIT_S=${LIMIT_S:-300}
TRAIN_LIMIT_S=${TRAIN_LIMIT_S:-140}
QLORA_LIMIT_S=${QLORA_LIMIT_S:-240}
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
timeout "$QLORA_LIMIT_S" python3 bench/gpu_qlora_train.py --out="$OUT/qlora_train.json" 2>&1 | tee "$OUT/qlora_train.log"
echo "exit ${PIPESTATUS[0]}"
