#!/usr/bin/env python3
"""Reference numerics for tpinfer's Llama, with PyTorch/transformers, on any CUDA host.

  make    --shape 70b|8b|8b-half|1b|qwen2-7b|qwen2-1.5b-yarn|qwen3-8b|mistral-7b --out DIR [--dtype bf16|f32]
                                                       random-weight Llama (or Qwen2, Qwen3, Mistral) checkpoint (HF format)
  logits  --model DIR --dtype f32|bf16 --out FILE      transformers' prefill logits + greedy tokens
          [--fp8 [--fp8-lm-head]]                      with tpinfer's FP8 quantization of the layers' linears
                                                       (and of the LM head: --weights fp8-lm-head)
  compare --ref FILE --out-json FILE NAME=FILE ...     relative errors of tpinfer runs vs a reference
  same    FILE FILE                                    exits 1 unless two tpinfer runs' logits and tokens are the same bits
  speed   --model DIR                                  transformers decode tok/s and 2048-token prefill ms

The prompt is the same fixed pseudo-random ids tpinfer-bench uses: id_i = (7919 i + 13) mod min(vocab, 30000).
"""
import argparse, inspect, json, shutil, sys, time
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

SHAPES = {
    # Llama-3-70B: 80 layers, 8192 wide, 64 heads over 8 KV heads, 28672 FFN, 128256 vocab. Too
    # large to build as a transformers model on one GPU: written tensor by tensor (see make).
    "70b": dict(hidden_size=8192, intermediate_size=28672, num_hidden_layers=80, num_attention_heads=64,
                num_key_value_heads=8, tie_word_embeddings=False),
    # Llama-3-8B: 32 layers, 4096 wide, 32 heads over 8 KV heads, 14336 FFN, 128256 vocab.
    "8b": dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
               num_key_value_heads=8, tie_word_embeddings=False),
    # One rank's share of the 8B shape at TP 2 (half the heads, the FFN and the vocabulary), for
    # a TP 2 step's work on one GPU without its all-reduces.
    "8b-half": dict(hidden_size=4096, intermediate_size=7168, num_hidden_layers=32, num_attention_heads=16,
                    num_key_value_heads=4, head_dim=128, vocab_size=64128, tie_word_embeddings=False),
    # Llama-3.2-1B: 16 layers, 2048 wide, 32 heads over 8 KV heads, 8192 FFN, tied embeddings.
    "1b": dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
               num_key_value_heads=8, tie_word_embeddings=True),
    # Qwen2.5-7B: 28 layers, 3584 wide, 28 heads over 4 KV heads, 18944 FFN, 152064 vocab, biases
    # on Q, K and V (drawn at random here: transformers initializes them to zero).
    "qwen2-7b": dict(family="qwen2", hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
                     num_attention_heads=28, num_key_value_heads=4, vocab_size=152064, tie_word_embeddings=False),
    # Qwen2.5-1.5B (tied embeddings) with YaRN: factor 4 over 8,192 trained positions, the
    # config's max_position_embeddings their product, so that transformers (which takes the
    # factor as max_position_embeddings / original_max_position_embeddings where both are
    # given) and tpinfer (which takes the factor as given) scale alike.
    "qwen2-1.5b-yarn": dict(family="qwen2", hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                            num_attention_heads=12, num_key_value_heads=2, vocab_size=151936,
                            tie_word_embeddings=True, yarn=dict(factor=4.0, original_max_position_embeddings=8192)),
    # Qwen3-8B: 36 layers, 4096 wide, 32 heads over 8 KV heads, 12288 FFN, an RMSNorm over each
    # query and key head (drawn at random here: transformers initializes them to one).
    "qwen3-8b": dict(family="qwen3", hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
                     num_attention_heads=32, num_key_value_heads=8, head_dim=128, vocab_size=151936,
                     tie_word_embeddings=False),
    # Mistral-7B-v0.1: Llama-2-7B's shape with GQA (8 KV heads) and a 4096-position sliding window.
    "mistral-7b": dict(family="mistral", hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
                       num_attention_heads=32, num_key_value_heads=8, vocab_size=32000, tie_word_embeddings=False),
}


