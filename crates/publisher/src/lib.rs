//! publisher
