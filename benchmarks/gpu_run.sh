# The one prepared run for a lent GPU box (no network, 64 MiB carried per call; docs/tensorrt.md).
# Wheels travel in parts (prepared here by `bash benchmarks/gpu_run.sh split`), one folder per call:
#   .whl/small  flask, polygraphy, gguf, llguidance, onnxruntime-genai-cuda (pure Python or small)
#   .whl/p1..   onnxruntime-gpu 1.31.1 in parts      .whl/r1..  tensorrt-rtx-cu13 libs + bindings in parts
# On the box, in order, each call carrying its folder:
#   bash benchmarks/gpu_run.sh carry small p1   # keeps the parts; starts the CPU-side preparation
#   bash benchmarks/gpu_run.sh carry p2 ...     # (the box keeps /tmp while it stays warm)
#   bash benchmarks/gpu_run.sh main             # onnxruntime-gpu, pytest -m gpu, parity, speed -> $OUT
#   bash benchmarks/gpu_run.sh rtx              # TensorRT-RTX probe -> $OUT
#   bash benchmarks/gpu_run.sh suite            # pytest -m gpu alone -> $OUT (carry with NOPREP=1)
#   bash benchmarks/gpu_run.sh serve            # llmx serve on ort-cuda vs ort-cpu, the demo model -> $OUT
# `prep` (started by the first carry) writes the random-weight checkpoint and builds every artifact
# and genai model on the CPU while later parts travel; `main` finishes what it could not.
set -u
WORK=${WORK:-/tmp/gb}
SHAPE=${SHAPE:-tinyllama-1.1b}
OUT=${OUT:-/tmp/out}
stages() {
  for stage in export optimize runtime serve calibration engine; do
    [ -d "$stage" ] && [ ! -e "llmx/$stage" ] && ln -s "../$stage" "llmx/$stage"
  done
}
case "${1:-}" in
split)  # here: the wheels downloaded into .whl/big cut into folders of at most 45 MB (with the 16 MB tree, under 64 MiB a call)
  cd .whl && rm -rf p? r? && mkdir -p parts && cd parts && rm -f part_* rtx_*
  split -b 45000000 ../big/onnxruntime_gpu-*.whl part_
  tar -cf - -C ../big $(cd ../big && ls tensorrt_rtx_*.whl) | split -b 50000000 - rtx_
  i=1; for f in part_*; do mkdir -p ../p$i && mv $f ../p$i/; i=$((i + 1)); done
  i=1; for f in rtx_*; do mkdir -p ../r$i && mv $f ../r$i/; i=$((i + 1)); done
  cd .. && rmdir parts && du -sh small p? r? ;;