def prompt_ids(vocab, n):
    m = min(vocab, 30000)
    return [(i * 7919 + 13) % m for i in range(n)]


def family_config(shape):
    """The transformers config of a SHAPES entry, and its model class."""
    import transformers
    common = dict(vocab_size=128256, max_position_embeddings=131072, rms_norm_eps=1e-5, bos_token_id=128000,
                  eos_token_id=[128001, 128009])
    common.update(SHAPES[shape])
    family = common.pop("family", "llama")
    yarn = common.pop("yarn", None)
    rope = dict(rope_type="llama3", factor=8.0, low_freq_factor=1.0, high_freq_factor=4.0,
                original_max_position_embeddings=8192)
    theta = 500000.0
    if family == "qwen2":
        common.update(max_position_embeddings=32768, rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151645,
                      use_sliding_window=False, sliding_window=32768)
        rope, theta = dict(rope_type="default"), 1000000.0
        if yarn:
            common.update(max_position_embeddings=int(yarn["original_max_position_embeddings"] * yarn["factor"]))
            rope = dict(rope_type="yarn", **yarn)
    elif family == "qwen3":
        common.update(max_position_embeddings=40960, rms_norm_eps=1e-6, bos_token_id=151643, eos_token_id=151645,
                      use_sliding_window=False, sliding_window=None)
        rope, theta = dict(rope_type="default"), 1000000.0
    elif family == "mistral":
        common.update(max_position_embeddings=32768, bos_token_id=1, eos_token_id=2, sliding_window=4096)
        rope, theta = dict(rope_type="default"), 10000.0
    config_class = dict(llama=transformers.LlamaConfig, qwen2=transformers.Qwen2Config,
                        qwen3=transformers.Qwen3Config, mistral=transformers.MistralConfig)[family]
    model_class = dict(llama=transformers.LlamaForCausalLM, qwen2=transformers.Qwen2ForCausalLM,
                       qwen3=transformers.Qwen3ForCausalLM, mistral=transformers.MistralForCausalLM)[family]
    if "rope_parameters" in inspect.signature(config_class.__init__).parameters:  # transformers 5
        cfg = config_class(rope_parameters=dict(rope, rope_theta=theta), **common)
    elif family == "llama" or yarn:
        cfg = config_class(rope_theta=theta, rope_scaling=rope, **common)
    else:
        cfg = config_class(rope_theta=theta, **common)
    return cfg, model_class


def make(args):
    cfg, model_class = family_config(args.shape)
    dtype = dict(bf16=torch.bfloat16, f32=torch.float32)[args.dtype]
    out = Path(args.out)
    if args.shape == "70b":
        params = write_random(cfg, out, dtype, args.seed)
        setattr(cfg, "dtype" if hasattr(cfg, "dtype") else "torch_dtype", dtype)
        cfg.save_pretrained(out)
    else:
        torch.manual_seed(args.seed)
        with torch.device("cuda"):
            model = model_class(cfg).to(dtype)
            # transformers zeroes biases and sets norms to one; random biases are what a check of
            # their sharding needs, and random Q/K norms (Qwen3) tell the query's from the key's.
            for name, p in model.named_parameters():
                if name.endswith(".bias"):
                    p.data.normal_(0.0, 0.5)
                elif name.endswith(("q_norm.weight", "k_norm.weight")):
                    p.data.uniform_(0.5, 1.5)
        model.save_pretrained(out, safe_serialization=True)
        params = sum(p.numel() for p in model.parameters())
    if args.tokenizer:
        for f in ("tokenizer.json", "tokenizer_config.json"):
            shutil.copy(Path(args.tokenizer) / f, out / f)
    print(f"wrote {out} ({params / 1e9:.2f} B params, {args.dtype})")
    print((out / "config.json").read_text())


