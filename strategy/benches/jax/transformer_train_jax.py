# JAX side of the transformer training-throughput comparison: the decoder-only model of
# ../oracles/transformer/gen_transformer_case.py in float32, trained with Adam, as a JAX
# user would write it: jit + NamedSharding (GSPMD) on a data x model mesh of forced host
# devices, Megatron-style (heads and MLP hidden over `model`, batch over `data`).
#   pip install jax==0.10.2 numpy
#   python3 transformer_train_jax.py [STEPS]     -> tokens/s per mesh, median of 5 runs
import os, sys, time, statistics
os.environ.setdefault("XLA_FLAGS", "--xla_force_host_platform_device_count=4")
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "..", "nn", "testdata"))
import gen_transformer_case as ref
jax.config.update("jax_enable_x64", False)
STEPS = int(sys.argv[1]) if len(sys.argv) > 1 else 10
cfg = dict(seed=1, vocab=256, seq=128, dim=256, heads=8, layers=4, ffn=1024, rows=512, batch=16, steps=STEPS)
r = np.random.default_rng(1)
p0 = {k: v.astype(np.float32) for k, v in ref.init(cfg, r).items()}
rows = r.integers(0, cfg["vocab"], (cfg["rows"], cfg["seq"] + 1)).astype(np.int32)

def spec(name):
    if name.endswith(("wq", "wk", "wv", "mlp.w1")): return P(None, "model")
    if name.endswith(("wo", "mlp.w2")): return P("model", None)
    if name.endswith("mlp.b1"): return P("model")
    return P()

def step(p, m, v, t, batch):
    l, g = jax.value_and_grad(lambda p: ref.loss_fn(p, batch, cfg))(p)
    m = {k: 0.9 * m[k] + 0.1 * g[k] for k in p}
    v = {k: 0.999 * v[k] + 0.001 * g[k] ** 2 for k in p}
    p = {k: p[k] - 1e-3 * (m[k] / (1 - 0.9 ** t)) / (jnp.sqrt(v[k] / (1 - 0.999 ** t)) + 1e-8) for k in p}
    return p, m, v, l

print(f"JAX {jax.__version__}: transformer V{cfg['vocab']} T{cfg['seq']} D{cfg['dim']} H{cfg['heads']} L{cfg['layers']} F{cfg['ffn']}, f32, batch {cfg['batch']}, Adam, {STEPS} steps per run, median of 5")
for d, mm in [(1, 1), (2, 1), (1, 2), (2, 2)]:
    if d * mm > len(jax.devices()): continue  # XLA_FLAGS may force fewer host devices (1 for a one-device row)
    mesh = Mesh(np.array(jax.devices()[: d * mm]).reshape(d, mm), ("data", "model"))
    ps = {k: NamedSharding(mesh, spec(k)) for k in p0}
    bs = NamedSharding(mesh, P("data", None))
    f = jax.jit(step, in_shardings=(ps, ps, ps, None, bs), out_shardings=(ps, ps, ps, NamedSharding(mesh, P())), donate_argnums=(0, 1, 2))
    batches = [jax.device_put(rows[[(s * cfg["batch"] + i) % cfg["rows"] for i in range(cfg["batch"])]], bs) for s in range(STEPS)]
    rates = []
    for run in range(6):
        p = {k: jax.device_put(v, ps[k]) for k, v in p0.items()}
        m = {k: jax.device_put(np.zeros_like(v), ps[k]) for k, v in p0.items()}
        v = {k: jax.device_put(np.zeros_like(v), ps[k]) for k, v in p0.items()}
        jax.block_until_ready(p)
        t0 = time.perf_counter()
        for s, b in enumerate(batches):
            p, m, v, l = f(p, m, v, float(s + 1), b)
        jax.block_until_ready(l)
        if run > 0:
            rates.append(STEPS * cfg["batch"] * cfg["seq"] / (time.perf_counter() - t0))
    print(f"  {d}x{mm}  {statistics.median(rates):>11.0f} tokens/s")
