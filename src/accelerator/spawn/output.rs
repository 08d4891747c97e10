//! The self-launch's output: one thread per worker pipe, printing each line whole with a
//! `[rank i]` prefix (one write under the stream's lock, so lines of different ranks never mix)
//! and keeping each rank's [`LastLines`] for the failure report.

use std::collections::HashMap;
use std::io::{BufRead, BufReader, Read, Write};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use crate::logging::LastLines;

/// How many of a rank's last lines the failure report shows.
const TAIL_LINES: usize = 20;
/// Longest line forwarded in one piece; longer ones are cut.
const MAX_LINE: u64 = 1 << 20;

/// The reader threads of every worker and the lines they kept.
#[derive(Default)]
pub(super) struct Output {
    readers: Vec<JoinHandle<()>>,
    tails: Arc<Mutex<HashMap<usize, LastLines>>>,
}

impl Output {
    /// Forwards `pipe` (rank `rank`'s stdout when `to_stdout`, else its stderr) line by line.
    pub(super) fn attach(
        &mut self,
        rank: usize,
        to_stdout: bool,
        pipe: impl Read + Send + 'static,
    ) -> std::io::Result<()> {
        let tails = Arc::clone(&self.tails);
        let reader = std::thread::Builder::new()
            .name(format!("accelerate-rs-output-{rank}"))
            .spawn(move || forward(rank, to_stdout, pipe, &tails))?;
        self.readers.push(reader);
        Ok(())
    }

    /// Waits (at most `timeout`: a process a worker left behind may hold a pipe open) until every
    /// pipe is closed and its lines printed, then returns every rank's last lines.
    pub(super) fn finish(self, timeout: Duration) -> HashMap<usize, LastLines> {
        let deadline = Instant::now() + timeout;
        while self.readers.iter().any(|r| !r.is_finished()) && Instant::now() < deadline {
            std::thread::sleep(Duration::from_millis(5));
        }
        let mut tails = self.tails.lock().unwrap_or_else(|p| p.into_inner());
        std::mem::take(&mut *tails)
    }
}

/// Reads `pipe` until it closes, printing every line with its rank's prefix.
fn forward(
    rank: usize,
    to_stdout: bool,
    pipe: impl Read,
    tails: &Mutex<HashMap<usize, LastLines>>,
) {
    let mut reader = BufReader::new(pipe);
    let mut buf = Vec::new();
    loop {
        buf.clear();
        match (&mut reader).take(MAX_LINE).read_until(b'\n', &mut buf) {
            Ok(0) | Err(_) => return,
            Ok(_) => {}
        }
        if buf.last() == Some(&b'\n') {
            buf.pop();
        }
        let text = String::from_utf8_lossy(&buf);
        tails
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .entry(rank)
            .or_insert_with(|| LastLines::new(TAIL_LINES))
            .push(&text);
        let line = format!("[rank {rank}] {text}\n");
        // A closed terminal must not block the workers: write errors are ignored.
        let _ = if to_stdout {
            let mut out = std::io::stdout().lock();
            out.write_all(line.as_bytes()).and_then(|()| out.flush())
        } else {
            std::io::stderr().lock().write_all(line.as_bytes())
        };
    }
}