def write_random(cfg, out, dtype, seed, shard_bytes=5 << 30):
    """transformers' initialization (normal(0, initializer_range) weights, unit norms), drawn on
    the GPU one tensor at a time and written as safetensors shards with their index: a 70B
    checkpoint never exists whole in GPU memory. Returns the parameter count."""
    h, kv = cfg.hidden_size, cfg.num_key_value_heads * (cfg.hidden_size // cfg.num_attention_heads)
    shapes = [("model.embed_tokens.weight", (cfg.vocab_size, h))]
    for i in range(cfg.num_hidden_layers):
        p = f"model.layers.{i}"
        shapes += [(f"{p}.input_layernorm.weight", (h,)), (f"{p}.self_attn.q_proj.weight", (h, h)),
                   (f"{p}.self_attn.k_proj.weight", (kv, h)), (f"{p}.self_attn.v_proj.weight", (kv, h)),
                   (f"{p}.self_attn.o_proj.weight", (h, h)), (f"{p}.post_attention_layernorm.weight", (h,)),
                   (f"{p}.mlp.gate_proj.weight", (cfg.intermediate_size, h)),
                   (f"{p}.mlp.up_proj.weight", (cfg.intermediate_size, h)),
                   (f"{p}.mlp.down_proj.weight", (h, cfg.intermediate_size))]
    shapes += [("model.norm.weight", (h,)), ("lm_head.weight", (cfg.vocab_size, h))]
    out.mkdir(parents=True, exist_ok=True)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    gen = torch.Generator(device=device).manual_seed(seed)
    size = torch.tensor([], dtype=dtype).element_size()
    groups, current, current_bytes = [], [], 0
    for name, shape in shapes:
        n = 1
        for d in shape:
            n *= d
        if current and current_bytes + n * size > shard_bytes:
            groups.append(current); current, current_bytes = [], 0
        current.append((name, shape)); current_bytes += n * size
    groups.append(current)
    weight_map, total, params = {}, 0, 0
    for k, group in enumerate(groups):
        file = f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        tensors = {}
        for name, shape in group:
            if name.endswith("norm.weight"):
                t = torch.ones(shape, dtype=dtype)
            else:
                t = (torch.randn(shape, generator=gen, device=device, dtype=torch.float32)
                     * cfg.initializer_range).to(dtype).cpu()
            tensors[name] = t
            weight_map[name] = file
            total += t.numel() * t.element_size(); params += t.numel()
        save_file(tensors, out / file, metadata={"format": "pt"})
        print(f"  {file}: {len(group)} tensors", flush=True)
    (out / "model.safetensors.index.json").write_text(
        json.dumps(dict(metadata=dict(total_size=total), weight_map=weight_map), indent=1))
    return params


def load(model_dir, dtype):
    from transformers import AutoModelForCausalLM
    dtype = dict(bf16=torch.bfloat16, f32=torch.float32)[dtype]
    # Weights stored in bf16 are upcast exactly, so f32 here is the reference on the same weights.
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, device_map="cuda").eval()


E4M3_MAX = 448.0


def fp8_rows(t, reciprocal):
    """t [rows, k] f32 quantized per row to E4M3 and back: scale = amax / 448 (an all-zero row
    1), q = t / scale rounded to E4M3, returned as q · scale. tpinfer scales its weights by
    amax · f32(1/448) (candle divides by a scalar so) and its activations by amax / 448."""
    amax = t.abs().amax(dim=-1, keepdim=True)
    scale = amax * torch.tensor(1 / E4M3_MAX, dtype=torch.float32) if reciprocal else amax / E4M3_MAX
    scale = torch.where(amax > 0, scale, torch.ones_like(scale))
    return (t / scale).to(torch.float8_e4m3fn).float() * scale


