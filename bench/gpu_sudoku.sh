#!/usr/bin/env bash
# On a machine with a GPU and jax[cuda13]: a Sudoku training run of at most about ten minutes
# (proj/sudoku/configs/sudoku_gpu.py) and its one-sample solve rate on the 500 held-out puzzles
# (docs/experiments/sudoku.md; docs/gpu.md has the setup):
#
#   python -m proj.sudoku.make_csv --out_dir=data_cache/gpu_sudoku --num_train=20000 --num_test=500 \
#       --min_blanks=30 --max_blanks=45
#   bash bench/gpu_sudoku.sh        # OUT=/tmp/gpu_out TRAIN_S=250 DATA=data_cache/gpu_sudoku (the defaults below)
#
# On a host without internet, put the wheels of the runtime dependencies into .whl/ first (docs/gpu.md): the
# script installs only the distributions the environment lacks from there, offline and without dependency
# resolution (an installed jax, flax, optax and orbax stay). It times 150 training steps, sets train.num_steps so
# the run ends inside TRAIN_S seconds of training, trains, and evaluates the last checkpoint with the released
# sampler. Everything a reader needs lands under $OUT (metrics.jsonl, config.json, logs, the predictions and their
# metrics), and every figure is printed as it is measured.
set -u
OUT=${OUT:-/tmp/gpu_out}
TRAIN_S=${TRAIN_S:-250}
DATA=${DATA:-data_cache/gpu_sudoku}
WORK=${WORK:-/tmp/gpu_sudoku}
mkdir -p "$OUT" "$WORK"
T0=$(date +%s)
say() { echo "[$(( $(date +%s) - T0 ))s] $*"; }
export PIP_BREAK_SYSTEM_PACKAGES=1 PIP_DISABLE_PIP_VERSION_CHECK=1 XLA_PYTHON_CLIENT_MEM_FRACTION=0.5
python3 -V
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv,noheader || true
nproc
if [ -d .whl ]; then
  MISSING=$(python3 - <<'EOF'
import importlib.metadata as md
names = """absl-py array_record attrs charset-normalizer cloudpickle etils filelock googleapis-common-protos grain humanize
immutabledict ml_collections opt_einsum portpicker prometheus_client promise protobuf safetensors sentencepiece simplejson
six tensorflow-datasets tensorflow-metadata tokenizers toml tqdm wrapt psutil dm-tree termcolor requests
urllib3 idna certifi""".split()
def have(name):
  try:
    md.version(name)
    return True
  except md.PackageNotFoundError:
    return False
print(" ".join(n for n in names if not have(n)))
EOF
)
  say "installing from .whl: ${MISSING:-nothing}"
  if [ -n "$MISSING" ]; then
    python3 -m pip install -q --no-index --no-deps --find-links .whl $MISSING 2>&1 | tail -3 \
      || python3 -m pip install -q --user --no-index --no-deps --find-links .whl $MISSING 2>&1 | tail -3
  fi
fi
python3 -c "import jax, flax, optax, orbax.checkpoint as ocp; print('jax', jax.__version__, 'flax', flax.__version__, \
'optax', optax.__version__, jax.devices())"
python3 -c "import train, proj.sudoku.eval" || { say "train.py does not import here; stopping"; exit 1; }
COMMON=(--config=proj/sudoku/configs/sudoku_gpu.py "--config.data.sudoku.train_csv=$DATA/train.csv"
        "--config.data.cache_dir=$WORK/cache" --config.train.progress_bar=False ${EXTRA:-})

say "timing 150 steps"
python3 train.py "${COMMON[@]}" --workdir="$WORK/timing" --config.train.num_steps=150 --config.opt.warmup_steps=50 --config.train.log_every=50 \
  --config.train.eval_every=100000 > "$OUT/timing.log" 2>&1 || { tail -30 "$OUT/timing.log"; exit 1; }
cp "$WORK/timing/metrics.jsonl" "$OUT/timing_metrics.jsonl"
read -r STEPS_PER_S NUM_STEPS < <(python3 - "$WORK/timing" "$TRAIN_S" <<'EOF'
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1] + "/metrics.jsonl")]
data = json.load(open(sys.argv[1] + "/config.json"))["data"]
train = [r for r in rows if r["split"] == "train"]
steps_per_s = train[-1]["tokens_per_sec"] / (data["batch_size"] * data["seq_len"])  # steps 101-150: no compile
print(f"{steps_per_s:.2f}", max(100, int(float(sys.argv[2]) * steps_per_s * 0.95) // 100 * 100))
EOF
)
say "steps/s ${STEPS_PER_S} -> train.num_steps=${NUM_STEPS} for ${TRAIN_S}s of training"

say "training"
timeout $((TRAIN_S + 150)) python3 train.py "${COMMON[@]}" --workdir="$WORK/run" --config.train.num_steps="$NUM_STEPS" \
  --config.train.ckpt_every=$(( NUM_STEPS / 4 )) --config.train.eval_every=$(( NUM_STEPS / 4 )) \
  --config.opt.warmup_steps=$(( NUM_STEPS / 5 < 200 ? NUM_STEPS / 5 : 200 )) > "$OUT/train.log" 2>&1
say "training exit $?"
grep -v "^WARNING\|^I[0-9]" "$OUT/train.log" | tail -8
cp "$WORK/run/metrics.jsonl" "$WORK/run/config.json" "$OUT/" 2>/dev/null
python3 - "$WORK/run/metrics.jsonl" <<'EOF'
import json, sys
for r in map(json.loads, open(sys.argv[1])):
  if r["split"] == "eval":
    print("eval step", r["step"], "canvas_ce", round(r["canvas_ce"], 4), "canvas_accuracy", round(r["canvas_accuracy"], 4))
EOF

say "evaluating on 500 held-out puzzles"
timeout 150 python3 -m proj.sudoku.eval --checkpoint="$WORK/run" --puzzles="$DATA/test.csv" --batch_size=500 \
  --predictions="$OUT/predictions.jsonl" 2>&1 | grep -v "^WARNING\|^I[0-9]" | tail -5 | tee "$OUT/eval.log"
say "done"
