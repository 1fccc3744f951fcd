#!/usr/bin/env python3
"""One Wan2.2-S2V DiT forward, run by the wan22 wheel's own WanModel_S2V on random weights
(issue #35): the noisy latents of a 16-frame clip with the pose latents added, the reference
image's latent, the frame-packed motion latents, the audio through the causal encoder and the
injections, the reference and motion tokens at timestep 0. Twice: with the motion frames,
and with them dropped, as the first clip runs. Then the clip denoised as the wheel's
`generate` does it, from the same latents: three UniPC steps (shift 3), guided (4.5) by an
unconditional pass with a negative prompt and silent audio. Written as tests/fixtures/s2v-dit/: the
checkpoint in the official layout under model/ (config.json in the original form,
diffusion_pytorch_model.safetensors in the original names), inputs.safetensors and
reference.safetensors beside it. Runs on the CPU in f32: the
wheel's CUDA flash attention is replaced by PyTorch's SDPA, the same softmax attention.

  python scripts/reference/reference_s2v_dit.py --wan22 DIR --out tests/fixtures/s2v-dit
  (DIR: the unpacked wan22 2.2.11 wheel, which holds wan/modules/s2v/)
"""
import argparse
import json
import os

import torch
from safetensors.torch import save_file
from wan22_modules import import_wan22

# Tiny: 64 wide in 4 heads of 16, 3 blocks with audio after blocks 0 and 2; wav2vec2's 25
# states of 32; a 16-frame clip (4 latent frames) of 8 x 16 latents (4 x 8 patches); 12
# text tokens of 48 padded to the model's text length 16.
CONFIG = {
    "_class_name": "WanModel_S2V", "model_type": "s2v",
    "dim": 64, "ffn_dim": 128, "freq_dim": 32, "num_heads": 4, "num_layers": 3,
    "in_dim": 16, "out_dim": 16, "text_dim": 48, "text_len": 16, "patch_size": [1, 2, 2],
    "audio_dim": 32, "num_audio_token": 4, "cond_dim": 16, "audio_inject_layers": [0, 2],
    "enable_adain": True, "adain_mode": "attn_norm", "enable_framepack": True,
    "framepack_drop_mode": "padd", "enable_motioner": False, "zero_timestep": True,
    "zero_init": False, "add_last_motion": True, "trainable_token": False,
    "enable_tsm": False, "motion_frames": 73, "window_size": [-1, -1],
    "qk_norm": True, "cross_attn_norm": True, "eps": 1e-6,
}
FRAMES, LATENT_FRAMES, LAT_H, LAT_W = 16, 4, 8, 16
MOTION, LAT_MOTION, STATES, TEXT = 73, 19, 25, 12
TIMESTEP = 742.5
DENOISE_STEPS, GUIDE_SCALE = 3, 4.5


def main():
    p = argparse.ArgumentParser()
    p.add_argument("--wan22", required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=11)
    args = p.parse_args()
    model_s2v = import_wan22(args.wan22, "modules.s2v.model_s2v")
    torch.manual_seed(args.seed)
    kwargs = {k: v for k, v in CONFIG.items() if k not in ("_class_name", "trainable_token", "motion_frames")}
    kwargs["window_size"] = tuple(kwargs["window_size"])
    kwargs["patch_size"] = tuple(kwargs["patch_size"])
    model = model_s2v.WanModel_S2V(**kwargs).eval()
    weights = {}
    with torch.no_grad():
        for name, p in model.named_parameters():
            # Away from S2V's zero init and Wan's zero head, so that every weight shows.
            if "norm" in name and p.dim() == 1:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            elif p.dim() == 1 or "modulation" in name or name.endswith("padding_tokens") or name.endswith(".weights"):
                p.copy_(0.3 * torch.randn_like(p))
            elif name == "trainable_cond_mask.weight":
                p.copy_(0.5 * torch.randn_like(p))
            else:
                p.copy_(torch.randn_like(p) / p[0].numel() ** 0.5)
            weights[name] = p.detach().clone().contiguous()

        noisy = torch.randn(16, LATENT_FRAMES, LAT_H, LAT_W)
        reference = torch.randn(16, 1, LAT_H, LAT_W)
        motion = torch.randn(16, LAT_MOTION, LAT_H, LAT_W)
        pose = torch.randn(16, LATENT_FRAMES, LAT_H, LAT_W)
        text = torch.cat([torch.randn(TEXT, CONFIG["text_dim"]), torch.zeros(CONFIG["text_len"] - TEXT, CONFIG["text_dim"])])
        # One clip of wav2vec2 features per video frame, [1, states, audio dim, frames].
        audio = torch.randn(1, STATES, CONFIG["audio_dim"], FRAMES)
        outputs = {}
        for case, drop in [("with_motion", False), ("first_clip", True)]:
            out = model(
                [noisy], t=torch.tensor([TIMESTEP]), context=[text], seq_len=None,
                ref_latents=[reference], motion_latents=[motion], cond_states=[pose],
                audio_input=audio, motion_frames=[MOTION, LAT_MOTION], drop_motion_frames=drop)
            outputs[case] = out[0].contiguous()
        # One clip denoised as the wheel's `generate` does it: UniPC (shift 3), each step's
        # unconditional pass with the negative prompt and silent audio, guided.
        negative = torch.cat([torch.randn(TEXT - 4, CONFIG["text_dim"]),
                              torch.zeros(CONFIG["text_len"] - TEXT + 4, CONFIG["text_dim"])])
        solvers = import_wan22(args.wan22, "utils.fm_solvers_unipc")
        scheduler = solvers.FlowUniPCMultistepScheduler(num_train_timesteps=1000, shift=1, use_dynamic_shifting=False)
        scheduler.set_timesteps(DENOISE_STEPS, device="cpu", shift=3.0)
        latents = noisy.clone()
        for t in scheduler.timesteps:
            def velocity(context, audio_input):
                return model([latents], t=torch.stack([t]), context=[context], seq_len=None,
                             ref_latents=[reference], motion_latents=[motion], cond_states=[pose],
                             audio_input=audio_input, motion_frames=[MOTION, LAT_MOTION],
                             drop_motion_frames=False)[0]
            cond, uncond = velocity(text, audio), velocity(negative, 0.0 * audio)
            guided = uncond + GUIDE_SCALE * (cond - uncond)
            latents = scheduler.step(guided.unsqueeze(0), t, latents.unsqueeze(0), return_dict=False)[0].squeeze(0)
        outputs["denoised"] = latents.contiguous()
    inputs = {
        "noisy": noisy, "reference": reference, "motion": motion, "pose": pose, "text": text,
        "audio": audio[0].permute(2, 0, 1).contiguous(),  # [frames, states, audio dim]
        "timestep": torch.tensor([TIMESTEP]), "negative": negative,
    }
    model_dir = os.path.join(args.out, "model")
    os.makedirs(model_dir, exist_ok=True)
    with open(os.path.join(model_dir, "config.json"), "w") as f:
        json.dump(CONFIG, f, indent=1)
    save_file(weights, os.path.join(model_dir, "diffusion_pytorch_model.safetensors"))
    save_file(inputs, os.path.join(args.out, "inputs.safetensors"))
    save_file(outputs, os.path.join(args.out, "reference.safetensors"))
    print({k: list(v.shape) for k, v in {**inputs, **outputs}.items()})
    print({k: float(v.norm()) for k, v in outputs.items()})


if __name__ == "__main__":
    main()
