"""Export -> transformers load -> the same model, for GPT-2 and the Llama family:
`meshwork train` on an oracle checkpoint (2 AdamW steps, f64) with `--export-hf DIR`,
then `AutoModelForCausalLM.from_pretrained(DIR)` in float64. Its mean next-token loss
on the token rows 0..4 must equal, within 1e-9, the first loss meshwork reports when
it trains on from the exported folder (the loss of the exported weights on those
rows): both read the same folder and must compute the same function of it.

For the Llama family, transformers' rotary tables take float32 cos and sin from Intel
MKL, whose results are not the correctly rounded ones meshwork's are in ~5% of entries
(float32 RMSNorm then carries that to ~1e-7 in the logits): the 1e-9 comparison is made
with transformers' tables correctly rounded (the one change), and the unchanged model
must agree within 1e-6.

The same for a LoRA run (GPT-2, Llama, Qwen 3, from their `lora_init/`): its
`--export-lora DIR` loaded by `peft` (`PeftModel.from_pretrained` over the base) and
its `--export-hf DIR` (the adapter merged) loaded by `transformers` give the loss
meshwork reports when it trains on from the exported adapter, within 1e-9 (Llama's
with correctly rounded tables).

    python3 train/tests/hf/export_check.py target/debug/meshwork

And `meshwork export` of one checkpoint step (GPT-2, Llama; trained from the corpus
text with the case's tokenizer, f64): `AutoTokenizer.from_pretrained(DIR)` encodes a
prompt to the ids meshwork's tokenizer gives, and `AutoModelForCausalLM` gives, at
each new token `meshwork generate --init STEP --logits` picked, the logits meshwork
wrote, within 1e-9 (relative to the largest; Llama's with correctly rounded tables).

Where `transformers` (with torch) is not installed it says so and exits 0, and where
`peft` is not it says it skips the LoRA checks: the checks CI may skip.
"""

import json
import os
import subprocess
import sys
import tempfile

HERE = os.path.dirname(os.path.abspath(__file__))
TESTDATA = os.path.join(HERE, "..", "..", "testdata")


def correctly_rounded_rope(enabled):
    """Patches (or restores) every Llama-family rotary embedding's forward."""
    import torch
    import transformers.models.llama.modeling_llama as llama
    import transformers.models.qwen3.modeling_qwen3 as qwen3
    import transformers.models.qwen2.modeling_qwen2 as qwen2
    import transformers.models.mistral.modeling_mistral as mistral

    def forward(self, x, position_ids):
        freqs = position_ids[..., None].float() * self.inv_freq.to(device=x.device, dtype=torch.float)
        emb = torch.cat((freqs, freqs), dim=-1).double()
        cos = emb.cos().float() * self.attention_scaling
        sin = emb.sin().float() * self.attention_scaling
        return cos.to(dtype=x.dtype), sin.to(dtype=x.dtype)

    for module in (llama, qwen3, qwen2, mistral):
        for name in dir(module):
            if name.endswith("RotaryEmbedding"):
                cls = getattr(module, name)
                if not hasattr(cls, "_meshwork_forward"):
                    cls._meshwork_forward = cls.forward
                cls.forward = forward if enabled else cls._meshwork_forward


def theirs(out, rows):
    import torch
    from transformers import AutoModelForCausalLM
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64).eval()
    # The mean cross-entropy of inputs row[:16] against targets row[1:17], as
    # meshwork's loss is (transformers' own `labels=` loss would drop a token).
    with torch.no_grad():
        logits = model(rows[:, :16]).logits
        lp = torch.log_softmax(logits, -1)
        return -lp.gather(-1, rows[:, 1:17, None]).mean().item()


def check(meshwork, case, tmp):
    import numpy as np
    import torch
    data = os.path.join(TESTDATA, case)
    out = os.path.join(tmp, f"{case}-exported")
    common = ["--data-tokens", os.path.join(data, "tokens.npy"), "--seq", "16", "--batch", "4",
              "--dtype", "f64", "--quiet"]
    subprocess.run([meshwork, "train", *common, "--init", os.path.join(data, "model"),
                    "--steps", "2", "--optimizer", "adamw", "--lr", "0.003",
                    "--export-hf", out], check=True)
    losses = os.path.join(tmp, f"{case}-l.json")
    subprocess.run([meshwork, "train", *common, "--init", out, "--steps", "1",
                    "--optimizer", "sgd", "--lr", "0.1", "--losses-json", losses], check=True)
    ours = json.load(open(losses))[0]
    rows = torch.from_numpy(np.load(os.path.join(data, "tokens.npy"))[:4].astype("int64"))
    ok = True
    for patched, tolerance in ([(False, 1e-9)] if case == "gpt2" else [(True, 1e-9), (False, 1e-6)]):
        correctly_rounded_rope(patched)
        t = theirs(out, rows)
        rel = abs(ours - t) / abs(t)
        what = " (correctly rounded rotary tables)" if patched else ""
        print(f"hf export check, {case}{what}: meshwork {ours!r}, transformers {t!r}, relative {rel:.1e}")
        ok = ok and rel <= tolerance
    correctly_rounded_rope(False)
    return ok


