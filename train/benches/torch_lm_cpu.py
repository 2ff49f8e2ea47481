"""PyTorch's anchor for `llm_cpu_bench`: a language model's fine-tuning step on the CPU.

`transformers`' model of the preset's config — `gpt2`: GPT2LMHeadModel with
GPT2Config() (124M: V50257, 1024 positions, D768, 12 heads, 12 layers, tied
embeddings, biases); `smollm2-135m`: LlamaForCausalLM with SmolLM2-135M's config (V49152,
D576, 30 layers, 9 heads over 3 key/value heads, MLP 1536, RoPE θ 1e5, tied) — f32,
AdamW (lr 1e-4, decay 0.01), next-token loss on random token rows of T + 1, dropout
off (as meshwork trains), `torch.set_num_threads(THREADS)`; eager, or with `compile`
the step under `torch.compile` (inductor).

It serves steps, so that the bench can interleave them with meshwork's (the machine's
speed drifts; steps taken in turns see the same machine): it prints `ready` once the
model is built, then for each line `step` on stdin runs one step and prints its
seconds; it exits at the end of stdin.

    python3 torch_lm_cpu.py PRESET THREADS T B [compile]
"""

import sys
import time

import torch
import transformers


def model_of(preset):
    if preset == "gpt2":
        config = transformers.GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
        return transformers.GPT2LMHeadModel(config), config.vocab_size
    if preset == "smollm2-135m":
        config = transformers.LlamaConfig(
            vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
            num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=8192,
            rms_norm_eps=1e-5, rope_parameters={"rope_type": "default", "rope_theta": 100000.0},
            tie_word_embeddings=True)
        return transformers.LlamaForCausalLM(config), config.vocab_size
    raise SystemExit(f"unknown preset {preset}")


def main() -> None:
    preset = sys.argv[1]
    threads, t, b = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    compiled = sys.argv[5:] == ["compile"]
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model, vocab = model_of(preset)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    rows = torch.randint(0, vocab, (b, t + 1))
    x, y = rows[:, :-1], rows[:, 1:]

    def loss_of(x, y):
        out = model(input_ids=x)
        return torch.nn.functional.cross_entropy(out.logits.reshape(-1, vocab), y.reshape(-1))

    forward = torch.compile(loss_of) if compiled else loss_of
    print("ready", flush=True)
    for line in sys.stdin:
        if line.strip() != "step":
            raise SystemExit(f"unknown request {line!r}")
        start = time.perf_counter()
        loss = forward(x, y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        print(f"{time.perf_counter() - start:.6f}", flush=True)


if __name__ == "__main__":
    main()
