# Source on a lent GPU box (no network): assembles onnxruntime-gpu from the parts carried to
# $PARTS, installs it and the small wheels in $SMALL (default .whl/small) into /tmp/site, links the stage
# folders into llmx/ of this (device-side) copy of the tree, as pyproject's package-dir maps them,
# and puts the CUDA 13 libraries of the box's nvidia-* wheels on LD_LIBRARY_PATH.
#   PARTS=/tmp/ortparts source benchmarks/gpu_env.sh
PARTS=${PARTS:-/tmp/ortparts}
SMALL=${SMALL:-.whl/small}
if [ ! -d /tmp/site/onnxruntime ]; then
  wheel=/tmp/onnxruntime_gpu-1.31.1-cp312-cp312-manylinux_2_28_x86_64.whl
  cat "$PARTS"/part_* > "$wheel" && sha256sum "$wheel"
  python3 -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade --target /tmp/site "$wheel" "$SMALL"/*.whl || return 1
fi
for stage in export optimize runtime serve calibration engine; do
  [ -d "$stage" ] && [ ! -e "llmx/$stage" ] && ln -s "../$stage" "llmx/$stage"
done
libs=$(python3 - <<'PY'
import glob, os, site
dirs = set()
for root in site.getsitepackages():
    for pattern in ("libcudart.so*", "libcublas*.so*", "libcudnn.so*", "libcufft.so*", "libcurand.so*", "libnvJitLink.so*"):
        dirs.update(os.path.dirname(p) for p in glob.glob(f"{root}/nvidia/**/{pattern}", recursive=True))
print(":".join(sorted(dirs)))
PY
)
export LD_LIBRARY_PATH="$libs${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
export PYTHONPATH=$PWD:/tmp/site PYTHONUNBUFFERED=1
python3 -c "import onnxruntime as o; print('onnxruntime', o.__version__, o.__file__, o.get_available_providers())"
