//! Output forwarding: one reader thread per worker pipe, one writer thread that prints whole
//! lines prefixed with `[rank i]`, so that lines from different ranks never mix.

use std::io::{BufRead, BufReader, Read, Write};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

/// Longest line forwarded in one piece; longer lines are cut into several prefixed lines.
const MAX_LINE: usize = 1 << 20;
/// Lines buffered between the readers and the writer before readers wait (back-pressure).
const QUEUE: usize = 4096;

/// Which of the launcher's streams a line goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Stream {
    /// The worker's stdout, printed on the launcher's stdout.
    Stdout,
    /// The worker's stderr, printed on the launcher's stderr.
    Stderr,
}

struct Line {
    rank: usize,
    stream: Stream,
    text: String,
}

/// The running reader and writer threads.
pub(crate) struct Forwarder {
    tx: Option<SyncSender<Line>>,
    readers: Vec<JoinHandle<()>>,
    writer: JoinHandle<()>,
}

impl Forwarder {
    /// Starts the writer thread.
    pub(crate) fn start() -> std::io::Result<Self> {
        let (tx, rx) = sync_channel(QUEUE);
        let writer = thread::Builder::new()
            .name("launch-output".into())
            .spawn(move || write_lines(rx))?;
        Ok(Forwarder {
            tx: Some(tx),
            readers: Vec::new(),
            writer,
        })
    }

    /// Starts a reader thread forwarding `pipe` line by line as `rank`'s `stream`.
    pub(crate) fn attach(
        &mut self,
        rank: usize,
        stream: Stream,
        pipe: impl Read + Send + 'static,
    ) -> std::io::Result<()> {
        let Some(tx) = self.tx.clone() else {
            return Ok(());
        };
        let name = format!("launch-rank{rank}-{stream:?}").to_lowercase();
        let reader = thread::Builder::new()
            .name(name)
            .spawn(move || read_lines(rank, stream, pipe, tx))?;
        self.readers.push(reader);
        Ok(())
    }

    /// Waits until every pipe is closed and every line is written, at most `timeout` (a process a
    /// worker left behind may keep a pipe open forever; its output is then no longer waited for).
    pub(crate) fn finish(mut self, timeout: Duration) {
        drop(self.tx.take());
        let deadline = Instant::now() + timeout;
        while !self.writer.is_finished() && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(5));
        }
        if !self.writer.is_finished() {
            log::warn!(
                "launch: a worker's output pipe is still open after all workers exited \
                 (a process it started?); not waiting for it"
            );
            return;
        }
        for reader in self.readers {
            let _ = reader.join();
        }
        let _ = self.writer.join();
    }
}

/// Reads `pipe` line by line (bytes, lossy UTF-8) and sends each line, without its newline.
fn read_lines(rank: usize, stream: Stream, pipe: impl Read, tx: SyncSender<Line>) {
    let mut reader = BufReader::with_capacity(64 * 1024, pipe);
    let mut buf = Vec::new();
    loop {
        buf.clear();
        match (&mut reader)
            .take(MAX_LINE as u64)
            .read_until(b'\n', &mut buf)
        {
            Ok(0) => break,
            Ok(_) => {
                if buf.last() == Some(&b'\n') {
                    buf.pop();
                }
                let text = String::from_utf8_lossy(&buf).into_owned();
                if tx.send(Line { rank, stream, text }).is_err() {
                    break;
                }
            }
            Err(e) => {
                log::warn!("launch: reading rank {rank}'s {stream:?} failed: {e}");
                break;
            }
        }
    }
}

/// Writes each line whole, prefixed, to the launcher's stdout or stderr, flushing after each.
/// Write errors (e.g. a closed terminal) are ignored so that workers are never blocked.
fn write_lines(rx: Receiver<Line>) {
    let mut buf = Vec::with_capacity(1024);
    for line in rx {
        buf.clear();
        buf.extend_from_slice(format!("[rank {}] ", line.rank).as_bytes());
        buf.extend_from_slice(line.text.as_bytes());
        buf.push(b'\n');
        let _ = match line.stream {
            Stream::Stdout => {
                let mut out = std::io::stdout().lock();
                out.write_all(&buf).and_then(|()| out.flush())
            }
            Stream::Stderr => {
                let mut err = std::io::stderr().lock();
                err.write_all(&buf).and_then(|()| err.flush())
            }
        };
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn collect(input: &[u8]) -> Vec<String> {
        let (tx, rx) = sync_channel(QUEUE);
        let owned = input.to_vec();
        let t = thread::spawn(move || read_lines(3, Stream::Stdout, &owned[..], tx));
        let lines: Vec<String> = rx.iter().map(|l| l.text).collect();
        t.join().unwrap();
        lines
    }

    #[test]
    fn splits_lines_and_keeps_a_last_line_without_newline() {
        assert_eq!(collect(b"a\n\nb\nlast"), ["a", "", "b", "last"]);
        assert!(collect(b"").is_empty());
    }

    #[test]
    fn invalid_utf8_is_replaced() {
        assert_eq!(collect(b"x\xffy\n"), ["x\u{fffd}y"]);
    }

    #[test]
    fn very_long_lines_are_cut() {
        let mut input = vec![b'z'; MAX_LINE + 10];
        input.push(b'\n');
        let lines = collect(&input);
        assert_eq!(lines.len(), 2);
        assert_eq!(lines[0].len(), MAX_LINE);
        assert_eq!(lines[1].len(), 10);
    }
}
