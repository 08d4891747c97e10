//! Collectives.