class Fp8Linear(torch.nn.Module):
    """tpinfer's FP8 product on the same weights: the weight quantized per output row and, for
    more than one row, the activations per token (W8A8), dequantized to f32 and multiplied in
    f32."""

    def __init__(self, linear, rows_quantized=True):
        super().__init__()
        self.weight = torch.nn.Parameter(fp8_rows(linear.weight.data.float(), reciprocal=True), requires_grad=False)
        self.bias = linear.bias
        self.rows_quantized = rows_quantized

    def forward(self, x):
        x2 = x.reshape(-1, x.shape[-1]).float()
        # One row (a decode step's) runs W8A16 in tpinfer: its activations stay as they are.
        x2 = fp8_rows(x2, reciprocal=False) if x2.shape[0] > 1 and self.rows_quantized else x2
        y = x2 @ self.weight.T
        if self.bias is not None:
            y = y + self.bias.float()
        return y.reshape(*x.shape[:-1], -1).to(x.dtype)


def to_fp8(model, lm_head=False):
    """Every linear of the decoder layers as tpinfer's --quantize fp8 holds it (not the
    embedding; the LM head with `lm_head`, as --quantize-lm-head: W8A16, since tpinfer scores
    only a prompt's last position, one row)."""
    for layer in model.model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, torch.nn.Linear):
                    setattr(parent, name, Fp8Linear(child))
    if lm_head:
        model.lm_head = Fp8Linear(model.lm_head, rows_quantized=False)
    return model


@torch.no_grad()
def logits(args):
    model = load(args.model, args.dtype)
    if args.fp8:
        model = to_fp8(model, args.fp8_lm_head)
    ids = torch.tensor([prompt_ids(model.config.vocab_size, args.prompt_tokens)], device="cuda")
    if args.perturb:
        # The prompt's embeddings scaled by 1 + ε·N(0, 1): how far the logits move for a
        # perturbation far below any rounding error, i.e. how continuous the model is.
        emb = model.model.embed_tokens(ids)
        g = torch.Generator(device="cuda").manual_seed(1)
        emb = emb * (1 + args.perturb * torch.randn(emb.shape, generator=g, device="cuda", dtype=emb.dtype))
        out = model(inputs_embeds=emb, use_cache=True)
    else:
        out = model(ids, use_cache=True)
    prefill = out.logits[0, -1].float()
    past, tokens, nxt, steps = out.past_key_values, [], prefill.argmax().view(1, 1), []
    for _ in range(args.steps):
        tokens.append(int(nxt))
        out = model(nxt, past_key_values=past, use_cache=True)
        past, nxt = out.past_key_values, out.logits[0, -1].argmax().view(1, 1)
        steps.append(out.logits[0, -1].float().cpu())
    # As tpinfer traces them: the logits of each decode step that produced a returned token.
    decode = torch.stack(steps[: args.steps - 1]) if args.steps > 1 else torch.zeros(0, prefill.numel())
    save_file({"prefill_logits": prefill.cpu().contiguous(), "tokens": torch.tensor(tokens, dtype=torch.int64),
               "decode_logits": decode.contiguous()}, args.out)
    print(f"{args.model} {args.dtype}: tokens {tokens[:8]}...")


def compare(args):
    ref = load_file(args.ref)
    result = {}
    for item in args.runs:
        name, path = item.split("=", 1)
        run = load_file(path)
        a, b = run["prefill_logits"].double(), ref["prefill_logits"].double()
        rel = float((a - b).norm() / b.norm())
        same = 0
        for x, y in zip(run["tokens"].tolist(), ref["tokens"].tolist()):
            if x != y:
                break
            same += 1
        result[name] = dict(rel_error=rel, same_greedy_prefix=same, steps=len(ref["tokens"]))
        print(f"{name}: rel error {rel:.3e}, greedy tokens equal for {same}/{len(ref['tokens'])} steps")
        # The logits of each decode step (tpinfer's come from its captured CUDA graph) are
        # comparable while the greedy tokens agree.
        if "decode_logits" in run and "decode_logits" in ref:
            n = min(same, len(run["decode_logits"]), len(ref["decode_logits"]))
            a, b = run["decode_logits"][:n].double(), ref["decode_logits"][:n].double()
            worst = max((float((x - y).norm() / y.norm()) for x, y in zip(a, b)), default=float("nan"))
            result[name].update(decode_steps_compared=n, decode_worst_rel_error=worst)
            print(f"{name}: decode logits over {n} steps, worst rel error {worst:.3e}")
    Path(args.out_json).write_text(json.dumps(result, indent=1))


