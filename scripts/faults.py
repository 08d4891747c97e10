#!/usr/bin/env python3
"""Fault injection against real `accelerate-rs launch --cpu` runs, as a hostile user would do it.

Every scenario starts a real multi-process run on loopback, injects one fault and measures:

  scenario   what was done
  teardown   seconds from the fault to the launcher's exit (or to the last worker's death, when the
             launcher itself was killed); for faults that must not stop the run: the run's length
  leftovers  processes of the run still alive 2 s after the end, and new /dev/shm/accelerate-rs-*
  data lost  what the fault cost (checkpointed steps lost, a corrupted checkpoint loaded, ...)
  verdict    PASS or FAIL, with the reason

and prints one table. Stdlib only. Usage (from the repository root):

    python3 scripts/faults.py                 # builds the release binaries, runs every scenario
    python3 scripts/faults.py --no-build --only kill-rank0,garbage
    python3 scripts/faults.py --list

Exit code 0 when every scenario passed, 1 otherwise.
"""

from __future__ import annotations

import argparse
import glob
import os
import random
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RELEASE = os.path.join(os.environ.get("CARGO_TARGET_DIR", os.path.join(ROOT, "target")), "release")
LAUNCHER = os.path.join(RELEASE, "accelerate-rs")
DIGITS = os.path.join(RELEASE, "examples", "digits")
LM = os.path.join(RELEASE, "examples", "transformer_lm")
# A transformer small enough to checkpoint every step in a few milliseconds.
LM_ARGS = ["--layers", "1", "--d-model", "32", "--heads", "2", "--seq-len", "32", "--batch-size", "4",
           "--log-every", "1", "--eval-batches", "1", "--warmup-steps", "1"]


@dataclass
class Result:
    scenario: str
    teardown: str = "-"
    leftovers: str = "-"
    data_lost: str = "-"
    verdict: str = "FAIL"
    detail: str = ""


@dataclass
class Run:
    """A launcher started in its own session, its output collected by two threads."""

    proc: subprocess.Popen
    out: list = field(default_factory=list)
    err: list = field(default_factory=list)
    start: float = field(default_factory=time.monotonic)

    def text(self) -> str:
        return "".join(self.out) + "".join(self.err)

    def wait(self, limit: float) -> int | None:
        try:
            return self.proc.wait(timeout=limit)
        except subprocess.TimeoutExpired:
            return None


def start(args: list[str], env: dict | None = None, cwd: str | None = None) -> Run:
    e = dict(os.environ)
    e.pop("RUST_LOG", None)
    if env:
        e.update(env)
    p = subprocess.Popen([LAUNCHER, "launch", "--cpu", *args], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, env=e, cwd=cwd, start_new_session=True)
    run = Run(p)
    for stream, sink in ((p.stdout, run.out), (p.stderr, run.err)):
        threading.Thread(target=lambda s=stream, k=sink: k.extend(iter(s.readline, "")),
                         daemon=True).start()
    return run


def children(pid: int) -> list[int]:
    """Direct children of `pid`, from /proc."""
    out = []
    for stat in glob.glob("/proc/[0-9]*/stat"):
        try:
            with open(stat) as f:
                fields = f.read().rsplit(")", 1)[1].split()
            if int(fields[1]) == pid:
                out.append(int(stat.split("/")[2]))
        except (OSError, IndexError, ValueError):
            pass
    return out


