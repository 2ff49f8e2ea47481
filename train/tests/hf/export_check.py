"""Export -> transformers load -> the same model: `meshwork train --model gpt2` on the
oracle checkpoint (2 AdamW steps, f64) with `--export-hf DIR`, then
`GPT2LMHeadModel.from_pretrained(DIR)` in float64. Its mean next-token loss on the
token rows 0..4 must equal, within 1e-9, the first loss meshwork reports when it
trains on from the exported folder (the loss of the exported weights on those rows):
both read the same folder and must compute the same function of it.

    python3 train/tests/hf/export_check.py target/debug/meshwork

Where `transformers` (with torch) is not installed it says so and exits 0: the one
check CI may skip.
"""

import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
DATA = os.path.join(HERE, "..", "..", "testdata", "gpt2")


def main():
    meshwork = sys.argv[1]
    try:
        import numpy as np
        import torch
        from transformers import GPT2LMHeadModel
    except ImportError as e:
        print(f"hf export check: skipped, transformers/torch not installed ({e})")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        out = os.path.join(tmp, "exported")
        common = ["--model", "gpt2", "--data-tokens", os.path.join(DATA, "tokens.npy"),
                  "--seq", "16", "--batch", "4", "--dtype", "f64", "--quiet"]
        subprocess.run([meshwork, "train", *common, "--init", os.path.join(DATA, "model"),
                        "--steps", "2", "--optimizer", "adamw", "--lr", "0.003",
                        "--export-hf", out], check=True)
        losses = os.path.join(tmp, "l.json")
        subprocess.run([meshwork, "train", *common, "--init", out, "--steps", "1",
                        "--optimizer", "sgd", "--lr", "0.1", "--losses-json", losses],
                       check=True)
        ours = json.load(open(losses))[0]
        model = GPT2LMHeadModel.from_pretrained(out, torch_dtype=torch.float64).eval()
        rows = torch.from_numpy(np.load(os.path.join(DATA, "tokens.npy"))[:4].astype("int64"))
        # The mean cross-entropy of inputs row[:16] against targets row[1:17], as
        # meshwork's loss is (transformers' own `labels=` loss would drop a token).
        with torch.no_grad():
            logits = model(rows[:, :16]).logits
            lp = torch.log_softmax(logits, -1)
            theirs = -lp.gather(-1, rows[:, 1:17, None]).mean().item()
    rel = abs(ours - theirs) / abs(theirs)
    print(f"hf export check: meshwork {ours!r}, transformers {theirs!r}, relative {rel:.1e}")
    return 0 if rel <= 1e-9 else 1


if __name__ == "__main__":
    sys.exit(main())
