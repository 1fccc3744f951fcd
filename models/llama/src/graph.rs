//! The decode step as a CUDA graph. Issued kernel by kernel, a step of Llama-3-8B is some 300
//! launches and 67 collectives, and the host takes longer to issue them than the GPU takes to
//! run them; replayed as one graph, the GPU runs them back to back. The step's shapes do not
//! depend on the position (attention reads the filled length from the device), so one graph
//! serves every step of every request; the host rewrites the position between replays, and
//! the token too unless the previous replay's argmax left it there (greedy decoding).

use candle_core::{DType, Device, Tensor};
use tpinfer_layers::graph::{upload_cache, Graph};
use tpinfer_layers::{write_u32s, Result};

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

impl Stage {
    /// Queues a step of `run` (whose logits a replay leaves in `out`'s first rows): eagerly
    /// the first time, returning its logits; captured and replayed the second, replayed after,
    /// returning `None` (the logits are in `out`). `what` names the step in a capture's error.
    fn step(
        &mut self,
        device: &Device,
        out: &Tensor,
        run: impl Fn() -> Result<Tensor>,
        what: &str,
    ) -> Result<Option<Tensor>> {
        let graph = match std::mem::replace(self, Stage::Cold) {
            Stage::Cold => {
                let _uploads = upload_cache(device)?;
                let logits = run()?;
                *self = Stage::Warm;
                return Ok(Some(logits));
            }
            Stage::Warm => Graph::capture(device, || {
                let logits = run()?;
                Ok::<_, tpinfer_layers::Error>(out.slice_set(&logits, 0, 0)?)
            })
            .map_err(|e| {
                candle_core::Error::Msg(format!(
                    "capturing {what} as a CUDA graph failed ({e}); --enforce-eager runs without graphs"
                ))
            })?,
            Stage::Captured(graph) => graph,
        };
        graph.replay()?;
        *self = Stage::Captured(graph);
        Ok(None)
    }
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
        let run = || model.queue_decode_step();
        match self.stage.step(&device, &self.logits, run, "the decode step")? {
            Some(eager) => Ok(eager),
            None => {
                self.replays += 1;
                Ok(self.logits.clone())
            }
        }
    }

    pub(crate) fn replays(&self) -> usize {
        self.replays
    }
}

/// The continuous-batching step of decode rows alone as CUDA graphs, one per bucket of
/// sequence counts (a step of `n` sequences replays the smallest bucket that holds them, its
/// spare rows idle). The step's inputs live in each bucket's device buffers, rewritten by the
/// host before every replay; the attention kernel's grid depends on the rows alone, never on
/// the sequences' lengths, so one capture serves every step of its bucket.
pub(crate) struct BatchGraphs {
    buckets: std::collections::BTreeMap<usize, BucketGraph>,
    /// Every bucket's logits, `[largest bucket, vocab]` f32: a step's rows come first. One
    /// buffer for all, as the memory plan counts it (`memory::RankMemory::buffers`).
    logits: Tensor,
    device: Device,
    /// Block-table entries per sequence: enough for the longest context.
    table_width: usize,
    block_size: usize,
}

/// One bucket's inputs (as [`crate::model::BatchLayout::decodes`] reads them) and its capture.
struct BucketGraph {
    ids: Tensor,
    positions: Tensor,
    slots: Tensor,
    rows: Tensor,
    tables: Tensor,
    lens: Tensor,
    stage: Stage,
}

/// A spare row's slot: past any pool, so its key and value are never written.
const NO_SLOT: u32 = u32::MAX;

/// Where a batched rank captures its steps, and how large they may be.
pub(crate) struct BatchShape {
    pub max_seqs: usize,
    pub max_positions: usize,
    pub block_size: usize,
    pub vocab: usize,
}