def rank_of(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            for kv in f.read().split(b"\0"):
                if kv.startswith(b"RANK="):
                    return int(kv[5:])
    except (OSError, ValueError):
        pass
    return None


def workers(run: Run, n: int, limit: float = 30.0) -> dict[int, int]:
    """rank -> pid of the launcher's `n` workers, once they all run."""
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        ranks = {rank_of(p): p for p in children(run.proc.pid)}
        ranks.pop(None, None)
        if len(ranks) == n:
            return ranks
        time.sleep(0.05)
    raise RuntimeError(f"the launcher did not start {n} workers within {limit} s:\n{run.text()}")


def wait_for_line(run: Run, needle: str, limit: float) -> bool:
    deadline = time.monotonic() + limit
    while time.monotonic() < deadline:
        if needle in run.text():
            return True
        if run.proc.poll() is not None:
            return needle in run.text()
        time.sleep(0.05)
    return False


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def shm_files() -> set[str]:
    return set(glob.glob("/dev/shm/accelerate-rs-*"))


def leftovers(pids: list[int], shm_before: set[str]) -> tuple[str, bool]:
    time.sleep(2.0)
    procs = [p for p in pids if alive(p)]
    for p in procs:
        try:
            os.kill(p, signal.SIGKILL)
        except OSError:
            pass
    shm = shm_files() - shm_before
    text = f"{len(procs)} proc, {len(shm)} shm"
    return text, not procs and not shm


def kill_group(run: Run) -> None:
    try:
        os.killpg(run.proc.pid, signal.SIGKILL)
    except OSError:
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def digits_run(extra: list[str] | None = None, n: int = 2, env: dict | None = None) -> Run:
    return start(["-n", str(n), "--collective-timeout-secs", "10", "--grace-period", "3",
                  *(extra or []), DIGITS, "--epochs", "100000"], env=env)


# --- scenarios ------------------------------------------------------------------------------------

def kill_rank(rank: int, sig: int = signal.SIGKILL, name: str = "") -> Result:
    r = Result(name or f"kill -9 rank {rank} mid-training (3 ranks)")
    shm = shm_files()
    run = digits_run(n=3)
    try:
        pids = workers(run, 3)
        wait_for_line(run, "epoch", 30)
        time.sleep(random.uniform(0.2, 0.8))
        t0 = time.monotonic()
        os.kill(pids[rank], sig)
        code = run.wait(60)
        if code is None:
            r.detail = "the launcher was still running 60 s after the fault"
            return r
        r.teardown = f"{time.monotonic() - t0:.2f} s"
        r.leftovers, clean = leftovers(list(pids.values()), shm)
        r.data_lost = "the run (no checkpoints in this job)"
        text = run.text()
        named = f"rank {rank}" in text
        if code != 0 and clean and named:
            r.verdict = "PASS"
            r.detail = f"exit {code}, the error names rank {rank}"
        else:
            r.detail = f"exit {code}, names rank {rank}: {named}, clean: {clean}"
        return r
    finally:
        kill_group(run)


def stop_rank() -> Result:
    r = kill_rank(1, signal.SIGSTOP, "SIGSTOP rank 1 (3 ranks, 10 s collective timeout)")
    return r


def kill_launcher(sig: int, name: str) -> Result:
    r = Result(name)
    shm = shm_files()
    run = digits_run(n=3)
    try:
        pids = workers(run, 3)
        wait_for_line(run, "epoch", 30)
        t0 = time.monotonic()
        run.proc.send_signal(sig)
        deadline = t0 + 30
        while time.monotonic() < deadline and any(alive(p) for p in pids.values()):
            time.sleep(0.02)
        still = [p for p in pids.values() if alive(p)]
        r.teardown = f"{time.monotonic() - t0:.2f} s"
        run.wait(5)
        r.leftovers, clean = leftovers(list(pids.values()), shm)
        r.data_lost = "the run (no checkpoints in this job)"
        if not still and clean:
            r.verdict = "PASS"
            r.detail = "every worker died with the launcher"
        else:
            r.detail = f"{len(still)} worker(s) outlived the launcher by 30 s"
        return r
    finally:
        kill_group(run)


def hello(secret: bytes, secret_len: int | None = None) -> bytes:
    """A version-2 store handshake (rank 1 of 3), as in tests/it/faults.rs."""
    n = len(secret) if secret_len is None else secret_len
    return b"ACRS" + struct.pack("<HBBIIH", 2, 1, 0, 1, 3, n) + secret


def strangers(kind: str) -> Result:
    """Strangers on the rendezvous port while a 2-rank run starts: it must still finish."""
    names = {
        "garbage": "garbage bytes on the store port",
        "wrong-secret": "wrong-secret handshakes on the store port",
        "oversized": "oversized frames (65535-byte secret, huge lengths)",
        "slow": "60 slow senders (1 byte / 2 s) on the store port",
        "idle": "600 idle connections on the store port",
    }
    r = Result(names[kind])
    port = free_port()
    shm = shm_files()
    socks: list[socket.socket] = []
    stop = threading.Event()
    run = start(["-n", "2", "--main-process-port", str(port), "--collective-timeout-secs", "30",
                 DIGITS, "--epochs", "3"])
    try:
        # The launcher binds the port before it starts the workers.
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            try:
                socks.append(socket.create_connection(("127.0.0.1", port), timeout=1))
                break
            except OSError:
                time.sleep(0.01)
        count = {"garbage": 50, "wrong-secret": 50, "oversized": 20, "slow": 60, "idle": 600}[kind]
        payload = {
            "garbage": b"GET / HTTP/1.1\r\nHost: x\r\n\r\n",
            "wrong-secret": hello(b"not-the-secret"),
            "oversized": hello(b"", 65535) + b"\xff" * 4096,
            "slow": hello(b"x" * 16)[:1],
            "idle": b"",
        }[kind]
        for _ in range(count):
            try:
                s = socket.create_connection(("127.0.0.1", port), timeout=2)
                if payload:
                    s.sendall(payload)
                socks.append(s)
            except OSError:
                pass

        def trickle() -> None:
            rest = hello(b"x" * 16)[1:]
            i = 0
            while not stop.is_set() and i < len(rest):
                for s in socks:
                    try:
                        s.send(rest[i:i + 1])
                    except OSError:
                        pass
                i += 1
                stop.wait(2.0)

        if kind == "slow":
            threading.Thread(target=trickle, daemon=True).start()
        t0 = time.monotonic()
        code = run.wait(120)
        stop.set()
        if code is None:
            r.detail = "the run did not finish within 120 s"
            return r
        r.teardown = f"run {time.monotonic() - run.start:.1f} s"
        pids = children(run.proc.pid)
        r.leftovers, clean = leftovers(pids, shm)
        r.data_lost = "none" if code == 0 else "the run"
        logged = "accelerate-rs: warning" in run.text() or kind in ("idle", "slow")
        if code == 0 and clean and logged:
            r.verdict = "PASS"
            r.detail = "the run finished; strangers were dropped" + (
                " and logged" if kind not in ("idle", "slow") else "")
        else:
            r.detail = f"exit {code}, rejections on stderr: {logged}"
        del t0
        return r
    finally:
        stop.set()
        for s in socks:
            s.close()
        kill_group(run)


def lm(workdir: str, steps: int, every: int, resume: bool = False, n: int = 2) -> Run:
    args = ["-n", str(n), "--collective-timeout-secs", "20", LM, *LM_ARGS, "--max-steps", str(steps),
            "--checkpoint-every", str(every), "--log-dir", os.path.join(workdir, "run")]
    if resume:
        args.append("--resume")
    return start(args, cwd=workdir)


def checkpoints(workdir: str) -> list[str]:
    root = os.path.join(workdir, "run", "checkpoints")
    return sorted(d for d in glob.glob(os.path.join(root, "checkpoint_*")) if "." not in os.path.basename(d))


def corrupt(kind: str) -> Result:
    names = {
        "flip": "a flipped byte in the newest model file",
        "zero": "the newest model file zeroed",
        "older": "the newest model file replaced by an older one",
        "step": "the newest manifest's step edited",
    }
    r = Result(f"corrupted checkpoint: {names[kind]}")
    work = tempfile.mkdtemp(prefix="accelerate-rs-faults-")
    try:
        run = lm(work, 4, 2)
        if run.wait(120) != 0:
            r.detail = f"the first run failed:\n{run.text()[-2000:]}"
            return r
        cks = checkpoints(work)
        if len(cks) < 2:
            r.detail = f"expected 2 checkpoints, found {cks}"
            return r
        newest, older = cks[-1], cks[-2]
        model = os.path.join(newest, "model.safetensors")
        if kind == "flip":
            with open(model, "r+b") as f:
                f.seek(os.path.getsize(model) - 17)
                b = f.read(1)
                f.seek(-1, os.SEEK_CUR)
                f.write(bytes([b[0] ^ 0x40]))
        elif kind == "zero":
            size = os.path.getsize(model)
            with open(model, "wb") as f:
                f.write(b"\0" * size)
        elif kind == "older":
            shutil.copyfile(os.path.join(older, "model.safetensors"), model)
        else:
            manifest = os.path.join(newest, "manifest.json")
            with open(manifest) as f:
                text = f.read()
            with open(manifest, "w") as f:
                f.write(text.replace('"step": 4', '"step": 3').replace('"step":4', '"step":3'))
        t0 = time.monotonic()
        run = lm(work, 6, 2, resume=True)
        code = run.wait(120)
        r.teardown = f"{time.monotonic() - t0:.1f} s (resume run)"
        text = run.text()
        resumed_older = "resumed from" in text and os.path.basename(older) in text
        warned = os.path.basename(newest) in text and ("checksum" in text or "corrupt" in text
                                                       or "verif" in text)
        refused = code != 0 and os.path.basename(newest) in text
        r.leftovers = "-"
        if code == 0 and resumed_older and warned:
            r.verdict = "PASS"
            r.data_lost = "2 steps (fell back to the previous checkpoint)"
            r.detail = "the bad checkpoint was named and skipped"
        elif refused:
            r.verdict = "PASS"
            r.data_lost = "none loaded; the run stopped"
            r.detail = "the load failed naming the bad checkpoint"
        else:
            r.data_lost = "a corrupted checkpoint was loaded" if code == 0 else "?"
            r.detail = f"exit {code}; the resume did not notice the corruption"
        return r
    finally:
        shutil.rmtree(work, ignore_errors=True)


def crash_during_save() -> Result:
    r = Result("kill -9 rank 0 while it saves (a checkpoint every step)")
    work = tempfile.mkdtemp(prefix="accelerate-rs-faults-")
    shm = shm_files()
    try:
        run = lm(work, 1000, 1)
        pids = workers(run, 2)
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and len(checkpoints(work)) < 3:
            time.sleep(0.01)
        # Kill as soon as a save has begun (its temporary directory appears).
        root = os.path.join(work, "run", "checkpoints")
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline and not glob.glob(os.path.join(root, "*.tmp-*")):
            time.sleep(0.0005)
        t0 = time.monotonic()
        os.kill(pids[0], signal.SIGKILL)
        code = run.wait(60)
        if code is None:
            r.detail = "the launcher was still running 60 s after the kill"
            return r
        r.teardown = f"{time.monotonic() - t0:.2f} s"
        r.leftovers, clean = leftovers(list(pids.values()), shm)
        cks = checkpoints(work)
        last = os.path.basename(cks[-1]) if cks else None
        run2 = lm(work, int(last.split("_")[-1]) + 2 if last else 2, 1, resume=True)
        code2 = run2.wait(120)
        resumed = last is not None and f"{last}" in run2.text()
        r.data_lost = "the step being saved" if resumed else "?"
        if code != 0 and clean and code2 == 0 and resumed:
            r.verdict = "PASS"
            r.detail = f"resumed from {last}, the newest complete checkpoint"
        else:
            r.detail = f"exit {code}, clean {clean}, resume exit {code2}, resumed from newest: {resumed}"
        return r
    finally:
        shutil.rmtree(work, ignore_errors=True)


SCENARIOS = {
    "kill-rank0": lambda: kill_rank(0),
    "kill-rank1": lambda: kill_rank(1),
    "kill-rank2": lambda: kill_rank(2),
    "stop-rank1": stop_rank,
    "kill-launcher": lambda: kill_launcher(signal.SIGKILL, "kill -9 the launcher"),
    "hup-launcher": lambda: kill_launcher(signal.SIGHUP, "SIGHUP the launcher (closed terminal)"),
    "garbage": lambda: strangers("garbage"),
    "wrong-secret": lambda: strangers("wrong-secret"),
    "oversized": lambda: strangers("oversized"),
    "slow": lambda: strangers("slow"),
    "idle": lambda: strangers("idle"),
    "corrupt-flip": lambda: corrupt("flip"),
    "corrupt-zero": lambda: corrupt("zero"),
    "corrupt-older": lambda: corrupt("older"),
    "corrupt-step": lambda: corrupt("step"),
    "crash-save": crash_during_save,
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help="comma-separated scenario names (see --list)")
    ap.add_argument("--list", action="store_true", help="list the scenarios and exit")
    ap.add_argument("--no-build", action="store_true", help="use the release binaries as they are")
    ap.add_argument("--seed", type=int, default=1, help="seed of the random kill times")
    ap.add_argument("--bin-dir", help="directory holding accelerate-rs and examples/ (default: the "
                    "release build; implies --no-build)")
    a = ap.parse_args()
    global LAUNCHER, DIGITS, LM
    if a.bin_dir:
        a.no_build = True
        LAUNCHER = os.path.join(a.bin_dir, "accelerate-rs")
        DIGITS = os.path.join(a.bin_dir, "examples", "digits")
        LM = os.path.join(a.bin_dir, "examples", "transformer_lm")
    if a.list:
        print("\n".join(SCENARIOS))
        return 0
    names = a.only.split(",") if a.only else list(SCENARIOS)
    unknown = [n for n in names if n not in SCENARIOS]
    if unknown:
        print(f"faults.py: unknown scenario(s) {unknown}; --list shows them", file=sys.stderr)
        return 2
    random.seed(a.seed)
    if not a.no_build:
        subprocess.run(["cargo", "build", "--release", "-p", "accelerate-rs-cli"], cwd=ROOT, check=True)
        subprocess.run(["cargo", "build", "--release", "--example", "digits", "--example",
                        "transformer_lm"], cwd=ROOT, check=True)
    for b in (LAUNCHER, DIGITS, LM):
        if not os.access(b, os.X_OK):
            print(f"faults.py: {b} is missing; run without --no-build", file=sys.stderr)
            return 2
    results = []
    for n in names:
        t = time.monotonic()
        try:
            res = SCENARIOS[n]()
        except Exception as e:  # a scenario that could not run is a failure, not a crash
            res = Result(n, detail=f"could not run: {e}")
        results.append(res)
        print(f"  {n}: {res.verdict} ({time.monotonic() - t:.1f} s) {res.detail}", file=sys.stderr,
              flush=True)
    head = ("scenario", "teardown", "leftovers", "data lost", "verdict")
    rows = [(r.scenario, r.teardown, r.leftovers, r.data_lost, r.verdict) for r in results]
    widths = [max(len(str(x[i])) for x in [head, *rows]) for i in range(5)]
    line = lambda cells: "| " + " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)) + " |"
    print(line(head))
    print("|" + "|".join("-" * (w + 2) for w in widths) + "|")
    for row in rows:
        print(line(row))
    failed = [r for r in results if r.verdict != "PASS"]
    print(f"\n{len(results) - len(failed)} of {len(results)} scenarios passed")
    for r in failed:
        print(f"FAIL {r.scenario}: {r.detail}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
