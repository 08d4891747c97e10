//! Launcher.
