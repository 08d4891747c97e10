//! Trackers (JSON Lines, TensorBoard), main-process-only semantics, progress bar, logging init.

use std::path::{Path, PathBuf};

use accelerate_rs::tracking::{
    self, HParamValue, HParams, JsonlTracker, Progress, TensorBoardTracker, Tracker, Trackers,
};
use accelerate_rs::{logging, Accelerator};

#[test]
fn jsonl_writes_one_object_per_line() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("sub/metrics.jsonl");
    let mut t = JsonlTracker::create(&path).unwrap();
    t.log(&[("loss", 0.5), ("lr", 0.01)], 1).unwrap();
    // Visible before flush: each log is written at once.
    t.log(&[("loss", 0.25), ("nan", f64::NAN)], 2).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    let lines: Vec<&str> = text.lines().collect();
    assert_eq!(lines.len(), 2, "{text}");
    assert!(
        lines[0].starts_with("{\"step\":1,\"time\":"),
        "{}",
        lines[0]
    );
    let a: serde_json::Value = serde_json::from_str(lines[0]).unwrap();
    assert_eq!(a["step"], 1);
    assert_eq!(a["loss"], 0.5);
    assert_eq!(a["lr"], 0.01);
    let time = a["time"].as_f64().unwrap();
    assert!(time > 1.6e9, "{time}");
    let b: serde_json::Value = serde_json::from_str(lines[1]).unwrap();
    assert_eq!(b["step"], 2);
    assert_eq!(b["loss"], 0.25);
    assert!(b["nan"].is_null());
    t.flush().unwrap();

    // Reserved names are rejected, naming the file.
    let err = t.log(&[("step", 1.0)], 3).unwrap_err().to_string();
    assert!(err.contains("metrics.jsonl"), "{err}");
}

#[test]
fn jsonl_error_names_the_file() {
    let dir = tempfile::tempdir().unwrap();
    let blocker = dir.path().join("file");
    std::fs::write(&blocker, b"x").unwrap();
    let err = JsonlTracker::create(blocker.join("m.jsonl"))
        .unwrap_err()
        .to_string();
    assert!(err.contains(&blocker.display().to_string()), "{err}");
}

// ---- an independent TFRecord / protobuf reader ----

fn crc32c_bitwise(data: &[u8]) -> u32 {
    let mut crc = !0u32;
    for &b in data {
        crc ^= b as u32;
        for _ in 0..8 {
            let mask = (crc & 1).wrapping_neg();
            crc = (crc >> 1) ^ (0x82F6_3B78 & mask);
        }
    }
    !crc
}

fn masked(data: &[u8]) -> u32 {
    let c = crc32c_bitwise(data);
    c.rotate_right(15).wrapping_add(0xa282_ead8)
}

fn read_records(path: &Path) -> Vec<Vec<u8>> {
    let bytes = std::fs::read(path).unwrap();
    let mut pos = 0;
    let mut out = Vec::new();
    while pos < bytes.len() {
        let len_bytes = &bytes[pos..pos + 8];
        let len = u64::from_le_bytes(len_bytes.try_into().unwrap()) as usize;
        let len_crc = u32::from_le_bytes(bytes[pos + 8..pos + 12].try_into().unwrap());
        assert_eq!(len_crc, masked(len_bytes), "length crc at {pos}");
        let data = &bytes[pos + 12..pos + 12 + len];
        let data_crc =
            u32::from_le_bytes(bytes[pos + 12 + len..pos + 16 + len].try_into().unwrap());
        assert_eq!(data_crc, masked(data), "data crc at {pos}");
        out.push(data.to_vec());
        pos += 16 + len;
    }
    assert_eq!(pos, bytes.len());
    out
}

fn varint(buf: &[u8], pos: &mut usize) -> u64 {
    let mut v = 0u64;
    let mut shift = 0;
    loop {
        let b = buf[*pos];
        *pos += 1;
        v |= u64::from(b & 0x7f) << shift;
        if b < 0x80 {
            return v;
        }
        shift += 7;
    }
}

