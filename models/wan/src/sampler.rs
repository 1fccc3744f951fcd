//! Flow-matching samplers as Wan runs them: the shifted schedule, Euler, and UniPC multistep
//! (B(h) = eᵸ − 1, predicting x₀, order 2 with a lower order at the last step, the corrector
//! on every step after the first), with classifier-free guidance.
//!
//! The flow: `x_σ = (1 − σ)·x₀ + σ·ε`, the model's velocity `v = ε − x₀`, so `x₀ = x − σ·v`.

use candle_core::{Device, Tensor};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Training timesteps of Wan's flow (the model sees `σ·1000`).
pub const TRAIN_TIMESTEPS: usize = 1000;

/// Wan's shifted schedule: `steps` sigmas from `1 − 1/1000` down (evenly), each shifted
/// `σ' = shift·σ / (1 + (shift − 1)·σ)`, then a final 0.
#[derive(Debug, Clone, PartialEq)]
pub struct Schedule {
    pub sigmas: Vec<f64>,
}

impl Schedule {
    pub fn new(steps: usize, shift: f64) -> Self {
        let max = 1.0 - 1.0 / TRAIN_TIMESTEPS as f64;
        let mut sigmas: Vec<f64> = (0..steps)
            .map(|i| max * (1.0 - i as f64 / steps as f64))
            .map(|s| shift * s / (1.0 + (shift - 1.0) * s))
            .collect();
        sigmas.push(0.0);
        Self { sigmas }
    }

    pub fn steps(&self) -> usize {
        self.sigmas.len() - 1
    }

    /// The timestep the model is given at step `i`: `σ·1000`, truncated as Wan's int64 cast.
    pub fn timestep(&self, i: usize) -> f64 {
        (self.sigmas[i] * TRAIN_TIMESTEPS as f64).trunc()
    }
}

/// Classifier-free guidance: `uncond + scale · (cond − uncond)`.
pub fn guide(cond: &Tensor, uncond: &Tensor, scale: f64) -> candle_core::Result<Tensor> {
    uncond + ((cond - uncond)? * scale)?
}

/// Which solver steps the latents.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Solver {
    Euler,
    /// UniPC multistep of this order (1 or 2; Wan uses 2).
    UniPc(usize),
}

/// A sampler's state over one denoising run.
pub struct Sampler {
    schedule: Schedule,
    solver: Solver,
    /// x₀ predictions of the last steps, newest last.
    x0: Vec<Tensor>,
    last_sample: Option<Tensor>,
    /// The predictor's order at the previous step (the corrector's order now).
    last_order: usize,
    step: usize,
}

impl Sampler {
    pub fn new(schedule: Schedule, solver: Solver) -> Self {
        Self {
            schedule,
            solver,
            x0: Vec::new(),
            last_sample: None,
            last_order: 0,
            step: 0,
        }
    }

    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    /// Advances `x` by one step given the (guided) velocity `v` at the current step.
    pub fn step(&mut self, x: &Tensor, v: &Tensor) -> candle_core::Result<Tensor> {
        let i = self.step;
        let s = &self.schedule.sigmas;
        self.step += 1;
        match self.solver {
            Solver::Euler => x + (v * (s[i + 1] - s[i]))?,
            Solver::UniPc(order) => {
                let order = order.clamp(1, 2);
                let m = (x - (v * s[i])?)?;
                let x = match (&self.last_sample, i > 0) {
                    (Some(last), true) => self.correct(last, &m, i)?,
                    _ => x.clone(),
                };
                self.x0.push(m);
                if self.x0.len() > order {
                    self.x0.remove(0);
                }
                // Lower order at the last steps, and while the history fills.
                let this = order.min(s.len() - 1 - i).min(self.x0.len());
                self.last_order = this;
                self.last_sample = Some(x.clone());
                self.predict(&x, i, this)
            }
        }
    }

