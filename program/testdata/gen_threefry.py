"""Writes threefry.json, the oracle of program/tests/it/random.rs, with JAX (0.10.2):

    python gen_threefry.py > a.json; python gen_threefry.py x64 > b.json
    (then the cases of b.json appended to a.json's)

`kat`: threefry_2x32 of a key and counter pair (Random123's known answers first);
`cases`: a key from PRNGKey(seed) folded with fold_in by each of `folds`, and the
float32 uniform of `shape` under it (values and their bits) and bernoulli(keep).
The x64 run makes a key of a seed above 2^32.
"""
import json, sys
import jax, numpy as np
x64 = len(sys.argv) > 1
if x64:
    jax.config.update("jax_enable_x64", True)
import jax.numpy as jnp
from jax._src.random import threefry2x32 as tf
assert jax.config.jax_threefry_partitionable
out = {"kat": [], "cases": []}
if not x64:
    for k, c in [((0,0),(0,0)), ((0xffffffff,)*2,(0xffffffff,)*2), ((0x13198a2e,0x03707344),(0x243f6a88,0x85a308d3)), ((7, 0x9e3779b9), (0, 123456789))]:
        r = tf.threefry_2x32(np.uint32(k), np.uint32(c))
        out["kat"].append({"key": list(k), "counter": list(c), "out": [int(x) for x in r]})
cases = [(7, [3, 1, 2], (3, 5), 0.9), (0, [0, 0, 0], (4, 6), 0.5), (12345, [41, 7, 119], (2, 3, 33), 0.95), (1, [2**31 + 5, 3, 0], (1, 257), 0.1)]
if x64:
    cases = [(2**40 + 17, [5, 2, 1], (3, 4), 0.8)]
for seed, folds, shape, keep in cases:
    key = jax.random.PRNGKey(seed)
    for f in folds:
        key = jax.random.fold_in(key, f)
    u = np.asarray(jax.random.uniform(key, shape, dtype=jnp.float32))
    m = np.asarray(jax.random.bernoulli(key, jnp.float32(keep), shape))
    assert (m == (u < np.float32(keep))).all()
    out["cases"].append({"seed": seed, "folds": folds, "key": [int(x) for x in np.asarray(key)], "shape": list(shape), "keep": keep,
        "uniform": [float(x) for x in u.ravel()], "uniform_bits": [int(x) for x in u.view(np.uint32).ravel()], "mask": [bool(x) for x in m.ravel()]})
json.dump(out, sys.stdout)
