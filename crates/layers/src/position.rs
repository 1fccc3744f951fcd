use candle_core::{DType, Device, Tensor};

use crate::Result;

/// The position of a forward pass's first token: on the host, for checks and shapes, and in a
/// one-element u32 tensor on the device that the rotary and attention kernels read when they
/// run, so that a decode step captured once as a CUDA graph replays at every position.
pub struct Position {
    value: usize,
    device: Tensor,
}

impl Position {
    /// Position 0 on `device`.
    pub fn new(device: &Device) -> Result<Self> {
        Ok(Self {
            value: 0,
            device: Tensor::zeros(1, DType::U32, device)?,
        })
    }

    /// Moves to `value`: an in-place write, ordered on the device's stream after the work
    /// already queued (which still sees the old value).
    pub fn set(&mut self, value: usize) -> Result<()> {
        let on_device =
            u32::try_from(value).map_err(|_| candle_core::Error::Msg(format!("position {value} exceeds u32")))?;
        tpinfer_kernels::write_u32s(&self.device, &[on_device])?;
        self.value = value;
        Ok(())
    }

    pub fn value(&self) -> usize {
        self.value
    }

    /// The device copy, for kernels.
    pub fn tensor(&self) -> &Tensor {
        &self.device
    }
}
