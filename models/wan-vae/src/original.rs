//! The official Wan checkpoints' VAE (`Wan2.1_VAE.pth`, Wan's own `WanVAE_` of
//! `wan/modules/vae2_1.py`): its tensor names against diffusers' (which tpinfer declares), and
//! the config its shapes imply. Wan's modules are flat lists where diffusers groups them: the
//! decoder's `upsamples.{k}` are diffusers' up blocks of `num_res_blocks + 1` resnets and an
//! upsampler each (the last without one); the middle's residual, attention, residual are
//! `middle.0`, `.1`, `.2`.

use tpinfer_weights::WeightStore;

use crate::{encoder_weight_decls, WanVaeConfig, WanVaeShard};

/// Pairs of (diffusers' name, Wan's name) for every tensor of `c`'s encoder and decoder, for a
/// [`tpinfer_weights::RenamedStore`].
pub fn names(c: &WanVaeConfig) -> Result<Vec<(String, String)>, String> {
    let decoder = WanVaeShard::new(1, 0)?.weight_decls(c);
    Ok(decoder
        .iter()
        .chain(&encoder_weight_decls(c))
        .map(|d| (d.name.clone(), original_name(&d.name, c.num_res_blocks)))
        .collect())
}

/// The config of the VAE `store` holds in Wan's names: Wan2.1's structure (fixed in its code,
/// `_video_vae`) at the base width of its first convolution; `origin` names the file in errors.
pub fn config(store: &dyn WeightStore, origin: &str) -> Result<WanVaeConfig, String> {
    let shape = |name: &str| -> Result<Vec<usize>, String> {
        store
            .info(name)
            .map(|i| i.shape)
            .ok_or_else(|| format!("{origin} has no `{name}`: it is not Wan2.1's VAE (WanVAE_)"))
    };
    let base = shape("encoder.conv1.weight")?[0];
    let z = shape("conv2.weight")?[0];
    let wan21 = WanVaeConfig::wan21();
    if z != wan21.z_dim {
        return Err(format!(
            "{origin}: {z} latent channels; Wan2.1's VAE, whose normalisation tpinfer applies to this layout, has {}",
            wan21.z_dim
        ));
    }
    Ok(WanVaeConfig {
        base_dim: base,
        encoder_base_dim: base,
        ..wan21
    })
}

/// Wan's name for the diffusers name `name` of a VAE with `res_blocks` residual blocks a level.
fn original_name(name: &str, res_blocks: usize) -> String {
    let residual = |rest: &str| -> String {
        for (ours, theirs) in [
            ("norm1.", "residual.0."),
            ("conv1.", "residual.2."),
            ("norm2.", "residual.3."),
            ("conv2.", "residual.6."),
            ("conv_shortcut.", "shortcut."),
        ] {
            if let Some(tail) = rest.strip_prefix(ours) {
                return format!("{theirs}{tail}");
            }
        }
        rest.to_string()
    };
    // `{index}.{rest}` of a name's tail.
    let indexed = |tail: &str| -> Option<(usize, String)> {
        let (index, rest) = tail.split_once('.')?;
        Some((index.parse().ok()?, rest.to_string()))
    };
    if let Some(rest) = name.strip_prefix("quant_conv.") {
        return format!("conv1.{rest}");
    }
    if let Some(rest) = name.strip_prefix("post_quant_conv.") {
        return format!("conv2.{rest}");
    }
    for side in ["encoder", "decoder"] {
        let Some(tail) = name.strip_prefix(side).and_then(|t| t.strip_prefix('.')) else {
            continue;
        };
        if let Some(rest) = tail.strip_prefix("conv_in.") {
            return format!("{side}.conv1.{rest}");
        }
        if let Some(rest) = tail.strip_prefix("norm_out.") {
            return format!("{side}.head.0.{rest}");
        }
        if let Some(rest) = tail.strip_prefix("conv_out.") {
            return format!("{side}.head.2.{rest}");
        }
        if let Some((j, rest)) = tail.strip_prefix("mid_block.resnets.").and_then(indexed) {
            return format!("{side}.middle.{}.{}", 2 * j, residual(&rest));
        }
        if let Some(rest) = tail.strip_prefix("mid_block.attentions.0.") {
            return format!("{side}.middle.1.{rest}");
        }
        if let Some((k, rest)) = tail.strip_prefix("down_blocks.").and_then(indexed) {
            return format!("{side}.downsamples.{k}.{}", residual(&rest));
        }
        if let Some((b, rest)) = tail.strip_prefix("up_blocks.").and_then(indexed) {
            let first = b * (res_blocks + 2);
            if let Some((j, rest)) = rest.strip_prefix("resnets.").and_then(indexed) {
                return format!("{side}.upsamples.{}.{}", first + j, residual(&rest));
            }
            if let Some(rest) = rest.strip_prefix("upsamplers.0.") {
                return format!("{side}.upsamples.{}.{rest}", first + res_blocks + 1);
            }
        }
    }
    name.to_string()
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The pairs the wheel's `WanVAE_` and diffusers' `AutoencoderKLWan` give for the same
    /// module (their state dicts side by side, two levels of two residual blocks).
    #[test]
    fn names_follow_the_two_layouts() {
        for (ours, theirs) in [
            ("encoder.conv_in.weight", "encoder.conv1.weight"),
            (
                "encoder.down_blocks.0.norm1.gamma",
                "encoder.downsamples.0.residual.0.gamma",
            ),
            (
                "encoder.down_blocks.3.conv_shortcut.bias",
                "encoder.downsamples.3.shortcut.bias",
            ),
            (
                "encoder.down_blocks.5.time_conv.weight",
                "encoder.downsamples.5.time_conv.weight",
            ),
            (
                "encoder.mid_block.attentions.0.to_qkv.weight",
                "encoder.middle.1.to_qkv.weight",
            ),
            (
                "encoder.mid_block.resnets.1.conv2.bias",
                "encoder.middle.2.residual.6.bias",
            ),
            ("encoder.norm_out.gamma", "encoder.head.0.gamma"),
            ("quant_conv.weight", "conv1.weight"),
            ("post_quant_conv.bias", "conv2.bias"),
            (
                "decoder.up_blocks.0.resnets.2.norm2.gamma",
                "decoder.upsamples.2.residual.3.gamma",
            ),
            (
                "decoder.up_blocks.0.upsamplers.0.time_conv.bias",
                "decoder.upsamples.3.time_conv.bias",
            ),
            (
                "decoder.up_blocks.1.resnets.0.conv_shortcut.weight",
                "decoder.upsamples.4.shortcut.weight",
            ),
            (
                "decoder.up_blocks.2.upsamplers.0.resample.1.weight",
                "decoder.upsamples.11.resample.1.weight",
            ),
            (
                "decoder.up_blocks.3.resnets.2.conv1.weight",
                "decoder.upsamples.14.residual.2.weight",
            ),
            ("decoder.conv_out.bias", "decoder.head.2.bias"),
        ] {
            assert_eq!(original_name(ours, 2), theirs, "{ours}");
        }
    }
}
