//! The commands of docs/design.md §6, each over the loaded
//! [`Config`](crate::config::Config).

pub mod check;
pub mod completions;
pub mod ctl;
pub mod peek;
pub mod replay;
pub mod run;
pub mod skip;
pub mod slot;
pub mod standby;
pub mod status;
