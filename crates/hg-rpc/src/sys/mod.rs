//! The crate's only unsafe code: registering the engine's epoll fd with
//! tokio, whose `AsyncFd::register` requires the caller to keep the fd open,
//! and calling the CPU's CRC instruction once it is known to exist.

pub mod async_fd;
pub mod crc32c;
