# JAX on one GPU: the transformer of nn/testdata/gen_transformer_case.py (f32, Adam), tokens/s, median of 5 runs.
#   python3 gpu_bench.py [small] [small64] [gpt2] [gpt2bf16] [gpt2bf16b32]   (on the GPU machine: JAX 0.11.2 with CUDA is installed there)
import os, sys, time, statistics
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "nn", "testdata"))
import numpy as np, jax, jax.numpy as jnp
import gen_transformer_case as ref
jax.config.update("jax_enable_x64", False)
print("JAX", jax.__version__, jax.devices(), flush=True)

def bench(cfg, steps, dtype=np.float32, bf16=False):
    r = np.random.default_rng(1)
    p0 = {k: v.astype(dtype) for k, v in ref.init(cfg, r).items()}
    rows = r.integers(0, cfg["vocab"], (max(cfg["batch"] * steps, 64), cfg["seq"] + 1)).astype(np.int32)
    def step(p, m, v, t, batch):
        if bf16:
            def lf(p):
                q = {k: v.astype(jnp.bfloat16) for k, v in p.items()}
                logits = ref.forward(q, batch[:, :-1], cfg).astype(jnp.float32)
                lp = jax.nn.log_softmax(logits, axis=-1)
                return -jnp.take_along_axis(lp, batch[:, 1:, None], axis=-1).mean()
            l, g = jax.value_and_grad(lf)(p)
        else:
            l, g = jax.value_and_grad(lambda p: ref.loss_fn(p, batch, cfg))(p)
        m = {k: 0.9 * m[k] + 0.1 * g[k] for k in p}
        v = {k: 0.999 * v[k] + 0.001 * g[k] ** 2 for k in p}
        p = {k: p[k] - 1e-3 * (m[k] / (1 - 0.9 ** t)) / (jnp.sqrt(v[k] / (1 - 0.999 ** t)) + 1e-8) for k in p}
        return p, m, v, l
    f = jax.jit(step, donate_argnums=(0, 1, 2))
    batches = [jax.device_put(rows[s * cfg["batch"]:(s + 1) * cfg["batch"]]) for s in range(steps)]
    rates = []
    for run in range(6):
        p = {k: jax.device_put(v) for k, v in p0.items()}
        m = {k: jax.device_put(np.zeros_like(v)) for k, v in p0.items()}
        v = {k: jax.device_put(np.zeros_like(v)) for k, v in p0.items()}
        jax.block_until_ready(p)
        t0 = time.perf_counter()
        for s, b in enumerate(batches):
            p, m, v, l = f(p, m, v, float(s + 1), b)
        jax.block_until_ready(l)
        if run > 0:
            rates.append(steps * cfg["batch"] * cfg["seq"] / (time.perf_counter() - t0))
    n = sum(x.size for x in p0.values())
    print(f"  {cfg['name']:<34} params {n/1e6:7.1f}M  {statistics.median(rates):>12.0f} tokens/s  (min {min(rates):.0f} max {max(rates):.0f})", flush=True)

small = dict(name="ref V256 T128 D256 H8 L4 F1024 b16", seed=1, vocab=256, seq=128, dim=256, heads=8, layers=4, ffn=1024, batch=16)
which = sys.argv[1:] or ["small", "small64", "gpt2"]
if "small" in which: bench(small, 20)
if "small64" in which: bench(dict(small, name="ref V256 T128 D256 H8 L4 F1024 b64", batch=64), 20)
if "gpt2bf16" in which: bench(dict(name="gpt2s bf16 V50304 T1024 D768 H12 L12 b8", seed=1, vocab=50304, seq=1024, dim=768, heads=12, layers=12, ffn=3072, batch=8), 10, bf16=True)
if "gpt2bf16b32" in which: bench(dict(name="gpt2s bf16 V50304 T1024 D768 H12 L12 b32", seed=1, vocab=50304, seq=1024, dim=768, heads=12, layers=12, ffn=3072, batch=32), 10, bf16=True)
if "gpt2" in which: bench(dict(name="gpt2s V50304 T1024 D768 H12 L12 b8", seed=1, vocab=50304, seq=1024, dim=768, heads=12, layers=12, ffn=3072, batch=8), 10)