def check_step_export(meshwork, case, tmp):
    import numpy as np
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    data = os.path.join(TESTDATA, case)
    ckpt = os.path.join(tmp, f"{case}-ckpt")
    out = os.path.join(tmp, f"{case}-step-exported")
    subprocess.run([meshwork, "train", "--init", os.path.join(data, "model"),
                    "--text", os.path.join(data, "corpus.txt"),
                    "--tokenizer", os.path.join(data, "tokenizer.json"), "--seq", "16",
                    "--batch", "4", "--dtype", "f64", "--steps", "3", "--optimizer", "adamw",
                    "--lr", "0.003", "--checkpoint-dir", ckpt, "--checkpoint-every", "1",
                    "--quiet"], check=True)
    step = os.path.join(ckpt, "step-00000002")
    subprocess.run([meshwork, "export", step, "--hf", out], check=True, stdout=subprocess.DEVNULL)
    prompt = "The meaning of a mesh"
    logits_file = os.path.join(tmp, f"{case}-logits.npy")
    got = subprocess.run([meshwork, "generate", "--init", step, "--prompt", prompt,
                          "--max-new-tokens", "4", "--dtype", "f64", "--json",
                          "--logits", logits_file], check=True, capture_output=True, text=True)
    got = json.loads(got.stdout)
    ours = np.load(logits_file)
    ids = AutoTokenizer.from_pretrained(out)(prompt).input_ids
    ok = ids == got["prompt_ids"]
    print(f"hf export check, {case} step export: the tokenizer's ids {'equal' if ok else 'differ: ' + str(ids) + ' vs ' + str(got['prompt_ids'])}")
    correctly_rounded_rope(case != "gpt2")
    model = AutoModelForCausalLM.from_pretrained(out, dtype=torch.float64).eval()
    with torch.no_grad():
        n = len(got["prompt_ids"])
        every = model(torch.tensor([got["ids"][:-1]])).logits[0].numpy()
    correctly_rounded_rope(False)
    theirs = every[n - 1 : n - 1 + len(ours)]
    rel = float(np.abs(ours - theirs).max() / np.abs(theirs).max())
    print(f"hf export check, {case} step export: logits of {len(ours)} new tokens, relative {rel:.1e}")
    return ok and ours.shape == theirs.shape and rel <= 1e-9


def peft_loss(base_dir, adapter_dir, rows):
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM
    base = AutoModelForCausalLM.from_pretrained(base_dir, dtype=torch.float64)
    model = PeftModel.from_pretrained(base, adapter_dir).eval()
    with torch.no_grad():
        logits = model(rows[:, :16]).logits
        lp = torch.log_softmax(logits, -1)
        return -lp.gather(-1, rows[:, 1:17, None]).mean().item()


def check_lora(meshwork, case, tmp):
    import numpy as np
    import torch
    data = os.path.join(TESTDATA, case)
    adapter = os.path.join(tmp, f"{case}-adapter")
    merged = os.path.join(tmp, f"{case}-merged")
    common = ["--data-tokens", os.path.join(data, "tokens.npy"), "--seq", "16", "--batch", "4",
              "--dtype", "f64", "--quiet", "--init", os.path.join(data, "model")]
    subprocess.run([meshwork, "train", *common, "--lora-init", os.path.join(data, "lora_init"),
                    "--steps", "2", "--optimizer", "adamw", "--lr", "0.003",
                    "--export-lora", adapter, "--export-hf", merged], check=True)
    losses = os.path.join(tmp, f"{case}-lora-l.json")
    subprocess.run([meshwork, "train", *common, "--lora-init", adapter, "--steps", "1",
                    "--optimizer", "sgd", "--lr", "0.1", "--losses-json", losses], check=True)
    ours = json.load(open(losses))[0]
    rows = torch.from_numpy(np.load(os.path.join(data, "tokens.npy"))[:4].astype("int64"))
    ok = True
    correctly_rounded_rope(case != "gpt2")
    for what, t in (("peft", peft_loss(os.path.join(data, "model"), adapter, rows)),
                    ("merged", theirs(merged, rows))):
        rel = abs(ours - t) / abs(t)
        print(f"hf export check, {case} LoRA ({what}): meshwork {ours!r}, theirs {t!r}, relative {rel:.1e}")
        ok = ok and rel <= 1e-9
    correctly_rounded_rope(False)
    return ok


def main():
    meshwork = os.path.abspath(sys.argv[1])
    try:
        import numpy  # noqa: F401
        import torch  # noqa: F401
        import transformers  # noqa: F401
    except ImportError as e:
        print(f"hf export check: skipped, transformers/torch not installed ({e})")
        return 0
    with tempfile.TemporaryDirectory() as tmp:
        # A fine-tune saves its checkpoint in the working directory by default.
        os.chdir(tmp)
        cases = ("gpt2", "llama", "qwen3", "qwen2", "mistral", "llama-bias")
        results = [check(meshwork, case, tmp) for case in cases]
        results += [check_step_export(meshwork, case, tmp) for case in ("gpt2", "llama")]
        try:
            import peft  # noqa: F401
        except ImportError as e:
            print(f"hf export check: the LoRA checks skipped, peft not installed ({e})")
        else:
            results += [check_lora(meshwork, case, tmp) for case in ("gpt2", "llama", "qwen3")]
    return 0 if all(results) else 1


if __name__ == "__main__":
    sys.exit(main())
