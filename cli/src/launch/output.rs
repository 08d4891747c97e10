//! Output forwarding: one reader thread per worker pipe, one writer thread that prints whole
//! lines prefixed with `[rank i]`, so that lines from different ranks never mix. The writer also
//! keeps the last lines of every rank, with its error line even when a backtrace followed it
//! ([`LastLines`]; shown again when that rank fails) and, with `--tee`,
//! copies each rank's lines into `rank_<i>.stdout.log` / `rank_<i>.stderr.log`.

use std::collections::{HashMap, VecDeque};
use std::fs::{File, OpenOptions};
use std::io::{BufRead, BufReader, LineWriter, Read, Write};
use std::path::{Path, PathBuf};
use std::sync::mpsc::{sync_channel, Receiver, SyncSender};
use std::sync::{Arc, Mutex};
use std::thread::{self, JoinHandle};
use std::time::{Duration, Instant};

use accelerate_rs::logging::LastLines;

/// How many of each rank's last lines (stdout and stderr together) are kept.
pub(crate) const TAIL_LINES: usize = 20;

/// The last lines of each rank, oldest first (its error line first when it scrolled out).
pub(crate) type Tails = HashMap<usize, VecDeque<String>>;

/// Where `--tee` writes: `dir/rank_<rank>.<stream>.log`.
pub(crate) fn log_path(dir: &Path, rank: usize, stream: Stream) -> PathBuf {
    let name = match stream {
        Stream::Stdout => "stdout",
        Stream::Stderr => "stderr",
    };
    dir.join(format!("rank_{rank}.{name}.log"))
}

/// Opens the log files of `ranks` in `dir` (created if needed): truncated when `append` is
/// false, appended to otherwise (later attempts of a restarted run).
pub(crate) fn open_logs(
    dir: &Path,
    ranks: impl IntoIterator<Item = usize>,
    append: bool,
) -> std::io::Result<HashMap<(usize, Stream), LineWriter<File>>> {
    std::fs::create_dir_all(dir)?;
    let mut files = HashMap::new();
    for rank in ranks {
        for stream in [Stream::Stdout, Stream::Stderr] {
            let file = OpenOptions::new()
                .create(true)
                .write(true)
                .append(append)
                .truncate(!append)
                .open(log_path(dir, rank, stream))?;
            files.insert((rank, stream), LineWriter::new(file));
        }
    }
    Ok(files)
}

/// Longest line forwarded in one piece; longer lines are cut into several prefixed lines.
const MAX_LINE: usize = 1 << 20;
/// Lines buffered between the readers and the writer before readers wait (back-pressure).
const QUEUE: usize = 4096;

/// Which of the launcher's streams a line goes to.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
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
    tails: Arc<Mutex<HashMap<usize, LastLines>>>,
}

impl Forwarder {
    /// Starts the writer thread; `logs` are the `--tee` files (empty without `--tee`).
    pub(crate) fn start(logs: HashMap<(usize, Stream), LineWriter<File>>) -> std::io::Result<Self> {
        let (tx, rx) = sync_channel(QUEUE);
        let tails = Arc::new(Mutex::new(HashMap::new()));
        let t = Arc::clone(&tails);
        let writer = thread::Builder::new()
            .name("launch-output".into())
            .spawn(move || write_lines(rx, logs, &t))?;
        Ok(Forwarder {
            tx: Some(tx),
            readers: Vec::new(),
            writer,
            tails,
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
    /// Returns the last [`TAIL_LINES`] lines of every rank.
    pub(crate) fn finish(mut self, timeout: Duration) -> Tails {
        drop(self.tx.take());
        let deadline = Instant::now()
            .checked_add(timeout)
            .unwrap_or_else(Instant::now);
        while !self.writer.is_finished() && Instant::now() < deadline {
            thread::sleep(Duration::from_millis(5));
        }
        if !self.writer.is_finished() {
            log::warn!(
                "launch: a worker's output pipe is still open after all workers exited \
                 (a process it started?); not waiting for it"
            );
            return take_tails(&self.tails);
        }
        for reader in self.readers {
            let _ = reader.join();
        }
        let _ = self.writer.join();
        take_tails(&self.tails)
    }
}

fn take_tails(tails: &Mutex<HashMap<usize, LastLines>>) -> Tails {
    let tails = std::mem::take(&mut *tails.lock().unwrap_or_else(|p| p.into_inner()));
    tails
        .into_iter()
        .map(|(rank, t)| (rank, t.lines().into()))
        .collect()
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

/// Writes each line whole, prefixed, to the launcher's stdout or stderr, flushing after each,
/// and unprefixed to the rank's log file if there is one; remembers the last lines per rank.
/// Write errors (e.g. a closed terminal) are ignored so that workers are never blocked.
fn write_lines(
    rx: Receiver<Line>,
    mut logs: HashMap<(usize, Stream), LineWriter<File>>,
    tails: &Mutex<HashMap<usize, LastLines>>,
) {
    let mut buf = Vec::with_capacity(1024);
    let mut failed_logs = false;
    for line in rx {
        if let Some(file) = logs.get_mut(&(line.rank, line.stream)) {
            let written = file
                .write_all(line.text.as_bytes())
                .and_then(|()| file.write_all(b"\n"));
            if let Err(e) = written {
                if !failed_logs {
                    log::warn!("launch: writing rank {}'s log file failed: {e}", line.rank);
                    failed_logs = true;
                }
            }
        }
        if let Ok(mut tails) = tails.lock() {
            tails
                .entry(line.rank)
                .or_insert_with(|| LastLines::new(TAIL_LINES))
                .push(&line.text);
        }
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
