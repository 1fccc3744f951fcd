//! SMs held busy for a while (cuda/hold.cu), so that a benchmark can ask how a bandwidth-bound
//! kernel runs when each SM it gets must carry more bytes a second. With 40 of an H100's 132
//! SMs held, its 3.35 TB/s spread over the other 92 asks of each SM what an H200's 4.8 TB/s
//! asks of each of its 132; nothing else about the GPU changes.

use std::time::Duration;

use candle_core::{Device, Result};

/// `sms` SMs of a CUDA device, each held by one CTA on a stream of its own until the time
/// given has passed.
pub struct SmHold {
    #[cfg(feature = "cuda")]
    ended: candle_core::cuda_backend::cudarc::driver::CudaEvent,
    #[cfg(feature = "cuda")]
    _stream: std::sync::Arc<candle_core::cuda_backend::cudarc::driver::CudaStream>,
}

impl SmHold {
    /// Holds `sms` SMs of `device` for `time`, and returns once the hold has had time to
    /// take them (a launch, then a few ms). At least one SM must stay free. Loading a CUDA
    /// module waits for the whole device to idle, the hold included: run every kernel to be
    /// measured once before the hold starts.
    pub fn start(device: &Device, sms: usize, time: Duration) -> Result<SmHold> {
        if !device.is_cuda() {
            candle_core::bail!("holding SMs needs a CUDA device, not {device:?}");
        }
        #[cfg(feature = "cuda")]
        {
            cuda::start(device, sms, time)
        }
        #[cfg(not(feature = "cuda"))]
        {
            let _ = (sms, time);
            candle_core::bail!("holding SMs needs a CUDA build (the `cuda` feature)")
        }
    }

    /// Whether the SMs are still held: a measurement that ends before this turns false was
    /// taken under the hold.
    pub fn holding(&self) -> Result<bool> {
        #[cfg(feature = "cuda")]
        {
            use candle_core::cuda_backend::WrapErr;
            Ok(!self.ended.try_is_complete().w()?)
        }
        #[cfg(not(feature = "cuda"))]
        Ok(false)
    }

    /// Waits for the hold to run out, so that the next one starts on free SMs.
    pub fn finish(self) -> Result<()> {
        #[cfg(feature = "cuda")]
        {
            use candle_core::cuda_backend::WrapErr;
            self.ended.synchronize().w()?;
        }
        Ok(())
    }
}

#[cfg(feature = "cuda")]
mod cuda {
    use std::time::Duration;

    use candle_core::cuda_backend::cudarc::driver::sys::{CUdevice_attribute, CUfunction_attribute};
    use candle_core::cuda_backend::cudarc::driver::{LaunchConfig, PushKernelArg};
    use candle_core::cuda_backend::WrapErr;
    use candle_core::{Device, Result};

    use super::SmHold;
    use crate::module::HOLD;

    pub(super) fn start(device: &Device, sms: usize, time: Duration) -> Result<SmHold> {
        let dev = device.as_cuda_device()?;
        let context = dev.cuda_stream().context().clone();
        let count = context
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .w()? as usize;
        if sms == 0 || sms >= count {
            candle_core::bail!("cannot hold {sms} of this GPU's {count} SMs: hold 1 to {}", count - 1);
        }
        // All of the shared memory a CTA may take: no other CTA fits on its SM.
        let shared = context
            .attribute(CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN)
            .w()?;
        let kernel = HOLD.kernel(dev, "hold_sm")?;
        kernel
            .set_attribute(
                CUfunction_attribute::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                shared,
            )
            .w()?;
        let stream = context.new_stream().w()?;
        let config = LaunchConfig {
            grid_dim: (sms as u32, 1, 1),
            block_dim: (32, 1, 1),
            shared_mem_bytes: shared as u32,
        };
        let ns = u64::try_from(time.as_nanos()).unwrap_or(u64::MAX);
        let mut launch = kernel.builder_on(&stream);
        launch.arg(&ns);
        // SAFETY: hold_sm takes one u64 and touches no memory.
        unsafe { launch.launch(config) }.w()?;
        let ended = stream.record_event(None).w()?;
        std::thread::sleep(Duration::from_millis(20));
        if ended.try_is_complete().w()? {
            candle_core::bail!("the hold of {sms} SMs for {time:?} ended within 20 ms of its launch");
        }
        Ok(SmHold { ended, _stream: stream })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_cpu_device_has_no_sms_to_hold() {
        let error = SmHold::start(&Device::Cpu, 1, Duration::from_millis(1))
            .err()
            .expect("a hold on the CPU");
        assert!(error.to_string().contains("needs a CUDA device"), "{error}");
    }
}
