"""Writes the committed workloads (fixed seeds; greedy, no stop ids, so every system makes the
same number of tokens). Ids lie below 49 152, inside GPT-2's and SmolLM2's vocabularies.

    python3 benches/lm-bench/workloads/make.py benches/lm-bench/workloads
"""
import json
import random
import sys

VOCAB = 49152


def mixed(rng):
    """(a) 32 requests: prompts of 16-512 ids, limits of 16-256 new tokens."""
    return [{"id": f"a{i}", "ids": [rng.randrange(VOCAB) for _ in range(rng.randint(16, 512))],
             "max_new_tokens": rng.randint(16, 256)} for i in range(32)]


def shared_prefix(rng):
    """(b) 32 requests: one 512-id prefix, then own prompts of 16-128 ids; limits of 16-256
    (the longest, 512 + 128 + 256, fits GPT-2's 1 024 positions)."""
    prefix = [rng.randrange(VOCAB) for _ in range(512)]
    return [{"id": f"b{i}", "ids": prefix + [rng.randrange(VOCAB) for _ in range(rng.randint(16, 128))],
             "max_new_tokens": rng.randint(16, 256)} for i in range(32)]


def main():
    out = sys.argv[1]
    for name, make, seed in [("a-mixed.jsonl", mixed, 57), ("b-shared-prefix.jsonl", shared_prefix, 58)]:
        with open(f"{out}/{name}", "w") as f:
            for line in make(random.Random(seed)):
                f.write(json.dumps(line, separators=(",", ":")) + "\n")


if __name__ == "__main__":
    main()
