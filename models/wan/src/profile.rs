use std::cell::RefCell;
use std::time::{Duration, Instant};

use candle_core::Device;
use tpinfer_layers::Result;

/// Wall time per named stage of a forward, each stage ended by a device synchronization, so
/// that asynchronous GPU work is charged to the stage that launched it. Stages of the same
/// name add up over blocks.
pub struct StageTimes {
    device: Device,
    state: RefCell<(Instant, Vec<(&'static str, Duration)>)>,
}

impl StageTimes {
    pub fn new(device: &Device) -> Self {
        Self {
            device: device.clone(),
            state: RefCell::new((Instant::now(), Vec::new())),
        }
    }

    /// Starts the clock over, keeping nothing recorded.
    pub fn reset(&self) -> Result<()> {
        self.device.synchronize()?;
        *self.state.borrow_mut() = (Instant::now(), Vec::new());
        Ok(())
    }

    /// Charges the time since the previous mark to `stage`.
    pub(crate) fn mark(&self, stage: &'static str) -> Result<()> {
        self.device.synchronize()?;
        let mut state = self.state.borrow_mut();
        let (last, stages) = &mut *state;
        let now = Instant::now();
        let spent = now - *last;
        *last = now;
        match stages.iter_mut().find(|(name, _)| *name == stage) {
            Some((_, total)) => *total += spent,
            None => stages.push((stage, spent)),
        }
        Ok(())
    }

    /// Each stage's total, in first-seen order.
    pub fn stages(&self) -> Vec<(&'static str, Duration)> {
        self.state.borrow().1.clone()
    }
}
