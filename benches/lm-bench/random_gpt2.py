"""A GPT-2-shaped checkpoint with random weights, as `save_pretrained` lays it out (config.json,
model.safetensors, float32), for `lm-bench` on a machine without PyTorch. Weights ~ N(0, 0.02),
norms 1 and 0, like transformers' initialisation; `peer_lm.py --family gpt2 --save DIR` writes the
same shape through transformers itself (other random values).

    python3 benches/lm-bench/random_gpt2.py /tmp/gpt2-small            # GPT-2 small
    python3 benches/lm-bench/random_gpt2.py /tmp/gpt2-tiny --layers 2 --width 64 --heads 4
"""
import argparse
import json
import os
import struct

import numpy as np


def main():
    parser = argparse.ArgumentParser()
    parser.add_argument("out")
    parser.add_argument("--layers", type=int, default=12)
    parser.add_argument("--width", type=int, default=768)
    parser.add_argument("--heads", type=int, default=12)
    parser.add_argument("--vocab", type=int, default=50257)
    parser.add_argument("--positions", type=int, default=1024)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = np.random.default_rng(args.seed)
    d = args.width

    def normal(*shape):
        return rng.normal(0.0, 0.02, size=shape).astype(np.float32)

    tensors = {
        "transformer.wte.weight": normal(args.vocab, d),
        "transformer.wpe.weight": normal(args.positions, d),
        "transformer.ln_f.weight": np.ones(d, np.float32),
        "transformer.ln_f.bias": np.zeros(d, np.float32),
    }
    for i in range(args.layers):
        p = f"transformer.h.{i}."
        tensors.update({
            p + "ln_1.weight": np.ones(d, np.float32),
            p + "ln_1.bias": np.zeros(d, np.float32),
            p + "attn.c_attn.weight": normal(d, 3 * d),
            p + "attn.c_attn.bias": np.zeros(3 * d, np.float32),
            p + "attn.c_proj.weight": normal(d, d),
            p + "attn.c_proj.bias": np.zeros(d, np.float32),
            p + "ln_2.weight": np.ones(d, np.float32),
            p + "ln_2.bias": np.zeros(d, np.float32),
            p + "mlp.c_fc.weight": normal(d, 4 * d),
            p + "mlp.c_fc.bias": np.zeros(4 * d, np.float32),
            p + "mlp.c_proj.weight": normal(4 * d, d),
            p + "mlp.c_proj.bias": np.zeros(d, np.float32),
        })
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, value in tensors.items():
        header[name] = {"dtype": "F32", "shape": list(value.shape),
                        "data_offsets": [offset, offset + value.nbytes]}
        offset += value.nbytes
    encoded = json.dumps(header).encode()
    encoded += b" " * (-len(encoded) % 8)
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(encoded)) + encoded)
        for value in tensors.values():
            f.write(value.tobytes())
    config = {
        "architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "activation_function": "gelu_new",
        "n_embd": d, "n_head": args.heads, "n_layer": args.layers, "n_inner": None,
        "n_positions": args.positions, "vocab_size": args.vocab, "layer_norm_epsilon": 1e-5,
        "bos_token_id": args.vocab - 1, "eos_token_id": args.vocab - 1, "tie_word_embeddings": True,
        "attn_pdrop": 0.0, "embd_pdrop": 0.0, "resid_pdrop": 0.0, "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False,
        "dtype": "float32",
    }
    with open(os.path.join(args.out, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


if __name__ == "__main__":
    main()
