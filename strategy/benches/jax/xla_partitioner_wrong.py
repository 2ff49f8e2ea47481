"""Reproduces with JAX the cases XLA's SPMD partitioner gets wrong.

`strategy/testdata/xla_partitioner_wrong.jsonl` lists the oracle cases that come out
wrong when meshwork hands the global program to XLA's partitioner with the inputs'
shardings: 16 `conv2d` cases give wrong outputs or gradients, and one `take` + `add`
fails XLA's HLO verifier after partitioning. For each, this script runs the same
function (`jax.vjp` of it, as the oracle was made) under `jax.jit` with the same
`NamedSharding`s on as many forced host devices: JAX gets the same wrong value, or the
same verifier error, with GSPMD and with Shardy — the bugs are XLA's partitioner's,
not meshwork's lowering.

    python3 strategy/benches/jax/xla_partitioner_wrong.py
"""
import json
import os
import re
import sys

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P  # noqa: E402

jax.config.update("jax_enable_x64", True)
root = os.path.join(os.path.dirname(__file__), "..", "..", "..")
cases = {}
with open(os.path.join(root, "program", "testdata", "cases.jsonl")) as f:
    for line in f:
        c = json.loads(line)
        cases[c["id"]] = c

reproduced = 0
entries = [json.loads(l) for l in open(os.path.join(root, "strategy", "testdata", "xla_partitioner_wrong.jsonl"))]
for shardy in (False, True):
    jax.config.update("jax_use_shardy_partitioner", shardy)
    for e in entries:
        c = cases[e["id"]]
        ops = [o["op"] for o in c["ops"]]
        ins = [np.array(i["data"]).reshape(i["shape"]) for i in c["inputs"]]
        cots = [np.array(i["data"]).reshape(i["shape"]) for i in c["cotangents"] if i is not None]
        if ops == ["conv2d"]:
            op = c["ops"][0]

            def f(x, w, ct):
                conv = lambda x, w: lax.conv_general_dilated(
                    x, w, tuple(op["strides"]), op["padding"], dimension_numbers=("NHWC", "HWIO", "NHWC"))
                o, vjp = jax.vjp(conv, x, w)
                return (o,) + vjp(ct)
        else:
            assert ops == ["take", "add"], ops

            def f(embed, pos, tok, ct):
                g = lambda e, p: jnp.take(e, tok, axis=0, mode="clip") + p
                o, vjp = jax.vjp(g, embed, pos)
                return (o,) + vjp(ct)
        names = [a for a, _ in e["mesh"]]
        shape = [n for _, n in e["mesh"]]
        size = int(np.prod(shape))
        mesh = Mesh(np.array(jax.devices()[:size]).reshape(shape), tuple(names))
        spec = lambda s: NamedSharding(mesh, eval(s, {"P": P, "None": None}))
        feed = ins + cots
        want = f(*feed)
        g = jax.jit(f, in_shardings=[spec(s) for s in e["inputs"]],
                    out_shardings=tuple(spec(s) for s in e["outputs"]))
        label = f"{'shardy' if shardy else 'gspmd '} {e['id']}"
        if "hlo verifier" in e["error"]:
            try:
                g(*[jax.device_put(a, spec(s)) for a, s in zip(feed, e["inputs"])])
                print(f"{label}: JAX compiled it -> DIFFERENT")
            except Exception as err:  # XLA's compile error, as meshwork got it
                same = "hlo verifier" in str(err)
                reproduced += same
                print(f"{label}: JAX: {str(err).splitlines()[0][:90]} -> "
                      f"{'same error' if same else 'DIFFERENT'}")
            continue
        got = g(*[jax.device_put(a, spec(s)) for a, s in zip(feed, e["inputs"])])
        k, ours = re.match(r"result (\d+) .*element 0: (\S+) vs", e["error"]).groups()
        jax_value = float(np.array(got[int(k)]).ravel()[0])
        same = abs(jax_value - float(ours)) <= 1e-9 * (1 + abs(float(ours)))
        wrong = float(np.max(np.abs(np.array(got[int(k)]) - np.array(want[int(k)]))))
        reproduced += same and wrong > 1e-6
        print(f"{label} result {k}: JAX {jax_value:.12g}, meshwork+XLA {float(ours):.12g}, "
              f"one device {float(np.array(want[int(k)]).ravel()[0]):.12g}"
              f" -> {'same wrong value' if same and wrong > 1e-6 else 'DIFFERENT'}")
print(f"{reproduced} of {2 * len(entries)} reproduced by JAX")
sys.exit(0 if reproduced == 2 * len(entries) else 1)
