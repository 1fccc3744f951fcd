//! The ranks of a tensor-parallel group, shared by every engine.
//!
//! A [`Topology`] says how many ranks there are and on which devices. A [`Launch`] takes the
//! models the ranks will hold (any [`tpinfer_family::Family`]), splits each one once and plans
//! it, and refuses a placement over budget before any rank allocates or joins NCCL. Its
//! [`Launch::start`] spawns one thread per rank, builds the communicators, loads every model
//! and checks each rank's health; the [`RankGroup`] it returns runs tasks on all ranks at
//! once, naming the rank whose failure was the cause.

mod connect;
mod error;
mod group;
mod launch;
mod memory;
mod topology;

pub use error::{RankFailure, RuntimeError};
pub use group::{ModelHandle, Models, Pending, Rank, RankEnv, RankGroup};
pub use launch::{GroupOptions, Launch, CPU_POOL_SHARE};
pub use memory::{
    check_after_request, check_after_step, host_available, measure, reset_peak, DeviceMemory, PLAN_TOLERANCE,
};
pub use topology::{DeviceKind, Topology};
/// The weight bytes a group has loaded, for a progress bar (see [`GroupOptions::progress`]).
pub use tpinfer_weights::LoadProgress;
