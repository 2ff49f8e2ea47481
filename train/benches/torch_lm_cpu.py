"""PyTorch's anchor for `lm_cpu_bench`: a language model's fine-tuning step on the CPU.

`transformers`' model of the preset's config — `gpt2`: GPT2LMHeadModel with
GPT2Config() (124M: V50257, 1024 positions, D768, 12 heads, 12 layers, tied
embeddings, biases); `smollm2-135m`: LlamaForCausalLM with SmolLM2-135M's config (V49152,
D576, 30 layers, 9 heads over 3 key/value heads, MLP 1536, RoPE θ 1e5, tied) — f32,
AdamW (lr 1e-4, decay 0.01), next-token loss on random token rows of T + 1, eager
mode, dropout off (as meshwork trains), `torch.set_num_threads(THREADS)`. Prints one
line per batch size: `torch B T tokens_per_s` (the median of STEPS timed steps after 2
untimed ones).

    python3 torch_lm_cpu.py PRESET THREADS T STEPS B [B ...]
"""

import statistics
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
    threads, t, steps = int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4])
    batches = [int(b) for b in sys.argv[5:]]
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    model, vocab = model_of(preset)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    for b in batches:
        rows = torch.randint(0, vocab, (b, t + 1))
        x, y = rows[:, :-1], rows[:, 1:]
        times = []
        for k in range(steps + 2):
            start = time.perf_counter()
            out = model(input_ids=x)
            loss = torch.nn.functional.cross_entropy(out.logits.reshape(-1, vocab), y.reshape(-1))
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if k >= 2:
                times.append(time.perf_counter() - start)
        print(f"torch {b} {t} {b * t / statistics.median(times):.1f}", flush=True)


if __name__ == "__main__":
    main()
