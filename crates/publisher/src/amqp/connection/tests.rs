//! The connection against a scripted broker on a real socket.
