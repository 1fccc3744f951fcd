//! One job of a video engine on one rank: the denoising loop (seeded or given noise, guided
//! steps, a check for non-finite latents after each) of a video or of one S2V clip (its
//! conditioning prepared once, and once more with silent audio for the unconditional
//! passes), or a single velocity.

use std::time::Instant;

use candle_core::{DType, Device, Tensor};
use tpinfer_comm::Communicator;
use tpinfer_runtime::RuntimeError;
use tpinfer_wan::sampler::{guide, seeded_noise, Sampler, Schedule};
use tpinfer_wan::{S2vClip, S2vCondition, StageTimes, WanRank};

use crate::error::finite;
use crate::video::{JobResult, S2vInputs, StepReport, VideoJob, Work};
use crate::EngineError;

pub(crate) fn denoise(
    model: &WanRank,
    comm: &dyn Communicator,
    device: &Device,
    latent_shape: [usize; 4],
    job: &VideoJob,
) -> JobResult {
    let rank = comm.rank();
    let err = |source: tpinfer_layers::Error| EngineError::from(RuntimeError::of_rank(rank, source));
    let tensor_err = |e: candle_core::Error| err(e.into());
    let (r, s2v) = match &job.work {
        Work::Denoise(r) => (r, None),
        Work::DenoiseS2v(r, inputs) => (r, Some(inputs)),
        Work::Velocity {
            latents,
            timestep,
            text,
            s2v,
            profile,
        } => {
            let on_device = |t: &Tensor| t.to_device(device).map_err(tensor_err);
            let context = model.embed_text(&on_device(text)?).map_err(err)?;
            let latents = on_device(latents)?;
            let clip = match s2v {
                Some(inputs) => Some(prepare_clip(model, inputs, latents.dims(), device).map_err(err)?),
                None => None,
            };
            // Only rank 0's stages are returned; the others run their forward unmarked.
            let times = match *profile && rank == 0 {
                true => Some(StageTimes::new(device).map_err(err)?),
                false => None,
            };
            let v = match &clip {
                Some(clip) => model.forward_s2v(&latents, *timestep, &context, clip, times.as_ref()),
                None => match &times {
                    Some(times) => model.forward_profiled(&latents, *timestep, &context, times),
                    None => model.forward(&latents, *timestep, &context),
                },
            }
            .map_err(err)?;
            let stages = match times {
                Some(times) => times.stages().map_err(err)?,
                None => Vec::new(),
            };
            return match rank {
                0 => Ok(Some((v.to_device(&Device::Cpu).map_err(tensor_err)?, stages))),
                _ => Ok(None),
            };
        }
    };
    let context = model
        .embed_text(&r.text.to_device(device).map_err(tensor_err)?)
        .map_err(err)?;
    let negative = match (&r.negative, r.guided()) {
        (Some(n), true) => Some(
            model
                .embed_text(&n.to_device(device).map_err(tensor_err)?)
                .map_err(err)?,
        ),
        _ => None,
    };
    let mut x = match &r.init_latents {
        Some(init) => init.to_dtype(DType::F32).and_then(|x| x.to_device(device)),
        None => seeded_noise(&latent_shape, r.seed).and_then(|n| n.to_device(device)),
    }
    .map_err(tensor_err)?;
    // S2V: the clip's conditioning, and for the unconditional pass the same with silent audio.
    let clips = match s2v {
        Some(inputs) => {
            let cond = prepare_clip(model, inputs, &latent_shape, device).map_err(err)?;
            let silent = match &negative {
                Some(_) => {
                    let zeros = inputs.audio.zeros_like().and_then(|z| z.to_device(device));
                    let audio = model.encode_s2v_audio(&zeros.map_err(tensor_err)?).map_err(err)?;
                    Some(cond.with_audio(audio))
                }
                None => None,
            };
            Some((cond, silent))
        }
        None => None,
    };
    let forward = |x: &Tensor, timestep: f64, context: &Tensor, clip: Option<&S2vClip>| match clip {
        Some(clip) => model.forward_s2v(x, timestep, context, clip, None),
        None => model.forward(x, timestep, context),
    };
    let mut sampler = Sampler::new(Schedule::new(r.steps, r.shift), r.solver);
    for index in 0..r.steps {
        let start = Instant::now();
        let before = comm.stats().snapshot();
        let timestep = sampler.schedule().timestep(index);
        let cond = forward(&x, timestep, &context, clips.as_ref().map(|c| &c.0)).map_err(err)?;
        let v = match &negative {
            Some(n) => {
                let silent = clips.as_ref().and_then(|c| c.1.as_ref());
                let uncond = forward(&x, timestep, n, silent).map_err(err)?;
                guide(&cond, &uncond, r.guide_scale).map_err(tensor_err)?
            }
            None => cond,
        };
        x = sampler.step(&x, &v).map_err(tensor_err)?;
        if rank == 0 {
            // Rank 0 waits for the step anyway; a non-finite latent (from weights or states
            // that are) stops the run here, naming the step, rather than at its end.
            if !finite(&x).map_err(tensor_err)? {
                return Err(EngineError::NonFinite {
                    what: "latents",
                    stage: format!("denoising step {} of {}", index + 1, r.steps),
                });
            }
            device.synchronize().map_err(tensor_err)?;
            if let Some(steps) = &job.steps {
                let _ = steps.send(StepReport {
                    index,
                    steps: r.steps,
                    timestep,
                    elapsed: start.elapsed(),
                    collectives: comm.stats().snapshot().since(&before).time,
                });
            }
        }
    }
    match rank {
        0 => Ok(Some((x.to_device(&Device::Cpu).map_err(tensor_err)?, Vec::new()))),
        _ => Ok(None),
    }
}

/// An S2V clip's conditioning on this rank.
fn prepare_clip(
    model: &WanRank,
    inputs: &S2vInputs,
    latent_shape: &[usize],
    device: &Device,
) -> tpinfer_layers::Result<S2vClip> {
    let condition = S2vCondition {
        reference: inputs.reference.to_device(device)?,
        motion: inputs.motion.as_ref().map(|m| m.to_device(device)).transpose()?,
        pose: inputs.pose.to_device(device)?,
        audio: model.encode_s2v_audio(&inputs.audio.to_device(device)?)?,
    };
    model.prepare_s2v(latent_shape, &condition)
}
