//! Data loading.
