use candle_core::{DType, Device, Tensor};

use crate::Result;

/// How rotary frequencies are rescaled for long context.
#[derive(Debug, Clone, PartialEq)]
pub enum RopeScaling {
    /// Llama 3.1's scaling: long wavelengths slowed by `factor`, short ones kept, a smooth
    /// blend between `low_freq_factor` and `high_freq_factor`.
    Llama3 {
        factor: f64,
        low_freq_factor: f64,
        high_freq_factor: f64,
        original_max_position_embeddings: usize,
    },
    /// YaRN (transformers' `yarn`; Qwen2.5's long context): frequencies that turn more than
    /// `beta_fast` times over the original context kept, those that turn less than `beta_slow`
    /// times divided by `factor`, a linear ramp over the head's frequencies between the two;
    /// cos and sin multiplied by `attention_factor`.
    Yarn {
        factor: f64,
        original_max_position_embeddings: usize,
        beta_fast: f64,
        beta_slow: f64,
        attention_factor: f64,
        /// The ramp's ends rounded outward to whole frequencies (transformers' `truncate`).
        truncate: bool,
    },
    /// A divisor per frequency, `head_dim / 2` of them: how llama.cpp's GGUF files carry a
    /// scaling (their `rope_freqs` tensor).
    Divisors(Vec<f64>),
}

impl RopeScaling {
    /// YaRN's default attention factor for `factor`: 0.1 · ln(factor) + 1 (1 for no scaling).
    pub fn yarn_mscale(factor: f64, mscale: f64) -> f64 {
        match factor <= 1.0 {
            true => 1.0,
            false => 0.1 * mscale * factor.ln() + 1.0,
        }
    }

    /// The positions a model trained on `trained` reaches under this scaling: YaRN's original
    /// context times its factor where that is more (vLLM's reading: Qwen2.5's config keeps
    /// 32,768 beside a factor of 4 for 131,072), else `trained`.
    pub fn reach(scaling: Option<&Self>, trained: usize) -> usize {
        match scaling {
            Some(&Self::Yarn {
                factor,
                original_max_position_embeddings,
                ..
            }) => trained.max((original_max_position_embeddings as f64 * factor) as usize),
            _ => trained,
        }
    }

    /// What cos and sin are multiplied by: YaRN's attention factor, else 1.
    pub fn attention_factor(&self) -> f64 {
        match self {
            Self::Yarn { attention_factor, .. } => *attention_factor,
            Self::Llama3 { .. } | Self::Divisors(_) => 1.0,
        }
    }
}

impl RopeScaling {
    /// The divisor of each of a head's `head_dim / 2` frequencies (base `theta`): this
    /// scaling in the form llama.cpp's GGUF files carry (`rope_freqs`).
    pub fn divisors(&self, head_dim: usize, theta: f64) -> Vec<f64> {
        (0..head_dim / 2)
            .map(|i| {
                let freq = 1.0 / theta.powf(2.0 * i as f64 / head_dim as f64);
                freq / scale_frequency(i, freq, Some(self), head_dim, theta)
            })
            .collect()
    }
}

/// Rotary position embedding over halves of each head (the Hugging Face layout), with cos/sin
/// tables computed once for every position up to `max_positions`. Applied by the fused QKV
/// kernel of `tpinfer_kernels` through [`crate::KvCache::append_rotated`].
pub struct Rope {
    /// `[2, max_positions, head_dim / 2]`: cos, then sin.
    table: Tensor,
}

impl Rope {
    pub fn new(
        head_dim: usize,
        theta: f64,
        scaling: Option<&RopeScaling>,
        max_positions: usize,
        dtype: DType,
        device: &Device,
    ) -> Result<Self> {
        if let Some(RopeScaling::Divisors(divisors)) = scaling {
            if divisors.len() != head_dim / 2 {
                return Err(candle_core::Error::Msg(format!(
                    "{} rotary frequency divisors for a head of {head_dim}, which has {}",
                    divisors.len(),
                    head_dim / 2
                ))
                .into());
            }
        }
        let inv_freq: Vec<f32> = (0..head_dim / 2)
            .map(|i| {
                let freq = 1.0 / theta.powf(2.0 * i as f64 / head_dim as f64);
                scale_frequency(i, freq, scaling, head_dim, theta) as f32
            })
            .collect();
        let inv_freq = Tensor::from_vec(inv_freq, (1, head_dim / 2), device)?;
        let positions = Tensor::arange(0u32, max_positions as u32, device)?
            .to_dtype(DType::F32)?
            .reshape((max_positions, 1))?;
        let angles = positions.broadcast_mul(&inv_freq)?;
        let mut table = Tensor::stack(&[angles.cos()?, angles.sin()?], 0)?;
        let attention_factor = scaling.map_or(1.0, RopeScaling::attention_factor);
        if attention_factor != 1.0 {
            // In f32, before the cast, as transformers scales its cos and sin.
            table = (table * attention_factor)?;
        }
        Ok(Self {
            table: table.to_dtype(dtype)?,
        })
    }

