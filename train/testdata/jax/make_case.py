"""Makes the JAX reference case for `meshwork train` (train/tests/it/mlp.rs).

Writes x.npy (features), y.npy (class ids), init.safetensors (w1, b1, w2, b2) and
losses.json: the global loss of every step of SGD (and of momentum and AdamW, PyTorch's
formulas) on the MLP
    h = relu(x @ w1 + b1), z = h @ w2 + b2, loss = mean softmax cross-entropy,
where step s uses rows s*B ... s*B+B-1 (mod the rows), in order — meshwork's rule.
Computed on one device with jax.grad in float64.

    python3 -m venv venv && venv/bin/pip install jax
    venv/bin/python make_case.py        # in train/testdata/jax
"""
import json
import struct

import jax
import jax.numpy as jnp
import numpy as np

jax.config.update("jax_enable_x64", True)

ROWS, FEATURES, HIDDEN, CLASSES = 48, 5, 8, 3
BATCH, STEPS, LR = 16, 12, 0.3

rng = np.random.default_rng(20261122)
x = rng.normal(size=(ROWS, FEATURES))
y = rng.integers(0, CLASSES, size=ROWS).astype(np.int64)
params = {
    "w1": rng.normal(size=(FEATURES, HIDDEN)) / np.sqrt(FEATURES),
    "b1": rng.normal(size=(HIDDEN,)) * 0.1,
    "w2": rng.normal(size=(HIDDEN, CLASSES)) / np.sqrt(HIDDEN),
    "b2": rng.normal(size=(CLASSES,)) * 0.1,
}


def loss_fn(p, xb, yb):
    h = jax.nn.relu(xb @ p["w1"] + p["b1"])
    z = h @ p["w2"] + p["b2"]
    logp = jax.nn.log_softmax(z, axis=-1)
    return -jnp.mean(jnp.sum(jax.nn.one_hot(yb, CLASSES, dtype=jnp.float64) * logp, axis=-1))


grad = jax.jit(jax.value_and_grad(loss_fn))
p = {k: jnp.asarray(v) for k, v in params.items()}
losses = []
for s in range(STEPS):
    rows = [(s * BATCH + i) % ROWS for i in range(BATCH)]
    value, g = grad(p, jnp.asarray(x[rows]), jnp.asarray(y[rows]))
    losses.append(float(value))
    p = {k: p[k] - LR * g[k] for k in p}


def run(update, lr):
    """Every step's loss of `update(p, g, state, t, lr) -> (p, state)` from the same start."""
    p = {k: jnp.asarray(v) for k, v in params.items()}
    state, out = None, []
    for s in range(STEPS):
        rows = [(s * BATCH + i) % ROWS for i in range(BATCH)]
        value, g = grad(p, jnp.asarray(x[rows]), jnp.asarray(y[rows]))
        out.append(float(value))
        p, state = update(p, g, state, s + 1, lr)
    return out


def momentum(p, g, m, t, lr, mu=0.9):
    # PyTorch's SGD with momentum, no dampening: m = mu m + g; p -= lr m.
    m = {k: (mu * m[k] if m else 0.0) + g[k] for k in p}
    return {k: p[k] - lr * m[k] for k in p}, m


def adamw(p, g, state, t, lr, b1=0.9, b2=0.999, eps=1e-8, decay=0.01):
    # PyTorch's AdamW: Adam's bias-corrected update plus lr * decay * p.
    m, v = state or ({k: 0.0 for k in p}, {k: 0.0 for k in p})
    m = {k: b1 * m[k] + (1 - b1) * g[k] for k in p}
    v = {k: b2 * v[k] + (1 - b2) * g[k] ** 2 for k in p}
    step = {
        k: (m[k] / (1 - b1**t)) / (jnp.sqrt(v[k] / (1 - b2**t)) + eps) + decay * p[k] for k in p
    }
    return {k: p[k] - lr * step[k] for k in p}, (m, v)


MOMENTUM_LR, ADAMW_LR = 0.1, 0.01
losses_momentum = run(momentum, MOMENTUM_LR)
losses_adamw = run(adamw, ADAMW_LR)

np.save("x.npy", x)
np.save("y.npy", y)

# safetensors, written by hand: u64 header length, JSON header, then the data.
header, blobs, offset = {}, [], 0
for name in ["w1", "b1", "w2", "b2"]:
    data = np.ascontiguousarray(params[name], dtype="<f8").tobytes()
    header[name] = {"dtype": "F64", "shape": list(params[name].shape), "data_offsets": [offset, offset + len(data)]}
    blobs.append(data)
    offset += len(data)
text = json.dumps(header, separators=(",", ":")).encode()
text += b" " * ((8 - len(text) % 8) % 8)
with open("init.safetensors", "wb") as f:
    f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))

with open("losses.json", "w") as f:
    json.dump(
        {
            "batch": BATCH,
            "steps": STEPS,
            "lr": LR,
            "losses": losses,
            "momentum": {"lr": MOMENTUM_LR, "mu": 0.9, "losses": losses_momentum},
            "adamw": {"lr": ADAMW_LR, "weight_decay": 0.01, "losses": losses_adamw},
        },
        f,
        indent=1,
    )
print("jax", jax.__version__, "losses", losses[0], "...", losses[-1])
