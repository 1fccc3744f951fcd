#!/usr/bin/env python3
"""S2V's audio modules, run by the wan22 wheel's own classes on random weights (issue #35):
the CausalAudioEncoder of one clip's wav2vec2 features, and one audio injection after a DiT
block (WanModel_S2V.after_transformer_block: AdaIN of the video tokens by the global audio
embedding, then each latent frame's tokens cross-attending its audio tokens), written as
tests/fixtures/s2v-audio/{model,reference}.safetensors. Runs on the CPU: the wheel's CUDA
flash attention is replaced by PyTorch's SDPA, which computes the same softmax attention.

  python scripts/reference/reference_s2v_audio.py --wan22 DIR --out tests/fixtures/s2v-audio
  (DIR: the unpacked wan22 2.2.11 wheel, which holds wan/modules/s2v/)
"""
import argparse
import os

import torch
from einops import rearrange
from safetensors.torch import save_file
from wan22_modules import import_wan22

# Tiny: 64 wide, 4 heads of 16; wav2vec2's 25 states of 32; 4 audio tokens a frame; S2V's
# 73 motion frames (19 latent) before an 80-frame clip (20 latent); 2 x 3 patches a frame.
DIM, HEADS, AUDIO_DIM, TOKENS, LAYERS = 64, 4, 32, 4, 25
MOTION, LAT_MOTION, CLIP, HW = 73, 19, 80, 6
INJECTORS = 2


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--wan22", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=7)
    args = p.parse_args()
    audio_utils = import_wan22(args.wan22, "modules.s2v.audio_utils")
    from diffusers.models.attention import AdaLayerNorm

    torch.manual_seed(args.seed)
    encoder = audio_utils.CausalAudioEncoder(dim=AUDIO_DIM, out_dim=DIM, num_token=TOKENS, need_global=True)
    injectors = torch.nn.ModuleList(
        [audio_utils.AudioCrossAttention(dim=DIM, num_heads=HEADS, qk_norm=True) for _ in range(INJECTORS)])
    adain = torch.nn.ModuleList(
        [AdaLayerNorm(output_dim=DIM * 2, embedding_dim=DIM, chunk_dim=1) for _ in range(INJECTORS)])
    modules = {"casual_audio_encoder": encoder, "audio_injector.injector": injectors,
               "audio_injector.injector_adain_layers": adain}
    weights = {}
    with torch.no_grad():
        for prefix, module in modules.items():
            for name, p in module.named_parameters():
                # Away from S2V's zero init, so that every weight shows in the output.
                if "norm" in name:
                    p.copy_(1.0 + 0.1 * torch.randn_like(p))
                elif p.dim() == 1 or name.endswith("padding_tokens") or name == "weights":
                    p.copy_(0.5 * torch.randn_like(p))
                else:
                    p.copy_(torch.randn_like(p) / p[0].numel() ** 0.5)
                weights[f"{prefix}.{name}"] = p.detach().clone().contiguous()

        # One clip of wav2vec2 features, [1, layers, audio dim, frames], as S2V's encode_audio
        # slices them, and the motion frames' copies of its first frame before it.
        audio_input = torch.randn(1, LAYERS, AUDIO_DIM, CLIP)
        padded = torch.cat([audio_input[..., 0:1].repeat(1, 1, 1, MOTION), audio_input], dim=-1)
        audio_emb_global, audio_emb = encoder(padded)
        audio_emb_global = audio_emb_global[:, LAT_MOTION:]
        merged = audio_emb[:, LAT_MOTION:]
        frames = merged.shape[1]
        # The residual stream after a block: the clip's video tokens, then 10 reference and
        # motion tokens, which the injection leaves alone.
        video = frames * HW
        hidden = torch.randn(1, video + 10, DIM)
        reference = {"audio_input": audio_input[0].permute(2, 0, 1).contiguous(),  # [frames, layers, dim]
                     "audio_global": audio_emb_global[0, :, 0].contiguous(),    # [latent frames, dim]
                     "audio_local": merged[0].contiguous(),                     # [latent frames, tokens + 1, dim]
                     "hidden": hidden[0].clone()}
        for i in range(INJECTORS):
            # WanModel_S2V.after_transformer_block, adain_mode "attn_norm".
            x = rearrange(hidden[:, :video].clone(), "b (t n) c -> (b t) n c", t=frames)
            g = rearrange(audio_emb_global, "b t n c -> (b t) n c")
            x = adain[i](x, temb=g[:, 0])
            context = rearrange(merged, "b t n c -> (b t) n c")
            out = injectors[i](x=x, context=context,
                               context_lens=torch.ones(x.shape[0], dtype=torch.long) * context.shape[1])
            out = rearrange(out, "(b t) n c -> b (t n) c", t=frames)
            injected = hidden.clone()
            injected[:, :video] = injected[:, :video] + out
            reference[f"injected_{i}"] = injected[0].contiguous()
    os.makedirs(args.out, exist_ok=True)
    save_file(weights, os.path.join(args.out, "model.safetensors"))
    save_file(reference, os.path.join(args.out, "reference.safetensors"))
    print({k: list(v.shape) for k, v in {**weights, **reference}.items()})


if __name__ == "__main__":
    main()