enum Field<'a> {
    Varint(u64),
    Fixed64([u8; 8]),
    Bytes(&'a [u8]),
    Fixed32([u8; 4]),
}

fn fields(buf: &[u8]) -> Vec<(u64, Field<'_>)> {
    let mut pos = 0;
    let mut out = Vec::new();
    while pos < buf.len() {
        let key = varint(buf, &mut pos);
        let f = match key & 7 {
            0 => Field::Varint(varint(buf, &mut pos)),
            1 => {
                pos += 8;
                Field::Fixed64(buf[pos - 8..pos].try_into().unwrap())
            }
            2 => {
                let n = varint(buf, &mut pos) as usize;
                pos += n;
                Field::Bytes(&buf[pos - n..pos])
            }
            5 => {
                pos += 4;
                Field::Fixed32(buf[pos - 4..pos].try_into().unwrap())
            }
            w => panic!("unexpected wire type {w}"),
        };
        out.push((key >> 3, f));
    }
    out
}

#[derive(Debug, Default)]
struct Event {
    wall_time: f64,
    step: i64,
    file_version: Option<String>,
    values: Vec<(String, f32)>,
}

fn decode_event(buf: &[u8]) -> Event {
    let mut e = Event::default();
    for (n, f) in fields(buf) {
        match (n, f) {
            (1, Field::Fixed64(b)) => e.wall_time = f64::from_le_bytes(b),
            (2, Field::Varint(v)) => e.step = v as i64,
            (3, Field::Bytes(b)) => e.file_version = Some(String::from_utf8(b.to_vec()).unwrap()),
            (5, Field::Bytes(summary)) => {
                for (n, f) in fields(summary) {
                    let (1, Field::Bytes(value)) = (n, f) else {
                        panic!("summary field {n}")
                    };
                    let mut tag = String::new();
                    let mut v = f32::NAN;
                    for (n, f) in fields(value) {
                        match (n, f) {
                            (1, Field::Bytes(b)) => tag = String::from_utf8(b.to_vec()).unwrap(),
                            (2, Field::Fixed32(b)) => v = f32::from_le_bytes(b),
                            (n, _) => panic!("value field {n}"),
                        }
                    }
                    e.values.push((tag, v));
                }
            }
            (n, _) => panic!("event field {n}"),
        }
    }
    e
}

fn event_files(dir: &Path) -> Vec<PathBuf> {
    std::fs::read_dir(dir)
        .unwrap()
        .map(|e| e.unwrap().path())
        .filter(|p| {
            p.file_name()
                .unwrap()
                .to_string_lossy()
                .starts_with("events.out.tfevents.")
        })
        .collect()
}

#[test]
fn tensorboard_round_trip() {
    let dir = tempfile::tempdir().unwrap();
    let logdir = dir.path().join("tb");
    let mut t = TensorBoardTracker::create(&logdir).unwrap();
    t.log(&[("loss", 0.5), ("acc", 0.75)], 10).unwrap();
    t.log(&[("loss", 0.125)], 300).unwrap();
    t.flush().unwrap();

    let files = event_files(&logdir);
    assert_eq!(files, vec![t.path().to_path_buf()]);
    let name = files[0].file_name().unwrap().to_string_lossy().to_string();
    assert!(
        name.ends_with(&format!(".{}", std::process::id())),
        "{name}"
    );

    let events: Vec<Event> = read_records(&files[0])
        .iter()
        .map(|r| decode_event(r))
        .collect();
    assert_eq!(events.len(), 3);
    assert_eq!(events[0].file_version.as_deref(), Some("brain.Event:2"));
    assert!(events[0].wall_time > 1.6e9);
    assert_eq!(events[1].step, 10);
    assert_eq!(
        events[1].values,
        vec![("loss".to_string(), 0.5), ("acc".to_string(), 0.75)]
    );
    assert_eq!(events[2].step, 300);
    assert_eq!(events[2].values, vec![("loss".to_string(), 0.125)]);
    assert!(events[2].wall_time >= events[1].wall_time);
}

