"""GPT-2's LoRA run with `peft`, beside the GPT-2 oracle (`gen_gpt2_case.py`): the
adapter over `c_attn` and the MLP's `c_proj` (GPT-2's `Conv1D` layers, which `peft`
wraps with `fan_in_fan_out`), r 4, alpha 8, rsLoRA off, dropout 0.

    pip install torch==2.15.0 transformers==5.24.0 peft==0.21.2 numpy
    python3 gen_gpt2_lora.py GPT2_CASE_DIR

Reads model/, tokens.npy and expected.json's config; writes into GPT2_CASE_DIR:
  lora_init/    the adapter the run starts from (peft's init with seed 7, then every
                lora_B set to 0.02 n so the adapter is not a no-op), as save_pretrained
                writes it
  lora_final/   the adapter after the run's steps
  lora.json     {losses_lora, generate_lora}: the mean next-token cross-entropy of each
                step before its update (rows as expected.json's losses_adamw; AdamW with
                its settings over the adapter's parameters alone, the base frozen), and
                greedy decoding of 12 new tokens from rows[0, :5] with lora_final
"""
import json
import os
import sys

import numpy as np
import torch
from peft import LoraConfig, get_peft_model
from transformers import AutoModelForCausalLM


def main():
    case = sys.argv[1]
    c = json.load(open(os.path.join(case, "expected.json")))["config"]
    rows = np.load(os.path.join(case, "tokens.npy"))
    n, b = len(rows), c["batch"]
    torch.manual_seed(7)
    base = AutoModelForCausalLM.from_pretrained(os.path.join(case, "model"), dtype=torch.float64)
    cfg = LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, bias="none", fan_in_fan_out=True,
                     target_modules=["c_attn", "mlp.c_proj"], task_type="CAUSAL_LM")
    pm = get_peft_model(base, cfg)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.copy_(0.02 * torch.randn(p.shape, dtype=p.dtype))
    pm.save_pretrained(os.path.join(case, "lora_init"), safe_serialization=True)
    pm.train()
    params = [p for p in pm.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=c["lr"], betas=(0.9, 0.999), eps=1e-8,
                            weight_decay=c["weight_decay"])
    losses = []
    for s in range(c["steps"]):
        x = torch.tensor(rows[[(s * b + i) % n for i in range(b)]], dtype=torch.long)
        lg = pm(input_ids=x[:, :-1]).logits
        loss = torch.nn.functional.cross_entropy(lg.reshape(-1, lg.shape[-1]), x[:, 1:].reshape(-1))
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    pm.save_pretrained(os.path.join(case, "lora_final"), safe_serialization=True)
    for d in ("lora_init", "lora_final"):
        readme = os.path.join(case, d, "README.md")
        if os.path.exists(readme):
            os.remove(readme)
    pm.eval()
    prompt = torch.tensor(rows[:1, :5], dtype=torch.long)
    with torch.no_grad():
        gen = pm.generate(input_ids=prompt, max_new_tokens=12, do_sample=False, use_cache=True,
                          pad_token_id=0, eos_token_id=None)[0].tolist()
    with open(os.path.join(case, "lora.json"), "w") as f:
        json.dump({"losses_lora": losses,
                   "generate_lora": {"prompt_ids": rows[0, :5].tolist(), "ids": gen}}, f, indent=1)
    print(case, losses[0], losses[-1])


if __name__ == "__main__":
    main()
