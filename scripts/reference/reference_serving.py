"""The serving benchmark's baseline (issue #33): transformers' plain batched `generate` on the
same checkpoint, `--batch` prompts of `--prompt-tokens` random token ids at once, greedy,
exactly `--output-tokens` new tokens each. Output tokens per second over the generate call,
after a warm-up; the checkpoint's dtype (bf16 for reference_llama.py's `make`).

python reference_serving.py --model DIR --batch 1,32,64
"""
import argparse
import time

import torch
from transformers import AutoModelForCausalLM


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--model", required=True)
    p.add_argument("--batch", default="1,32,64")
    p.add_argument("--prompt-tokens", type=int, default=512)
    p.add_argument("--output-tokens", type=int, default=256)
    p.add_argument("--vocab", type=int, default=128000)
    args = p.parse_args()
    model = AutoModelForCausalLM.from_pretrained(args.model, dtype=torch.bfloat16).cuda().eval()
    g = torch.Generator().manual_seed(0)
    print("| transformers generate, batch | output tok/s | s |")
    print("|---:|---:|---:|")
    for b in [int(x) for x in args.batch.split(",")]:
        ids = torch.randint(1, args.vocab, (b, args.prompt_tokens), generator=g).cuda()
        mask = torch.ones_like(ids)
        kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
        with torch.inference_mode():
            model.generate(ids[:, :16], attention_mask=mask[:, :16], max_new_tokens=4, min_new_tokens=4, **kw)
            torch.cuda.synchronize()
            start = time.perf_counter()
            out = model.generate(ids, attention_mask=mask, max_new_tokens=args.output_tokens,
                                 min_new_tokens=args.output_tokens, **kw)
            torch.cuda.synchronize()
            seconds = time.perf_counter() - start
        new = (out.shape[1] - ids.shape[1]) * b
        print(f"| {b} | {new / seconds:.1f} | {seconds:.2f} |", flush=True)


if __name__ == "__main__":
    main()