/// Reads the file with TensorBoard itself when it is installed; skipped otherwise.
#[test]
fn tensorboard_reads_our_file_if_installed() {
    let has_tb = std::process::Command::new("python3")
        .args(["-c", "import tensorboard"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !has_tb {
        eprintln!("skipping: python3 with the tensorboard module is not available");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut t = TensorBoardTracker::create(dir.path()).unwrap();
    t.log(&[("loss", 0.5)], 1).unwrap();
    t.log(&[("loss", 0.25)], 2).unwrap();
    drop(t);
    let script = "import sys\n\
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator\n\
ea = EventAccumulator(sys.argv[1]); ea.Reload()\n\
print(';'.join(f'{e.step}={e.value}' for e in ea.Scalars('loss')))\n";
    let out = std::process::Command::new("python3")
        .args(["-c", script])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(String::from_utf8_lossy(&out.stdout).trim(), "1=0.5;2=0.25");
}

#[test]
fn non_main_process_writes_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let mut trackers = Trackers::for_process(false)
        .jsonl(dir.path().join("m.jsonl"))
        .unwrap()
        .tensorboard(dir.path().join("tb"))
        .unwrap()
        .add_with(|| -> accelerate_rs::Result<JsonlTracker> { panic!("must not be built") })
        .unwrap();
    assert!(!trackers.is_active());
    assert!(trackers.is_empty());
    trackers.log(&[("loss", 1.0)], 0).unwrap();
    trackers.flush().unwrap();
    assert_eq!(std::fs::read_dir(dir.path()).unwrap().count(), 0);
}

#[test]
fn main_process_fans_out() {
    let dir = tempfile::tempdir().unwrap();
    let accelerator = Accelerator::builder().cpu(true).build().unwrap();
    assert!(accelerator.is_main_process());
    let mut trackers = tracking::trackers(&accelerator)
        .jsonl(dir.path().join("m.jsonl"))
        .unwrap()
        .tensorboard(dir.path().join("tb"))
        .unwrap();
    assert_eq!(trackers.len(), 2);
    trackers.log(&[("loss", 1.0)], 0).unwrap();
    trackers.log(&[("loss", 0.5)], 1).unwrap();
    trackers.flush().unwrap();
    let text = std::fs::read_to_string(dir.path().join("m.jsonl")).unwrap();
    assert_eq!(text.lines().count(), 2);
    let files = event_files(&dir.path().join("tb"));
    assert_eq!(files.len(), 1);
    assert_eq!(read_records(&files[0]).len(), 3);
}

#[test]
fn progress_hidden_on_non_main() {
    let p = Progress::new(10, false).forced();
    assert!(p.is_hidden());
    p.inc(3);
    p.set_message("loss 0.1");
    assert_eq!(p.position(), 3);
    p.finish();

    // Under `cargo test` stdout is captured or piped, so even rank 0 hides unless forced.
    let forced = Progress::new(10, true).forced();
    assert!(!forced.is_hidden());
    // Keep the test output clean: stop drawing before the bar is finished.
    forced
        .bar()
        .set_draw_target(indicatif::ProgressDrawTarget::hidden());
    forced.finish();
}

#[test]
fn logging_init_twice_is_ok() {
    let _first = logging::init(Some(3));
    assert!(!logging::init(None), "a second init must be a no-op");
    log::info!("logging works");
}

// ---- hyperparameters ----

fn hparams() -> HParams {
    HParams::new()
        .set("lr", 0.25)
        .set("model", "gpt-4l")
        .set("tied", true)
        .set("batch_size", 8usize)
        .set("lr", 0.5)
}

#[test]
fn jsonl_records_the_hparams_once_as_their_own_line() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("m.jsonl");
    let mut t = JsonlTracker::create(&path).unwrap();
    t.log_hparams(&hparams()).unwrap();
    t.log(&[("loss", 1.0)], 1).unwrap();
    let text = std::fs::read_to_string(&path).unwrap();
    let first: serde_json::Value = serde_json::from_str(text.lines().next().unwrap()).unwrap();
    assert!(first["time"].as_f64().unwrap() > 1.6e9);
    assert!(first.get("step").is_none(), "{first}");
    let hp = &first["hparams"];
    assert_eq!(hp["lr"], 0.5, "a name set again keeps its last value");
    assert_eq!(hp["model"], "gpt-4l");
    assert_eq!(hp["tied"], true);
    assert_eq!(hp["batch_size"], 8.0);
    assert_eq!(hp.as_object().unwrap().len(), 4);
}

/// The hparams event, decoded independently: `_hparams_/session_start_info` with the plugin
/// name, the data class, TensorBoard's null tensor and the `HParamsPluginData` content.
#[test]
fn tensorboard_hparams_event_has_the_plugin_layout() {
    let dir = tempfile::tempdir().unwrap();
    let mut t = TensorBoardTracker::create(dir.path()).unwrap();
    t.log_hparams(&hparams()).unwrap();
    drop(t);
    let records = read_records(&event_files(dir.path())[0]);
    assert_eq!(records.len(), 2);
    let bytes = |f: &Field<'_>| match f {
        Field::Bytes(b) => b.to_vec(),
        _ => panic!("expected bytes"),
    };
    let event = fields(&records[1]);
    let summary = bytes(&event.iter().find(|(n, _)| *n == 5).unwrap().1);
    let value = bytes(&fields(&summary)[0].1);
    let value = fields(&value);
    let tag = bytes(&value.iter().find(|(n, _)| *n == 1).unwrap().1);
    assert_eq!(tag, b"_hparams_/session_start_info");
    let metadata = bytes(&value.iter().find(|(n, _)| *n == 9).unwrap().1);
    let metadata = fields(&metadata);
    assert!(matches!(
        metadata.iter().find(|(n, _)| *n == 4).unwrap().1,
        Field::Varint(2)
    ));
    let plugin = bytes(&metadata.iter().find(|(n, _)| *n == 1).unwrap().1);
    let plugin = fields(&plugin);
    assert_eq!(bytes(&plugin[0].1), b"hparams");
    let content = bytes(&plugin[1].1);
    let start_info = bytes(&fields(&content)[0].1);
    let mut seen = Vec::new();
    for (n, f) in fields(&start_info) {
        if n != 1 {
            continue;
        }
        let entry = bytes(&f);
        let entry = fields(&entry);
        let key = String::from_utf8(bytes(&entry[0].1)).unwrap();
        let value = bytes(&entry[1].1);
        let value = match &fields(&value)[0] {
            (2, Field::Fixed64(b)) => format!("{}", f64::from_le_bytes(*b)),
            (3, Field::Bytes(b)) => String::from_utf8(b.to_vec()).unwrap(),
            (4, Field::Varint(v)) => format!("{}", *v == 1),
            (n, _) => panic!("value kind {n}"),
        };
        seen.push(format!("{key}={value}"));
    }
    assert_eq!(
        seen,
        ["lr=0.5", "model=gpt-4l", "tied=true", "batch_size=8"]
    );
}

