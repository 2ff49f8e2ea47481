"""Float32 values as PyTorch's CPU kernels compute them, for meshwork-nn's `torch_cpu`
module (the rotary inverse frequencies and RMSNorm's row sums of Hugging Face's Llama
family), on an AVX-512 x86 CPU.

    pip install torch numpy
    python3 gen_torch_cpu.py OUT_DIR

Writes, all little-endian:
  pow.bin    float32 triples (base, exponent, base ** exponent) as
             `base ** (torch.arange(0, d, 2).float() / d)` computes them
  sums.bin   for n in NS: float32 sums of 16 rows of n values, row r's k-th value
             being float32(((r * 7919 + k * 104729) % 2000) / 250.0 - 4.0), summed as
             `torch.Tensor.sum(-1)` does
Printed: torch's version and CPU capability.
"""
import sys, os
import numpy as np
import torch

NS = [1, 7, 8, 9, 31, 32, 33, 63, 64, 96, 100, 128, 129, 511, 512, 576, 960, 1000, 1536,
      2048, 2049, 3072, 4096, 5120, 8192, 16384]


def main():
    out = sys.argv[1]
    os.makedirs(out, exist_ok=True)
    rows = []
    for theta in (1e4, 5e4, 1e5, 5e5, 1e6, 2e6, 8e6, 1.5e7):
        for d in (8, 16, 32, 48, 64, 80, 96, 128, 160, 256):
            e = torch.arange(0, d, 2, dtype=torch.int64).float() / d
            p = theta ** e
            base = torch.full_like(e, theta)
            rows.append(torch.stack([base, e, p], 1))
    torch.cat(rows).numpy().astype('<f4').tofile(os.path.join(out, "pow.bin"))
    sums = []
    for n in NS:
        r = np.arange(16)[:, None]
        k = np.arange(n)[None, :]
        v = (((r * 7919 + k * 104729) % 2000) / 250.0 - 4.0).astype(np.float32)
        sums.append(torch.from_numpy(v).sum(-1).numpy())
    np.concatenate(sums).astype('<f4').tofile(os.path.join(out, "sums.bin"))
    print(torch.__version__, torch.backends.cpu.get_cpu_capability())


if __name__ == "__main__":
    main()
