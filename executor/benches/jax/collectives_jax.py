# JAX side of the collectives comparison: psum, all_gather and psum_scatter over 8 forced
# host devices (shard_map), 8 and 64 MiB f32 per device, median of 5.
#   pip install jax==0.10.2 numpy;  python3 collectives_jax.py
# With --serve it reads lines "OP MIB" from stdin (OP one of psum, all_gather,
# psum_scatter) and answers each with the milliseconds of one call (compiled and warmed
# the first time it is asked for), so `collectives_bench` can interleave JAX's calls
# with its own in one run.
import os, sys, time, statistics
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import warnings
warnings.filterwarnings("ignore")
import numpy as np, jax, jax.numpy as jnp
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P
from jax.experimental.shard_map import shard_map
mesh = Mesh(np.array(jax.devices()), ("r",))
BODIES = {"psum": lambda a: jax.lax.psum(a, "r"),
          "all_gather": lambda a: jax.lax.all_gather(a, "r", tiled=True),
          "psum_scatter": lambda a: jax.lax.psum_scatter(a, "r", tiled=True)}
inputs, compiled = {}, {}

def case(name, mib):
    if mib not in inputs:
        n = mib * 1024 * 1024 // 4
        inputs[mib] = jax.device_put(np.ones((8 * n,), np.float32), NamedSharding(mesh, P("r")))
    if (name, mib) not in compiled:
        f = jax.jit(shard_map(BODIES[name], mesh=mesh, in_specs=P("r"), out_specs=P("r")))
        jax.block_until_ready(f(inputs[mib]))
        compiled[(name, mib)] = f
    return compiled[(name, mib)], inputs[mib]

def once(name, mib):
    f, x = case(name, mib)
    t = time.perf_counter(); jax.block_until_ready(f(x)); return time.perf_counter() - t

if "--serve" in sys.argv:
    print("ready", flush=True)
    for line in sys.stdin:
        name, mib = line.split()
        print(f"{1e3 * once(name, int(mib)):.4f}", flush=True)
else:
    for mib in (8, 64):
        for name in ("psum", "all_gather", "psum_scatter"):
            ts = [once(name, mib) for _ in range(5)]
            print(f"JAX 8 x {mib} MiB {name}: {1e3*statistics.median(ts):.1f} ms")
        inputs.pop(mib)