/// TensorBoard itself reads the hparams back (its event reader and the hparams plugin's own
/// protobuf) when it is installed; skipped otherwise.
#[test]
fn tensorboard_reads_our_hparams_if_installed() {
    let has_tb = std::process::Command::new("python3")
        .args(["-c", "import tensorboard.plugins.hparams.plugin_data_pb2"])
        .output()
        .map(|o| o.status.success())
        .unwrap_or(false);
    if !has_tb {
        eprintln!("skipping: python3 with the tensorboard module is not available");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let mut t = TensorBoardTracker::create(dir.path()).unwrap();
    t.log_hparams(&hparams()).unwrap();
    t.log(&[("loss", 0.5)], 1).unwrap();
    drop(t);
    let script = "import sys\n\
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator\n\
from tensorboard.plugins.hparams import plugin_data_pb2\n\
ea = EventAccumulator(sys.argv[1]); ea.Reload()\n\
content = ea.PluginTagToContent('hparams')['_hparams_/session_start_info']\n\
data = plugin_data_pb2.HParamsPluginData.FromString(content)\n\
hp = data.session_start_info.hparams\n\
print(hp['lr'].number_value, hp['model'].string_value, hp['tied'].bool_value, hp['batch_size'].number_value)\n\
print(data.session_start_info.start_time_secs > 1.6e9, [e.value for e in ea.Scalars('loss')])\n";
    let out = std::process::Command::new("python3")
        .args(["-c", script])
        .arg(dir.path())
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(
        String::from_utf8_lossy(&out.stdout).trim(),
        "0.5 gpt-4l True 8.0\nTrue [0.5]"
    );
}

#[test]
fn the_run_settings_are_hparams_and_the_set_fans_them_out() {
    let dir = tempfile::tempdir().unwrap();
    let accelerator = Accelerator::builder()
        .cpu(true)
        .gradient_accumulation_steps(2)
        .build()
        .unwrap();
    let hp = HParams::of_run(&accelerator).set("lr", 1e-3);
    assert_eq!(hp.get("world_size"), Some(&HParamValue::Number(1.0)));
    assert_eq!(
        hp.get("gradient_accumulation_steps"),
        Some(&HParamValue::Number(2.0))
    );
    assert_eq!(
        hp.get("mixed_precision"),
        Some(&HParamValue::Text("no".into()))
    );
    let mut trackers = tracking::trackers(&accelerator)
        .jsonl(dir.path().join("m.jsonl"))
        .unwrap()
        .tensorboard(dir.path().join("tb"))
        .unwrap();
    trackers.log_hparams(&hp).unwrap();
    let text = std::fs::read_to_string(dir.path().join("m.jsonl")).unwrap();
    assert!(
        text.contains("\"zero_stage\":0.0") && text.contains("\"lr\":0.001"),
        "{text}"
    );
    assert_eq!(
        read_records(&event_files(&dir.path().join("tb"))[0]).len(),
        2
    );
    // Nothing on another rank.
    let mut idle = Trackers::for_process(false);
    idle.log_hparams(&hp).unwrap();
}

/// The step timer on a real (one-process) training loop: the phases add up to the step, and the
/// metrics reach the trackers.
#[test]
fn the_step_timer_splits_a_real_step_and_logs_it() {
    use candle_core::{DType, Module, Tensor};
    use candle_nn::{linear, loss, Optimizer, VarMap, SGD};
    let accelerator = Accelerator::builder().cpu(true).build().unwrap();
    let varmap = VarMap::new();
    let model = linear(
        64,
        64,
        accelerator.var_builder(&varmap, DType::F32).pp("fc"),
    )
    .unwrap();
    accelerator.prepare_model(&varmap).unwrap();
    let mut opt = accelerator.prepare_optimizer(SGD::new(varmap.all_vars(), 0.01).unwrap());
    let x = Tensor::ones((256, 64), DType::F32, accelerator.device()).unwrap();
    let mut timer = accelerator
        .step_timer()
        .tokens_per_step(256)
        .flops_per_step(6.0 * 64.0 * 64.0 * 256.0);
    let dir = tempfile::tempdir().unwrap();
    let mut trackers = tracking::trackers(&accelerator)
        .jsonl(dir.path().join("m.jsonl"))
        .unwrap();
    for step in 0..3 {
        timer.start();
        let l = loss::mse(&model.forward(&x).unwrap(), &x).unwrap();
        opt.backward_step(&l).unwrap();
        let t = timer.stop().unwrap();
        assert!(t.backward > std::time::Duration::ZERO, "{t:?}");
        assert!(t.optimizer > std::time::Duration::ZERO, "{t:?}");
        // Alone: nothing to communicate.
        assert_eq!(t.communication, std::time::Duration::ZERO, "{t:?}");
        assert!(t.forward + t.backward + t.optimizer <= t.step, "{t:?}");
        assert!(t.tokens_per_sec.unwrap() > 0.0 && t.flops_per_sec.unwrap() > 0.0);
        trackers.log(&t.metrics(), step).unwrap();
    }
    let text = std::fs::read_to_string(dir.path().join("m.jsonl")).unwrap();
    assert_eq!(text.lines().count(), 3);
    assert!(
        text.contains("\"time/backward_ms\"") && text.contains("\"throughput/flops_per_sec\""),
        "{text}"
    );
}