    /// The cos/sin table, `[2, max_positions, head_dim / 2]`.
    pub fn table(&self) -> &Tensor {
        &self.table
    }

    /// The number of positions the tables cover.
    pub fn max_positions(&self) -> usize {
        self.table.dims()[1]
    }
}

/// Frequency `i` of a head of `head_dim` (base `theta`), `freq`, under `scaling`.
fn scale_frequency(i: usize, freq: f64, scaling: Option<&RopeScaling>, head_dim: usize, theta: f64) -> f64 {
    match scaling {
        None => freq,
        Some(RopeScaling::Divisors(divisors)) => freq / divisors[i],
        Some(&RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            beta_fast,
            beta_slow,
            truncate,
            ..
        }) => {
            // The frequency index at which a frequency turns `rotations` times over the
            // original context.
            let dim = head_dim as f64;
            let at = |rotations: f64| {
                dim * (original_max_position_embeddings as f64 / (rotations * 2.0 * std::f64::consts::PI)).ln()
                    / (2.0 * theta.ln())
            };
            let (low, high) = match truncate {
                true => (at(beta_fast).floor(), at(beta_slow).ceil()),
                false => (at(beta_fast), at(beta_slow)),
            };
            let (low, high) = (low.max(0.0), high.min(dim - 1.0));
            let high = if low == high { high + 0.001 } else { high };
            // 0 keeps the frequency, 1 divides it by the factor.
            let ramp = ((i as f64 - low) / (high - low)).clamp(0.0, 1.0);
            freq / factor * ramp + freq * (1.0 - ramp)
        }
        Some(RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        }) => {
            let (factor, low_freq_factor, high_freq_factor) = (*factor, *low_freq_factor, *high_freq_factor);
            let old = *original_max_position_embeddings as f64;
            let wavelen = 2.0 * std::f64::consts::PI / freq;
            if wavelen < old / high_freq_factor {
                freq
            } else if wavelen > old / low_freq_factor {
                freq / factor
            } else {
                let smooth = (old / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor);
                (1.0 - smooth) * freq / factor + smooth * freq
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// YaRN as Qwen2.5 configures it (factor 4 over 32,768 positions, head 128, θ 1e6): the
    /// cos/sin table at position 1,000 against values computed apart from transformers'
    /// `_compute_yarn_parameters` (in Python, f64): frequencies kept up to index 23, divided by
    /// 4 from 40, a ramp between; cos and sin × (0.1 · ln 4 + 1).
    #[test]
    fn yarn_matches_transformers_formula() {
        let scaling = RopeScaling::Yarn {
            factor: 4.0,
            original_max_position_embeddings: 32_768,
            beta_fast: 32.0,
            beta_slow: 1.0,
            attention_factor: RopeScaling::yarn_mscale(4.0, 1.0),
            truncate: true,
        };
        assert!((scaling.attention_factor() - 1.138_629_436_111_989).abs() < 1e-12);
        let rope = Rope::new(128, 1e6, Some(&scaling), 1001, DType::F32, &Device::Cpu).expect("rope");
        let table = rope.table().to_vec3::<f32>().expect("table");
        let expected = [
            (0, 0.640_341_370_518_064_4, 0.941_509_384_968_494_7),
            (10, -0.824_746_991_790_376_6, 0.785_028_274_858_449_6),
            (23, 0.874_440_652_834_399_8, 0.729_267_123_522_824_7),
            (24, 0.700_747_707_672_249_3, -0.897_457_320_975_651_9),
            (30, 0.552_307_146_011_942_1, 0.995_707_692_671_322_9),
            (39, 1.136_232_027_198_146_5, 0.073_849_665_875_322_15),
            (40, 1.137_504_414_414_510_8, 0.050_603_359_258_128_92),
            (63, 1.138_629_381_318_062_1, 0.000_353_242_060_027_380_1),
        ];
        for (i, cos, sin) in expected {
            // f32 angles of position 1,000: a few ulps of the angle.
            assert!(
                (table[0][1000][i] as f64 - cos).abs() < 5e-4,
                "cos {i}: {}",
                table[0][1000][i]
            );
            assert!(
                (table[1][1000][i] as f64 - sin).abs() < 5e-4,
                "sin {i}: {}",
                table[1][1000][i]
            );
        }
    }
}
