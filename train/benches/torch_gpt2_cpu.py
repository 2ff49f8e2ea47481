"""PyTorch's anchor for `gpt2_cpu_bench`: a GPT-2-small fine-tuning step on the CPU.

`transformers`' GPT2LMHeadModel with GPT2Config() (124M: V50257, 1024 positions,
D768, 12 heads, 12 layers, tied embeddings, biases), f32, AdamW (lr 1e-4, decay
0.01), next-token loss on random token rows of T + 1, eager mode, dropout off (as
meshwork trains), `torch.set_num_threads(THREADS)`. Prints one line per batch size:
`torch B T tokens_per_s` (the median of STEPS timed steps after 2 untimed ones).

    python3 torch_gpt2_cpu.py THREADS T STEPS B [B ...]
"""

import statistics
import sys
import time

import torch
from transformers import GPT2Config, GPT2LMHeadModel


def main() -> None:
    threads, t, steps = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
    batches = [int(b) for b in sys.argv[4:]]
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    config = GPT2Config(resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    model = GPT2LMHeadModel(config)
    model.train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.01)
    for b in batches:
        rows = torch.randint(0, config.vocab_size, (b, t + 1))
        x, y = rows[:, :-1], rows[:, 1:]
        times = []
        for k in range(steps + 2):
            start = time.perf_counter()
            out = model(input_ids=x)
            loss = torch.nn.functional.cross_entropy(
                out.logits.reshape(-1, config.vocab_size), y.reshape(-1)
            )
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            if k >= 2:
                times.append(time.perf_counter() - start)
        print(f"torch {b} {t} {b * t / statistics.median(times):.1f}", flush=True)


if __name__ == "__main__":
    main()
