//! The crate's only unsafe code: registering the engine's epoll fd with
//! tokio, whose `AsyncFd::register` requires the caller to keep the fd open.

pub mod async_fd;
