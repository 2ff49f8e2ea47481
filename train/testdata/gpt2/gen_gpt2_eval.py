"""The oracle of `meshwork eval` on the GPT-2 case: transformers' mean next-token
cross-entropy (float64) over every full row of T + 1 tokens of corpus.txt, encoded
whole by tokenizer.json and cut into consecutive rows (the tail dropped), as
`meshwork train --text` cuts them; and the gradients' global norm of the mean loss
over the first 4 rows at T 16 (every parameter's gradient, as `Trainer` logs
`grad_norm`; dropout off), the first step's `grad_norm` in `--metrics-jsonl`. Writes
eval.json beside it.

    python3 gen_gpt2_eval.py   # transformers 5.x, torch 2.x, tokenizers
"""
import json
import os

import torch
from tokenizers import Tokenizer
from transformers import GPT2LMHeadModel

here = os.path.dirname(os.path.abspath(__file__))
model = GPT2LMHeadModel.from_pretrained(os.path.join(here, "model"), torch_dtype=torch.float64)
model.eval()
tok = Tokenizer.from_file(os.path.join(here, "tokenizer.json"))
ids = tok.encode(open(os.path.join(here, "corpus.txt"), encoding="utf-8").read()).ids
cases = []
for seq in (16, 32):
    n = len(ids) // (seq + 1)
    rows = torch.tensor(ids[: n * (seq + 1)], dtype=torch.long).view(n, seq + 1)
    with torch.no_grad():
        logits = model(rows[:, :seq]).logits
        loss = torch.nn.functional.cross_entropy(
            logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1), reduction="mean"
        )
    cases.append({"seq": seq, "rows": n, "tokens": n * seq, "loss": loss.item()})
seq, batch = 16, 4
rows = torch.tensor(ids[: batch * (seq + 1)], dtype=torch.long).view(batch, seq + 1)
logits = model(rows[:, :seq]).logits
loss = torch.nn.functional.cross_entropy(
    logits.reshape(-1, logits.shape[-1]), rows[:, 1:].reshape(-1), reduction="mean"
)
loss.backward()
norm = torch.nn.utils.clip_grad_norm_(model.parameters(), float("inf")).item()
grad_norm = {"seq": seq, "batch": batch, "loss": loss.item(), "norm": norm}
with open(os.path.join(here, "eval.json"), "w") as f:
    json.dump(
        {"transformers": __import__("transformers").__version__, "cases": cases, "grad_norm": grad_norm},
        f,
        indent=1,
    )
print(cases)
