#!/usr/bin/env bash
# The GPU rows of docs/performance.md in one prepared run on the GPU machine (one
# NVIDIA GPU; JAX with CUDA and PyTorch installed there, no Rust toolchain): meshwork's
# XLA back end through the CUDA PJRT plugin beside JAX's `jit` and PyTorch (eager and
# `torch.compile`) on the same models, in the same run.
#
#   cargo build --release -p meshwork-strategy --example xla_bench     # here
#   strategy/benches/gpu/run_gpu_bench.sh target/release/examples/xla_bench "$OUT"   # there
#
# Writes gpu.txt (the device), meshwork.txt, jax.txt and torch.txt to OUTDIR.
set -u
bin=${1:?the xla_bench binary}
out=${2:?an output directory}
here=$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)
mkdir -p "$out"
site=$(python3 -c "import site; print(site.getsitepackages()[0])")
plugin=$(ls "$site"/jax_plugins/xla_cuda*/xla_cuda_plugin.so 2>/dev/null | head -1)
nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv > "$out/gpu.txt" 2>&1
echo "plugin: $plugin" >> "$out/gpu.txt"
MESHWORK_PJRT_PLUGIN=$plugin timeout 240 "$bin" small small64 gpt2 nointerp nojax steps=20 \
  > "$out/meshwork.txt" 2>&1
timeout 150 python3 "$here/../jax/gpu_bench.py" small small64 gpt2 > "$out/jax.txt" 2>&1
timeout 150 python3 "$here/torch_bench.py" f32 > "$out/torch.txt" 2>&1
tail -n +1 "$out"/*.txt
