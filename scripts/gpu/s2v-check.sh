#!/usr/bin/env bash
# The S2V DiT forward and the Wan VAE encoder on CUDA against the f32 references of the CI
# fixtures (issue #35): tpinfer in f32 and bf16, beside the references' own bf16 error (the
# wan22 wheel's WanModel_S2V under bf16 autocast, diffusers' AutoencoderKLWan in bf16) on the
# same weights and inputs. Needs the unpacked wan22 wheel at $WAN22 (default .carry/wan22),
# diffusers and einops, and .dist/.
LOG=s2v-check.log
. "$(dirname "$0")/wan-env.sh"
WAN22=${WAN22:-.carry/wan22}
S=tests/fixtures/s2v-dit E=tests/fixtures/vae-encoder
$PY - "$W/s2v_in.safetensors" <<'PY'
import sys
from safetensors.torch import load_file, save_file
i = load_file("tests/fixtures/s2v-dit/inputs.safetensors"); i["latents"] = i.pop("noisy"); save_file(i, sys.argv[1])
PY
for d in f32 bf16; do
  run "$BIN/tpinfer-bench" dit --cuda --dtype $d --model $S/model --inputs "$W/s2v_in.safetensors" --tp 1 \
    --repeats 3 --out "$W/s2v_$d"
  run "$BIN/tpinfer-bench" vae-encode --cuda --dtype $d --model $E/model --pixels $E/cases.safetensors \
    --repeats 3 --out "$W/enc_$d.safetensors"
done
log compare
PYTHONPATH="$SCRIPTS/reference${PYTHONPATH:+:$PYTHONPATH}" $PY - "$WAN22" "$W" <<'PY' 2>&1 | grep -v Warning | tee -a "$OUT/$LOG"
import json, os, sys
import torch
from safetensors.torch import load_file
from wan22_modules import import_wan22
wan22, w = sys.argv[1:]
rel = lambda a, b: float((a.float() - b.float()).norm() / b.float().norm())
S, E = "tests/fixtures/s2v-dit", "tests/fixtures/vae-encoder"
# The wheel's model in bf16 under autocast, as its generate runs it.
config = json.load(open(f"{S}/model/config.json"))
kwargs = {k: v for k, v in config.items() if k not in ("_class_name", "trainable_token", "motion_frames")}
kwargs["window_size"], kwargs["patch_size"] = tuple(kwargs["window_size"]), tuple(kwargs["patch_size"])
with torch.device("cuda"):
    model = import_wan22(wan22, "modules.s2v.model_s2v").WanModel_S2V(**kwargs).eval()
model.load_state_dict(load_file(f"{S}/model/diffusion_pytorch_model.safetensors", device="cuda"))
model = model.to(torch.bfloat16)
i = {k: v.cuda() for k, v in load_file(f"{S}/inputs.safetensors").items()}
bf = lambda t: t.to(torch.bfloat16)
ref = load_file(f"{S}/reference.safetensors")["with_motion"]
with torch.amp.autocast("cuda", dtype=torch.bfloat16), torch.no_grad():
    out = model([bf(i["noisy"])], t=i["timestep"], context=[bf(i["text"])], seq_len=None,
                ref_latents=[bf(i["reference"])], motion_latents=[bf(i["motion"])], cond_states=[bf(i["pose"])],
                audio_input=bf(i["audio"]).permute(1, 2, 0).unsqueeze(0), motion_frames=[73, 19],
                drop_motion_frames=False)[0]
print(f"s2v dit: wan22 wheel bf16 (autocast) vs its f32: {rel(out.cpu(), ref):.3e}")
for d in ["f32", "bf16"]:
    p = f"{w}/s2v_{d}_tp1.safetensors"
    if os.path.exists(p):
        print(f"s2v dit: tpinfer {d} vs wheel f32: {rel(load_file(p)['velocity'], ref):.3e}")
from diffusers import AutoencoderKLWan
vae_config = json.load(open(f"{E}/model/config.json"))
vae = AutoencoderKLWan.from_config(vae_config).eval()
vae.load_state_dict(load_file(f"{E}/model/diffusion_pytorch_model.safetensors"), strict=False)
vae = vae.to("cuda", torch.bfloat16)
cases = load_file(f"{E}/cases.safetensors")
z = vae_config["z_dim"]
mean = torch.tensor(vae_config["latents_mean"]).view(1, z, 1, 1, 1)
std = torch.tensor(vae_config["latents_std"]).view(1, z, 1, 1, 1)
for name in ["video", "image"]:
    with torch.no_grad():
        mu = vae.encode(bf(cases[f"{name}_pixels"].cuda()).unsqueeze(0)).latent_dist.mode().float().cpu()
    print(f"vae encoder {name}: diffusers bf16 vs its f32: {rel(((mu - mean) / std)[0], cases[f'{name}_latents']):.3e}")
    for d in ["f32", "bf16"]:
        p = f"{w}/enc_{d}.safetensors"
        if os.path.exists(p):
            print(f"vae encoder {name}: tpinfer {d} vs diffusers f32: {rel(load_file(p)[f'{name}_latents'], cases[f'{name}_latents']):.3e}")
PY
log done