impl BatchGraphs {
    pub(crate) fn new(device: &Device, shape: BatchShape) -> Result<Self> {
        let rows = crate::memory::step_rows(shape.max_seqs.max(1));
        Ok(Self {
            buckets: Default::default(),
            logits: Tensor::zeros((rows, shape.vocab), DType::F32, device)?,
            device: device.clone(),
            table_width: shape.max_positions.div_ceil(shape.block_size),
            block_size: shape.block_size,
        })
    }

    /// Whether a step of `n` decode rows has a bucket (the largest holds `max_seqs`).
    pub(crate) fn covers(&self, n: usize) -> Result<bool> {
        Ok(crate::memory::step_rows(n) <= self.logits.dim(0)?)
    }

    /// Runs the decode step of `chunks` (one token each) as its bucket's graph: eagerly the
    /// first time, captured the second, replayed after. Returns its logits, `[chunks, vocab]`,
    /// a view of the shared buffer that the next replay overwrites.
    pub(crate) fn step(&mut self, model: &LlamaRank, chunks: &[crate::SequenceChunk<'_>]) -> Result<Tensor> {
        let n = chunks.len();
        let rows = crate::memory::step_rows(n);
        let device = self.device.clone();
        let entry = match self.buckets.entry(rows) {
            std::collections::btree_map::Entry::Occupied(e) => e.into_mut(),
            std::collections::btree_map::Entry::Vacant(e) => {
                let u32s = |shape: &[usize]| Tensor::zeros(shape, DType::U32, &device);
                let order: Vec<u32> = (0..rows as u32).collect();
                e.insert(BucketGraph {
                    ids: u32s(&[1, rows])?,
                    positions: u32s(&[rows])?,
                    slots: u32s(&[rows])?,
                    rows: Tensor::new(order.as_slice(), &device)?,
                    tables: u32s(&[rows, self.table_width])?,
                    lens: u32s(&[rows])?,
                    stage: Stage::Cold,
                })
            }
        };
        entry.write(chunks, self.table_width, self.block_size)?;
        let layout =
            crate::model::BatchLayout::decodes(&entry.positions, &entry.slots, &entry.rows, &entry.tables, &entry.lens);
        let run = || model.forward_layout(&entry.ids, &layout, None);
        let what = format!("the batched decode step of {rows} rows");
        let logits = entry.stage.step(&device, &self.logits, run, &what)?;
        Ok(logits.unwrap_or_else(|| self.logits.clone()).narrow(0, 0, n)?)
    }
}

impl BucketGraph {
    /// The host's part of a step: each sequence's token, position, slot, blocks and length
    /// into the buffers; spare rows get no slot and no keys.
    fn write(&self, chunks: &[crate::SequenceChunk<'_>], width: usize, block_size: usize) -> Result<()> {
        let rows = self.lens.dim(0)?;
        let (mut ids, mut positions, mut slots) = (vec![0u32; rows], vec![0u32; rows], vec![NO_SLOT; rows]);
        let (mut tables, mut lens) = (vec![0u32; rows * width], vec![0u32; rows]);
        for (i, c) in chunks.iter().enumerate() {
            let blocks = (c.start + 1).div_ceil(block_size);
            if blocks > width || c.table.blocks.len() < blocks {
                return Err(tpinfer_layers::Error::CacheFull {
                    needed: c.start + 1,
                    capacity: width.min(c.table.blocks.len()) * block_size,
                });
            }
            ids[i] = c.tokens[0];
            positions[i] = c.start as u32;
            slots[i] = c.table.slots(c.start..c.start + 1, block_size)?[0];
            tables[i * width..i * width + blocks].copy_from_slice(&c.table.blocks[..blocks]);
            lens[i] = c.start as u32 + 1;
        }
        write_u32s(&self.ids, &ids)?;
        write_u32s(&self.positions, &positions)?;
        write_u32s(&self.slots, &slots)?;
        write_u32s(&self.tables, &tables)?;
        write_u32s(&self.lens, &lens)?;
        Ok(())
    }
}
