"""The Llama-family oracles (`llama/`, `qwen3/`) again, with one change to `transformers`:
the rotary tables' cos and sin correctly rounded to float32 instead of taken from
Intel MKL's vector library (which PyTorch's CPU `Tensor.cos()` calls, and whose float32
results differ from the correctly rounded ones in about 5% of cases). Everything else
is the oracle's computation, float32 RMSNorm included.

    pip install torch==2.15.0 transformers==5.24.0 numpy
    python3 gen_rope_cr.py CASE_DIR [CASE_DIR ...]

Writes into each CASE_DIR:
  logits_rope_cr.npy   float64 [B, T, V]: the initial model's logits for rows 0..B
  rope_cr.json         {losses_adamw, generate, losses_lora, generate_lora}: as
                       expected.json defines them (the LoRA run from lora_init/ with
                       `peft`, when the case has one)
  lora_final_rope_cr/  the LoRA run's adapter after its steps (adapter_model.safetensors
                       and adapter_config.json, as `save_pretrained` writes them)
"""
import json
import os
import sys

import numpy as np
import torch
import transformers.models.llama.modeling_llama as llama
import transformers.models.mistral.modeling_mistral as mistral
import transformers.models.qwen2.modeling_qwen2 as qwen2
import transformers.models.qwen3.modeling_qwen3 as qwen3
from transformers import AutoModelForCausalLM


def forward(self, x, position_ids):
    freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
    emb = torch.cat((freqs, freqs), dim=-1).double()
    cos = emb.cos().float() * self.attention_scaling
    sin = emb.sin().float() * self.attention_scaling
    return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)


for module in (llama, mistral, qwen2, qwen3):
    for name in dir(module):
        if name.endswith("RotaryEmbedding"):
            getattr(module, name).forward = forward


def main():
    for case in sys.argv[1:]:
        expected = json.load(open(os.path.join(case, "expected.json")))
        c = expected["config"]
        rows = np.load(os.path.join(case, "tokens.npy"))
        n, b, t = len(rows), c["batch"], c["seq"]
        model = AutoModelForCausalLM.from_pretrained(os.path.join(case, "model"), dtype=torch.float64)
        model.eval()
        with torch.no_grad():
            logits = model(input_ids=torch.tensor(rows[:b, :t], dtype=torch.long)).logits
            prompt = torch.tensor(rows[:1, :5], dtype=torch.long)
            gen = model.generate(prompt, max_new_tokens=12, do_sample=False, use_cache=True,
                                 pad_token_id=0, eos_token_id=None)[0].tolist()
        np.save(os.path.join(case, "logits_rope_cr.npy"), logits.numpy())
        model.train()
        opt = torch.optim.AdamW(model.parameters(), lr=c["lr"], betas=(0.9, 0.999), eps=1e-8,
                                weight_decay=c["weight_decay"])
        losses = []
        for s in range(c["steps"]):
            x = torch.tensor(rows[[(s * b + i) % n for i in range(b)]], dtype=torch.long)
            lg = model(input_ids=x[:, :-1]).logits
            loss = torch.nn.functional.cross_entropy(lg.reshape(-1, lg.shape[-1]), x[:, 1:].reshape(-1))
            opt.zero_grad()
            loss.backward()
            opt.step()
            losses.append(loss.item())
        out = {"losses_adamw": losses, "generate": {"prompt_ids": rows[0, :5].tolist(), "ids": gen}}
        if os.path.isdir(os.path.join(case, "lora_init")):
            out.update(lora(case, c, rows, prompt))
        with open(os.path.join(case, "rope_cr.json"), "w") as f:
            json.dump(out, f, indent=1)
        print(case, losses[0], losses[-1], out.get("losses_lora", [None])[-1])


def lora(case, c, rows, prompt):
    """The oracle's LoRA run (gen_llama_case.py): the base frozen, the adapter from
    lora_init/ trained with AdamW over its parameters alone, then greedy decoding."""
    from peft import PeftModel
    n, b = len(rows), c["batch"]
    base = AutoModelForCausalLM.from_pretrained(os.path.join(case, "model"), dtype=torch.float64)
    pm = PeftModel.from_pretrained(base, os.path.join(case, "lora_init"), is_trainable=True)
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
    pm.save_pretrained(os.path.join(case, "lora_final_rope_cr"), safe_serialization=True)
    readme = os.path.join(case, "lora_final_rope_cr", "README.md")
    if os.path.exists(readme):
        os.remove(readme)
    pm.eval()
    with torch.no_grad():
        gen = pm.generate(input_ids=prompt, max_new_tokens=12, do_sample=False, use_cache=True,
                          pad_token_id=0, eos_token_id=None)[0].tolist()
    return {"losses_lora": losses, "generate_lora": {"prompt_ids": rows[0, :5].tolist(), "ids": gen}}


if __name__ == "__main__":
    main()
