//! The decode step as a CUDA graph. Issued kernel by kernel, a step of Llama-3-8B is some 300
//! launches and 67 collectives, and the host takes longer to issue them than the GPU takes to
//! run them; replayed as one graph, the GPU runs them back to back. The step's shapes do not
//! depend on the position (attention reads the filled length from the device), so one graph
//! serves every step of every request; the host rewrites the position between replays, and
//! the token too unless the previous replay's argmax left it there (greedy decoding).

use candle_core::{DType, Device, Tensor};
use tpinfer_layers::graph::{upload_cache, Graph};
use tpinfer_layers::Result;

use crate::LlamaRank;

pub(crate) struct DecodeGraph {
    /// The logits, `[1, vocab]` f32: the graph's output beside the step's own buffers.
    logits: Tensor,
    stage: Stage,
    /// Steps run as replays so far.
    replays: usize,
}

enum Stage {
    /// No step has run yet.
    Cold,
    /// One step ran eagerly and left in device memory the shapes and strides that candle
    /// would otherwise upload from the host during capture.
    Warm,
    Captured(Graph),
}

impl DecodeGraph {
    /// `None` where graphs do not apply: CPU ranks, and unfused attention, whose shapes grow
    /// with the position.
    pub(crate) fn new(device: &Device, flash: bool, vocab: usize) -> Result<Option<Self>> {
        if !device.is_cuda() || !flash {
            return Ok(None);
        }
        Ok(Some(Self {
            logits: Tensor::zeros((1, vocab), DType::F32, device)?,
            stage: Stage::Cold,
            replays: 0,
        }))
    }

    /// Queues `model`'s decode step ([`LlamaRank::queue_decode_step`]): eagerly on the first
    /// step, captured and replayed on the second, replayed after that. Returns the logits: on
    /// a replay, the graph's output buffer, which the next replay overwrites.
    pub(crate) fn step(&mut self, model: &LlamaRank) -> Result<Tensor> {
        let device = self.logits.device().clone();
        let graph = match std::mem::replace(&mut self.stage, Stage::Cold) {
            Stage::Cold => {
                let _uploads = upload_cache(&device)?;
                let logits = model.queue_decode_step()?;
                self.stage = Stage::Warm;
                return Ok(logits);
            }
            Stage::Warm => Graph::capture(&device, || {
                let logits = model.queue_decode_step()?;
                Ok::<_, tpinfer_layers::Error>(self.logits.slice_set(&logits, 0, 0)?)
            })
            .map_err(|e| {
                candle_core::Error::Msg(format!(
                    "capturing the decode step as a CUDA graph failed ({e}); --enforce-eager runs without graphs"
                ))
            })?,
            Stage::Captured(graph) => graph,
        };
        graph.replay()?;
        self.replays += 1;
        self.stage = Stage::Captured(graph);
        Ok(self.logits.clone())
    }

    pub(crate) fn replays(&self) -> usize {
        self.replays
    }
}
