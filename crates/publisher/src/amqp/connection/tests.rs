//! The connection against a scripted broker on a real socket (TCP loopback). The
//! broker runs on a thread of its own, so what the connection costs in CPU is the
//! test thread's alone; every wait on either side is bounded, so a broken
//! connection fails a test instead of hanging it.
//!
//! - `broker.rs`: the scripted broker (its half of the handshake and of a channel);
//! - `ported.rs`: the scripted-broker tests of the old publishing connection
//!   (framing, returns in pieces, a closed channel renumbered, a closed connection
//!   after the confirms before it, heartbeats, a refused login);
//! - `io.rs`: the I/O loop's defects of issue 40 (1 CPU spin, 2 memory given
//!   back, 3 a given-up connection closed, 5 frames behind a reply);
//! - `protocol.rs`: the protocol's (6 tags, 7 interleaved content, 8 limits, 9
//!   login errors and `connection.secure`, messages AMQP cannot frame);
//! - `topology.rs`: the declarations and bindings of `[topology]`, and a 406;
//! - `edges.rs`: issue 49's (heartbeat negotiation, request and confirm deadlines,
//!   `channel.flow`, a reply kept, an IPv6 literal, TCP keepalive).

mod broker;
mod edges;
mod io;
mod ported;
mod protocol;
mod topology;
