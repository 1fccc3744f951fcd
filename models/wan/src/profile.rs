use std::cell::RefCell;
use std::time::{Duration, Instant};

use candle_core::Device;
use tpinfer_layers::Result;

/// Time per named stage of a forward. On CUDA each stage ends with an event recorded on the
/// stream, read after the forward, so the device never waits inside it: synchronizing at every
/// stage would stall the launch queue and let the stream-ordered allocator return its memory
/// at each sync, charging re-allocation to whichever stage allocates next. On CPU (where ops
/// run as they are called) the host clock serves. Stages of the same name add up over blocks.
pub struct StageTimes {
    device: Device,
    marks: RefCell<(Mark, Vec<(&'static str, Mark)>)>,
}

/// A point in the stream's work (CUDA) or in host time.
enum Mark {
    Host(Instant),
    #[cfg(feature = "cuda")]
    Device(candle_core::cuda_backend::cudarc::driver::CudaEvent),
}

impl Mark {
    fn now(device: &Device) -> Result<Self> {
        match device {
            #[cfg(feature = "cuda")]
            Device::Cuda(cuda) => {
                use candle_core::cuda_backend::cudarc::driver::sys::CUevent_flags;
                use candle_core::cuda_backend::WrapErr;
                let event = cuda
                    .cuda_stream()
                    .record_event(Some(CUevent_flags::CU_EVENT_DEFAULT))
                    .w()?;
                Ok(Self::Device(event))
            }
            _ => Ok(Self::Host(Instant::now())),
        }
    }

    /// The time from `earlier` to this mark (both recorded on the same device).
    fn since(&self, earlier: &Mark) -> Result<Duration> {
        match (earlier, self) {
            (Self::Host(a), Self::Host(b)) => Ok(*b - *a),
            #[cfg(feature = "cuda")]
            (Self::Device(a), Self::Device(b)) => {
                use candle_core::cuda_backend::WrapErr;
                Ok(Duration::from_secs_f64(f64::from(a.elapsed_ms(b).w()?) / 1e3))
            }
            #[cfg(feature = "cuda")]
            _ => Err(candle_core::Error::Msg("stage marks from different devices".into()).into()),
        }
    }
}

impl StageTimes {
    pub fn new(device: &Device) -> Result<Self> {
        Ok(Self {
            device: device.clone(),
            marks: RefCell::new((Mark::now(device)?, Vec::new())),
        })
    }

    /// Starts the clock over, keeping nothing recorded.
    pub fn reset(&self) -> Result<()> {
        *self.marks.borrow_mut() = (Mark::now(&self.device)?, Vec::new());
        Ok(())
    }

    /// Ends `stage` here: it is charged the time since the previous mark.
    pub(crate) fn mark(&self, stage: &'static str) -> Result<()> {
        let mark = Mark::now(&self.device)?;
        self.marks.borrow_mut().1.push((stage, mark));
        Ok(())
    }

    /// Each stage's total, in first-seen order (waits for the device to finish the work).
    pub fn stages(&self) -> Result<Vec<(&'static str, Duration)>> {
        self.device.synchronize()?;
        let marks = self.marks.borrow();
        let (start, stages) = &*marks;
        let mut totals: Vec<(&'static str, Duration)> = Vec::new();
        let mut previous = start;
        for (stage, mark) in stages {
            let spent = mark.since(previous)?;
            previous = mark;
            match totals.iter_mut().find(|(name, _)| name == stage) {
                Some((_, total)) => *total += spent,
                None => totals.push((stage, spent)),
            }
        }
        Ok(totals)
    }
}
