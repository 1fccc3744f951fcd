//! Work every rank runs alike, whose result rank 0 hands back on the host.

use candle_core::{Device, Tensor};
use tpinfer_runtime::{Rank, RankGroup, RuntimeError};

use crate::EngineError;

/// Runs `task` on every rank of `group` and returns rank 0's tensor on the CPU (every rank
/// computes the same; the others' are dropped there). `what` names it in an error.
pub(crate) fn rank0_on_host<F>(group: &RankGroup, what: &'static str, task: F) -> Result<Tensor, EngineError>
where
    F: Fn(&mut Rank) -> Result<Tensor, EngineError> + Send + Sync + 'static,
{
    let results = group.run(move |rank| -> Result<Option<Tensor>, EngineError> {
        let r = rank.env.rank;
        let tensor = task(rank)?;
        match r {
            0 => Ok(Some(
                tensor
                    .to_device(&Device::Cpu)
                    .map_err(|e| RuntimeError::of_rank(r, e.into()))?,
            )),
            _ => Ok(None),
        }
    })?;
    results
        .into_iter()
        .flatten()
        .next()
        .ok_or_else(|| RuntimeError::Stopped(format!("rank 0 returned no {what}")).into())
}