    /// UniP: from `x` at σᵢ to σᵢ₊₁ with the last `order` x₀ predictions.
    fn predict(&self, x: &Tensor, i: usize, order: usize) -> candle_core::Result<Tensor> {
        let s = &self.schedule.sigmas;
        let (sigma_t, sigma_s0) = (s[i + 1], s[i]);
        let coeffs = Coefficients::new(sigma_t, sigma_s0);
        let m0 = &self.x0[self.x0.len() - 1];
        let base = ((x * (sigma_t / sigma_s0))? - (m0 * (coeffs.alpha_t * coeffs.h_phi_1))?)?;
        if order < 2 {
            return Ok(base);
        }
        let rk = (lambda(s[i - 1]) - lambda(sigma_s0)) / coeffs.h;
        let d1 = ((&self.x0[self.x0.len() - 2] - m0)? / rk)?;
        // Order 2: ρ = 1/2.
        base - (d1 * (coeffs.alpha_t * coeffs.b_h * 0.5))?
    }

    /// UniC: recomputes the sample at σᵢ from the one before it (`last`), now that the model's
    /// x₀ prediction `m_t` at σᵢ is known.
    fn correct(&self, last: &Tensor, m_t: &Tensor, i: usize) -> candle_core::Result<Tensor> {
        let s = &self.schedule.sigmas;
        let (sigma_t, sigma_s0) = (s[i], s[i - 1]);
        let c = Coefficients::new(sigma_t, sigma_s0);
        let m0 = &self.x0[self.x0.len() - 1];
        let base = ((last * (sigma_t / sigma_s0))? - (m0 * (c.alpha_t * c.h_phi_1))?)?;
        let d1_t = (m_t - m0)?;
        match self.last_order {
            2 => {
                // ρ solves [[1, 1], [r, 1]]·ρ = b for the two B(h) coefficients.
                let r = (lambda(s[i - 2]) - lambda(sigma_s0)) / c.h;
                let (b1, b2) = c.b_terms();
                let rho_t = (b2 - r * b1) / (1.0 - r);
                let rho_1 = b1 - rho_t;
                let d1 = ((&self.x0[self.x0.len() - 2] - m0)? / r)?;
                let res = ((d1 * rho_1)? + (d1_t * rho_t)?)?;
                base - (res * (c.alpha_t * c.b_h))?
            }
            _ => base - (d1_t * (c.alpha_t * c.b_h * 0.5))?,
        }
    }
}

/// `λ = ln α − ln σ` with `α = 1 − σ`: the log signal-to-noise ratio.
fn lambda(sigma: f64) -> f64 {
    (1.0 - sigma).ln() - sigma.ln()
}

/// The scalar coefficients of a UniPC step from σ_s0 to σ_t (x₀-predicting, B(h) = eᵸ − 1).
struct Coefficients {
    alpha_t: f64,
    h: f64,
    /// `−h`: the x₀ form integrates in the negative direction.
    hh: f64,
    h_phi_1: f64,
    b_h: f64,
}

impl Coefficients {
    fn new(sigma_t: f64, sigma_s0: f64) -> Self {
        let h = lambda(sigma_t) - lambda(sigma_s0);
        let hh = -h;
        Self {
            alpha_t: 1.0 - sigma_t,
            h,
            hh,
            h_phi_1: hh.exp_m1(),
            b_h: hh.exp_m1(),
        }
    }

    /// The right-hand side of the order-2 system: `φ₂/B(h)` and `2·φ₃/B(h)`.
    fn b_terms(&self) -> (f64, f64) {
        let phi_2 = self.h_phi_1 / self.hh - 1.0;
        let phi_3 = phi_2 / self.hh - 0.5;
        (phi_2 / self.b_h, 2.0 * phi_3 / self.b_h)
    }
}

/// Standard normal noise of `shape` from `seed`, the same on every rank and every machine
/// (Box–Muller over a seeded ChaCha stream), on the CPU.
pub fn seeded_noise(shape: &[usize], seed: u64) -> candle_core::Result<Tensor> {
    let n: usize = shape.iter().product();
    let mut rng = StdRng::seed_from_u64(seed);
    let mut values = Vec::with_capacity(n + 1);
    while values.len() < n {
        let (u1, u2): (f64, f64) = (rng.random::<f64>().max(f64::MIN_POSITIVE), rng.random());
        let r = (-2.0 * u1.ln()).sqrt();
        let theta = std::f64::consts::TAU * u2;
        values.push((r * theta.cos()) as f32);
        values.push((r * theta.sin()) as f32);
    }
    values.truncate(n);
    Tensor::from_vec(values, shape, &Device::Cpu)
}