def same(args):
    a, b = load_file(args.files[0]), load_file(args.files[1])
    differ = [k for k in sorted(set(a) | set(b))
              if k not in a or k not in b or a[k].shape != b[k].shape or not torch.equal(a[k], b[k])]
    print(f"{args.files[0]} and {args.files[1]}: " + (f"differ in {', '.join(differ)}" if differ else "the same bits"))
    sys.exit(1 if differ else 0)


@torch.no_grad()
def speed(args):
    """Decode tok/s after a --prompt-tokens prompt (128), prefill ms of --prefill-tokens (2048)."""
    model = load(args.model, "bf16")
    vocab = model.config.vocab_size
    ids = torch.tensor([prompt_ids(vocab, args.prompt_tokens)], device="cuda")
    model.generate(ids, max_new_tokens=8, do_sample=False, min_new_tokens=8)
    torch.cuda.synchronize(); t = time.perf_counter()
    model.generate(ids, max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, do_sample=False)
    torch.cuda.synchronize(); decode = args.new_tokens / (time.perf_counter() - t)
    long = torch.tensor([prompt_ids(vocab, args.prefill_tokens)], device="cuda")
    model(long); torch.cuda.synchronize()
    times = []
    for _ in range(3):
        t = time.perf_counter(); model(long); torch.cuda.synchronize(); times.append((time.perf_counter() - t) * 1e3)
    result = dict(decode_tok_s=decode, prefill_ms=sorted(times)[1], prefill_tokens=args.prefill_tokens,
                  peak_gib=torch.cuda.max_memory_allocated() / 2**30)
    print(json.dumps(result))
    if args.out_json:
        Path(args.out_json).write_text(json.dumps(result))


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = p.add_subparsers(dest="cmd", required=True)
    m = sub.add_parser("make"); m.add_argument("--shape", choices=SHAPES, required=True)
    m.add_argument("--out", required=True); m.add_argument("--dtype", default="bf16", choices=["bf16", "f32"])
    m.add_argument("--seed", type=int, default=0); m.add_argument("--tokenizer")
    l = sub.add_parser("logits"); l.add_argument("--model", required=True); l.add_argument("--dtype", required=True)
    l.add_argument("--prompt-tokens", type=int, default=128); l.add_argument("--steps", type=int, default=32)
    l.add_argument("--out", required=True)
    l.add_argument("--fp8", action="store_true", help="tpinfer's W8A8 FP8 products (--weights fp8), in --dtype")
    l.add_argument("--fp8-lm-head", action="store_true", help="with --fp8, the LM head too (--weights fp8-lm-head)")
    l.add_argument("--perturb", type=float, default=0.0, help="scale the prompt's embeddings by 1 + ε·N(0, 1)")
    c = sub.add_parser("compare"); c.add_argument("--ref", required=True); c.add_argument("--out-json", required=True)
    c.add_argument("runs", nargs="+")
    d = sub.add_parser("same"); d.add_argument("files", nargs=2)
    s = sub.add_parser("speed"); s.add_argument("--model", required=True); s.add_argument("--new-tokens", type=int, default=256)
    s.add_argument("--prompt-tokens", type=int, default=128); s.add_argument("--prefill-tokens", type=int, default=2048)
    s.add_argument("--out-json")
    args = p.parse_args()
    dict(make=make, logits=logits, compare=compare, same=same, speed=speed)[args.cmd](args)


if __name__ == "__main__":
    sys.exit(main())
