"""What `transformers` makes of Llama-family `config.json` files that leave fields out
(or set them to null, or count `pad_token_id` from the end), for meshwork's
`Llama::from_config`: each case's input, the sizes and options the config class
resolves, and the parameter names and shapes `AutoModelForCausalLM.from_config`
builds (on PyTorch's meta device: no weights are made).

    pip install torch==2.15.0 transformers==5.24.0
    python3 gen_config_cases.py OUT.json
"""
import json
import sys

import torch
from transformers import AutoConfig, AutoModelForCausalLM

SMALL = {"vocab_size": 96, "hidden_size": 32, "intermediate_size": 40,
         "num_hidden_layers": 2, "num_attention_heads": 4}

CASES = [
    # The class defaults themselves: every size left out.
    ("llama-bare", {"model_type": "llama"}),
    ("mistral-bare", {"model_type": "mistral"}),
    ("qwen2-bare", {"model_type": "qwen2"}),
    ("qwen3-bare", {"model_type": "qwen3"}),
    # Small models leaving out the key/value heads, head_dim, eps, theta and tying.
    ("llama-small", {"model_type": "llama", **SMALL}),
    ("mistral-small", {"model_type": "mistral", **SMALL}),
    ("qwen2-small", {"model_type": "qwen2", **SMALL}),
    ("qwen3-small", {"model_type": "qwen3", **SMALL}),
    # Explicit nulls.
    ("llama-null-kv", {"model_type": "llama", **SMALL, "num_key_value_heads": None,
                       "head_dim": None, "rope_scaling": None}),
    ("mistral-null-window", {"model_type": "mistral", **SMALL, "sliding_window": None,
                             "num_key_value_heads": 2}),
    # A pad token, counted from the start and from the end.
    ("llama-pad", {"model_type": "llama", **SMALL, "pad_token_id": 3}),
    ("qwen2-pad-negative", {"model_type": "qwen2", **SMALL, "pad_token_id": -1,
                            "num_key_value_heads": 2,
                            "tie_word_embeddings": True}),
    # Biases and the other head size.
    ("llama-bias", {"model_type": "llama", **SMALL, "attention_bias": True, "mlp_bias": True,
                    "head_dim": 16, "num_key_value_heads": 1}),
    ("qwen3-bias", {"model_type": "qwen3", **SMALL, "attention_bias": True, "head_dim": 8,
                    "num_key_value_heads": 2}),
    # Sliding windows: on for the layers past max_window_layers, or for none of them.
    ("qwen2-sliding-last", {"model_type": "qwen2", **SMALL, "num_key_value_heads": 2,
                            "use_sliding_window": True, "sliding_window": 64,
                            "max_window_layers": 1}),
    ("qwen2-sliding-none", {"model_type": "qwen2", **SMALL, "num_key_value_heads": 2,
                            "use_sliding_window": True, "sliding_window": 64,
                            "max_window_layers": 2}),
    ("qwen3-sliding-off", {"model_type": "qwen3", **SMALL, "num_key_value_heads": 2,
                           "use_sliding_window": False, "sliding_window": 8}),
    # transformers 4.x's layout: rope_theta and rope_scaling at the top level (its
    # older "type" key too), torch_dtype.
    ("llama-v4-llama3", {"model_type": "llama", **SMALL, "max_position_embeddings": 4096,
                         "rope_theta": 500000.0, "torch_dtype": "bfloat16",
                         "rope_scaling": {"rope_type": "llama3", "factor": 8.0,
                                          "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                          "original_max_position_embeddings": 1024}}),
    ("mistral-v4-linear", {"model_type": "mistral", **SMALL, "num_key_value_heads": 2,
                           "rope_theta": 1000000.0, "rope_scaling": {"type": "linear",
                                                                     "factor": 4.0}}),
]


def resolved(c):
    rope = getattr(c, "rope_parameters", None) or {}
    out = {
        "vocab_size": c.vocab_size,
        "hidden_size": c.hidden_size,
        "intermediate_size": c.intermediate_size,
        "num_hidden_layers": c.num_hidden_layers,
        "num_attention_heads": c.num_attention_heads,
        "num_key_value_heads": c.num_key_value_heads,
        "head_dim": getattr(c, "head_dim", None) or c.hidden_size // c.num_attention_heads,
        "max_position_embeddings": c.max_position_embeddings,
        "rms_norm_eps": c.rms_norm_eps,
        "rope_theta": rope.get("rope_theta"),
        "rope_type": rope.get("rope_type", "default"),
        "rope_parameters": dict(rope),
        "tie_word_embeddings": c.tie_word_embeddings,
        "pad_token_id": c.pad_token_id,
    }
    window = getattr(c, "sliding_window", None)
    types = getattr(c, "layer_types", None)
    if getattr(c, "use_sliding_window", True) is False:
        window = None
    if types is not None and "sliding_attention" not in types:
        window = None
    out["sliding_window"] = window
    return out


def main():
    out = []
    for name, config in CASES:
        c = AutoConfig.for_model(**config)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(c)
        params = [[n, list(p.shape)] for n, p in model.named_parameters()]
        pad = None
        if c.pad_token_id is not None:
            pad = model.model.embed_tokens.padding_idx
        out.append({"name": name, "config": config, "resolved": resolved(c),
                    "padding_idx": pad, "parameters": params})
    json.dump(out, open(sys.argv[1], "w"), indent=0)
    print(len(out), "cases")


if __name__ == "__main__":
    main()
