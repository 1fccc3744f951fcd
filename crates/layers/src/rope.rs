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
    /// A divisor per frequency, `head_dim / 2` of them: how llama.cpp's GGUF files carry a
    /// scaling (their `rope_freqs` tensor).
    Divisors(Vec<f64>),
}

impl RopeScaling {
    /// The divisor of each of a head's `head_dim / 2` frequencies (base `theta`): this
    /// scaling in the form llama.cpp's GGUF files carry (`rope_freqs`).
    pub fn divisors(&self, head_dim: usize, theta: f64) -> Vec<f64> {
        (0..head_dim / 2)
            .map(|i| {
                let freq = 1.0 / theta.powf(2.0 * i as f64 / head_dim as f64);
                freq / scale_frequency(i, freq, Some(self))
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
                scale_frequency(i, freq, scaling) as f32
            })
            .collect();
        let inv_freq = Tensor::from_vec(inv_freq, (1, head_dim / 2), device)?;
        let positions = Tensor::arange(0u32, max_positions as u32, device)?
            .to_dtype(DType::F32)?
            .reshape((max_positions, 1))?;
        let angles = positions.broadcast_mul(&inv_freq)?;
        let table = Tensor::stack(&[angles.cos()?, angles.sin()?], 0)?.to_dtype(dtype)?;
        Ok(Self { table })
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

/// Frequency `i` of a head, `freq`, under `scaling`.
fn scale_frequency(i: usize, freq: f64, scaling: Option<&RopeScaling>) -> f64 {
    match scaling {
        None => freq,
        Some(RopeScaling::Divisors(divisors)) => freq / divisors[i],
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
