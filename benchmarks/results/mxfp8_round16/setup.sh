# flashinfer into /tmp/site (idempotent)
if [ ! -d /tmp/site/flashinfer ]; then
  python3 -m pip install -q --no-index --no-deps --target /tmp/site .whl/apache_tvm_ffi-*.whl && tar -xJf .whl/flashinfer-0.7.4-site.tar.xz -C /tmp/site
fi
export TRITON_CACHE_DIR=$HOME/.cache/graphcap/triton FLASHINFER_WORKSPACE_BASE=$HOME/.cache/graphcap/flashinfer
export PYTHONUNBUFFERED=1 PYTHONDONTWRITEBYTECODE=1 FLASHINFER_USE_CUDA_NORM=1
nvidia-smi --query-gpu=name,clocks.sm,clocks.mem --format=csv,noheader
