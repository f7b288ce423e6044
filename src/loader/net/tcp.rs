//! [`TcpRx`]: the TCP data path. A node's bytes come as DATA frames on the
//! control connection itself, so everything happens in `socket.rs`: each
//! DATA header is checked against its outstanding grant (id, node, offset,
//! length) before its payload is received straight into the granted range
//! of the ring, and a frame that matches no grant drops the connection
//! before a byte of its payload is read. There is nothing to open, flush,
//! close or poll: every method here is a no-op the compiler removes.

use std::os::fd::RawFd;

use super::{ConnectError, Event, Receive, NONE};
use crate::error::Result;

/// The TCP data path of one connection (no state of its own).
pub(crate) struct TcpRx;

impl Receive for TcpRx {
    type Common = ();
    const FRAMED: bool = true;

    fn redial_common(_: &()) -> Option<()> {
        Some(())
    }

    /// Nothing to set up: a node's bytes come on the control connection.
    type Pending = ();
    const EXCHANGE: &'static str = "nothing";

    fn begin(
        _: &(),
        _: std::net::IpAddr,
        _: u32,
        _: &str,
    ) -> Result<((), Option<Vec<u8>>), ConnectError> {
        Ok(((), None))
    }

    fn finish(
        _: &(),
        _: (),
        _: Option<(&crate::transport::proto::Header, &[u8])>,
        _: u32,
        _: &str,
    ) -> Result<Self, ConnectError> {
        Ok(TcpRx)
    }

    fn wake_fd(_: &()) -> Option<RawFd> {
        None
    }

    /// Nothing completes besides the ring's operations.
    type Wc = ();

    fn poll_shared(_: &(), _: &mut [()]) -> Option<Result<usize>> {
        None
    }

    fn route_shared(_: &(), _: &[()], _: &mut [u32]) {}

    fn refill_shared(_: &(), _: &[()]) -> Result<()> {
        Ok(())
    }

    fn take_shared(&mut self, _: &()) -> Option<Event> {
        None
    }

    fn arm_shared(_: &()) -> Result<bool> {
        Ok(false)
    }

    fn retire_when_dead(_: &()) -> bool {
        false
    }

    fn woke(_: &()) {}

    /// Every grant's remote key is 0 (a DATA frame names its grant).
    fn open(&mut self, _: usize, _: usize, _: u64, _: u32) -> Option<(u32, u32)> {
        Some((0, NONE))
    }

    /// A DATA frame names its grant: nothing to register.
    type RingReg = ();

    fn register_ring(_: &(), _: &crate::landing::LandingRing) -> Result<()> {
        Ok(())
    }

    fn wire_offset(_: &(), phys: u64) -> u64 {
        phys
    }

    fn set_ring(&mut self, _: usize, _: Option<&()>) {}

    fn flush(&mut self) -> Result<bool> {
        Ok(false)
    }

    fn flushing(&self) -> bool {
        false
    }

    fn close(&mut self, _: u32) -> Result<()> {
        Ok(())
    }

    fn flush_closes(&mut self) -> Result<()> {
        Ok(())
    }

    fn take_closed(&mut self) -> Option<(u32, u32)> {
        None
    }

    fn shut(&mut self) -> Result<()> {
        Ok(())
    }

    fn idle(&self) -> bool {
        true
    }

    fn arm(&self) -> Result<()> {
        Ok(())
    }

    fn poll(&mut self) -> Result<usize> {
        Ok(0)
    }

    fn take(&mut self, _: usize) -> Event {
        unreachable!("a TCP data path completes nothing on its own (FRAMED)")
    }

    fn refill(&mut self) -> Result<()> {
        Ok(())
    }
}
