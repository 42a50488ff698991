"""Padded generation in transformers with flashtile's attention against SDPA's, timed in one run.

A small random-weight Llama (no download), a left-padded batch of prompts of different lengths,
greedy ``generate`` of new tokens with the KV cache; the two attention implementations alternate,
and each figure is the median of the repeats. Both must produce the same tokens. On a CPU this
measures the CPU path (PyTorch's fused CPU attention per sequence, ``flashtile.cpu``); on a GPU,
the kernels.

    PYTHONPATH=src python3 benchmarks/transformers_generate.py [--repeats 5] [--new-tokens 32]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import transformers

from flashtile.integrations.transformers import register


def _model(implementation: str, device: str):
    torch.manual_seed(0)
    config = transformers.LlamaConfig(hidden_size=256, intermediate_size=512, num_hidden_layers=4,
                                      num_attention_heads=8, num_key_value_heads=2, vocab_size=1000)
    return transformers.AutoModelForCausalLM.from_config(config, attn_implementation=implementation).to(device).eval()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-lengths", default="96,64,40,128", help="one prompt per length, left-padded")
    args = parser.parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    name = register()
    models = {"sdpa": _model("sdpa", device), name: _model(name, device)}
    models[name].load_state_dict(models["sdpa"].state_dict())
    lengths = [int(n) for n in args.prompt_lengths.split(",")]
    longest = max(lengths)
    generator = torch.Generator().manual_seed(1)
    input_ids = torch.randint(0, 1000, (len(lengths), longest), generator=generator).to(device)
    attention_mask = torch.zeros_like(input_ids)
    for row, length in enumerate(lengths):
        attention_mask[row, longest - length:] = 1  # left padding
    times = {key: [] for key in models}
    tokens = {}
    for _ in range(args.repeats + 1):  # the first round warms up and is not counted
        for key, model in models.items():
            start = time.perf_counter()
            with torch.no_grad():
                tokens[key] = model.generate(input_ids, attention_mask=attention_mask, max_new_tokens=args.new_tokens,
                                             min_new_tokens=args.new_tokens, do_sample=False, pad_token_id=0)
            if device == "cuda":
                torch.cuda.synchronize()
            times[key].append(time.perf_counter() - start)
    same = torch.equal(tokens["sdpa"], tokens[name])
    print(f"{device}, torch {torch.__version__}, transformers {transformers.__version__}; batch {len(lengths)} "
          f"(prompts {args.prompt_lengths}, left-padded), {args.new_tokens} new tokens, median of {args.repeats}")
    for key, values in times.items():
        values = values[1:]
        print(f"  {key:>15}: {statistics.median(values) * 1e3:8.1f} ms  (min {min(values) * 1e3:.1f}, "
              f"max {max(values) * 1e3:.1f})")
    ratio = statistics.median(times["sdpa"][1:]) / statistics.median(times[name][1:])
    print(f"  flashtile / SDPA speed: {ratio:.2f}x; same tokens: {same}")
    return 0 if same else 1


if __name__ == "__main__":
    raise SystemExit(main())