carry)
  shift
  mkdir -p /tmp/ortparts /tmp/rtxparts
  for d in "$@"; do
    case $d in
      small) mkdir -p /tmp/small && cp .whl/small/*.whl /tmp/small/ &&
             python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site0 /tmp/small/*.whl ;;
      r*) cp .whl/$d/* /tmp/rtxparts/ ;;
      *) cp .whl/$d/* /tmp/ortparts/ ;;
    esac
  done
  ls -la /tmp/ortparts /tmp/rtxparts
  if [ -z "${NOPREP:-}" ] && [ ! -e /tmp/prep.tree ]; then
    pkill -f gpu_big.py; sleep 1
    # each call re-syncs the working tree (links made in it vanish): prepare from a copy
    touch /tmp/prep.started /tmp/prep.tree; rm -rf /tmp/tree; mkdir -p /tmp/tree "$WORK"
    tar -cf - --exclude=./.whl . | tar -xf - -C /tmp/tree; cd /tmp/tree; stages
    # onnxruntime here is the image's CPU build: the preparation runs no GPU code
    PYTHONPATH=$PWD:/tmp/site0 PYTHONUNBUFFERED=1 setsid nohup bash -c \
      "python3 benchmarks/gpu_big.py prepare-small --work $WORK & python3 benchmarks/gpu_big.py prepare --shape $SHAPE --work $WORK; wait; touch /tmp/prep.done" \
      > /tmp/prep.log 2>&1 < /dev/null &
  fi
  # a carry must succeed without a preparation (NOPREP=1), so that `carry p6 && ... suite` chains
  tail -5 /tmp/prep.log 2>/dev/null; ls "$WORK" 2>/dev/null; true ;;
main)
  mkdir -p "$OUT"
  nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv | tee "$OUT/gpu.txt"
  PARTS=/tmp/ortparts SMALL=/tmp/small source benchmarks/gpu_env.sh || exit 1
  # the GPU tests and the TensorRT-RTX probe use the GPU while the CPU-side preparation ends
  timeout 300 python3 -m pytest -m gpu -q -p no:cacheprovider --continue-on-collection-errors tests > "$OUT/pytest_gpu.log" 2>&1 &
  tests=$!
  if ls /tmp/rtxparts/rtx_* > /dev/null 2>&1; then
    for i in $(seq 1 30); do [ -e "$WORK/art-demo/llmx.json" ] && break; sleep 2; done
    (bash benchmarks/gpu_run.sh rtx 2>&1 | tail -30)
  fi
  for i in $(seq 1 120); do [ -e /tmp/prep.done ] && break; sleep 2; done
  cp /tmp/prep.log "$OUT/prep.log"
  python3 benchmarks/gpu_big.py prepare-small --work "$WORK" > "$OUT/prepare2.log" 2>&1
  python3 benchmarks/gpu_big.py prepare --shape "$SHAPE" --work "$WORK" >> "$OUT/prepare2.log" 2>&1
  python3 benchmarks/gpu_big.py parity --work "$WORK" 2>&1 | tee "$OUT/parity.log"
  wait $tests; tail -25 "$OUT/pytest_gpu.log"
  python3 benchmarks/gpu_big.py speed --work "$WORK" 2>&1 | tee "$OUT/speed.log"
  cp "$WORK/results.json" "$OUT/results.json" ;;
suite)  # the GPU tests alone, on the code as it is now: a regression check for a short loan
  mkdir -p "$OUT"
  nvidia-smi --query-gpu=name,driver_version,memory.total,compute_cap --format=csv | tee "$OUT/gpu.txt"
  PARTS=/tmp/ortparts SMALL=/tmp/small source benchmarks/gpu_env.sh || exit 1
  set -o pipefail
  timeout 420 python3 -m pytest -m gpu -v -p no:cacheprovider --continue-on-collection-errors tests 2>&1 \
    | tee "$OUT/pytest_gpu.log" | grep -E "PASS|FAIL|ERROR|SKIP|passed|failed" ;;
serve)  # llmx serve --backend ort-cuda against ort-cpu on the demo model: the same completions
  mkdir -p "$OUT"
  PARTS=/tmp/ortparts SMALL=/tmp/small source benchmarks/gpu_env.sh || exit 1
  python3 -c "from llmx.cli import main; main()" export llmx/demo_model -o /tmp/demo-art --force > "$OUT/export.log" 2>&1 \
    || { tail -5 "$OUT/export.log"; exit 1; }
  timeout 400 python3 benchmarks/gpu_serve_check.py /tmp/demo-art --out "$OUT/serve_check.json" 2>&1 | tail -20 ;;
rtx)
  mkdir -p "$OUT" /tmp/rtxwheels
  cat /tmp/rtxparts/rtx_* | tar -xf - -C /tmp/rtxwheels
  python3 -m pip install -q --no-index --no-deps --no-compile --upgrade --target /tmp/site_rtx /tmp/rtxwheels/*.whl || exit 1
  PYTHONPATH=/tmp/site_rtx:${PYTHONPATH:-} python3 benchmarks/trt_rtx_probe.py --onnx "$WORK/art-demo/decode.onnx" --out "$OUT/trt_rtx_probe.json" ;;
*) echo "usage: gpu_run.sh split|carry FOLDER...|main|suite|serve|rtx"; exit 2 ;;
esac
