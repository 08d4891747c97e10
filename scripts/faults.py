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
        back = [line.split("goes back ", 1)[1].split(" step")[0] for line in text.splitlines()
                if "goes back " in line]
        if code == 0 and resumed_older and warned and back:
            r.verdict = "PASS"
            r.data_lost = f"{back[0]} steps (fell back to the previous checkpoint, said so)"
            r.detail = "the bad checkpoint was named and skipped, with the steps the resume goes back"
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


# --- kill at random moments, resume, compare with an uninterrupted run ------------------------------

# The run the kill-resume scenario interrupts: a checkpoint every 3 steps, 2 kept, a warmup-cosine
# schedule whose learning rates include ones serde_json's default parser does not round-trip.
KR_STEPS, KR_EVERY, KR_KEEP = 45, 3, 2


def kr_run(workdir: str, resume: bool = False) -> Run:
    lm_args = [a for i, a in enumerate(LM_ARGS) if a != "--warmup-steps"
               and (i == 0 or LM_ARGS[i - 1] != "--warmup-steps")]
    args = ["-n", "2", "--collective-timeout-secs", "20", LM, *lm_args, "--warmup-steps", "5",
            "--max-steps", str(KR_STEPS), "--checkpoint-every", str(KR_EVERY),
            "--keep-checkpoints", str(KR_KEEP), "--log-dir", os.path.join(workdir, "run")]
    if resume:
        args.append("--resume")
    return start(args, cwd=workdir)


def kr_losses(workdir: str, skip_bytes: int = 0) -> dict[int, float]:
    """step -> loss from the run's metrics.jsonl, from byte `skip_bytes` on (full precision)."""
    import json
    out = {}
    path = os.path.join(workdir, "run", "metrics.jsonl")
    if not os.path.exists(path):
        return out
    with open(path, "rb") as f:
        f.seek(skip_bytes)
        for line in f.read().decode().splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if "loss" in rec and "step" in rec:
                out[int(rec["step"])] = rec["loss"]
    return out


def kr_step_of(checkpoint: str) -> int | None:
    import json
    for d in (checkpoint, checkpoint + ".old"):
        try:
            with open(os.path.join(d, "manifest.json")) as f:
                return int(json.load(f)["step"])
        except (OSError, ValueError, KeyError):
            continue
    return None


def kill_resume(tries: int) -> Result:
    r = Result(f"kill -9 a random rank at random moments, resume ({tries} tries)")
    shm = shm_files()
    lost, teardowns, missed = [], [], 0
    t = 0
    while t < tries:
        if missed > tries:
            r.detail = f"{missed} runs finished before their kill"
            return r
        work = tempfile.mkdtemp(prefix="accelerate-rs-faults-")
        try:
            run = kr_run(work)
            pids = workers(run, 2)
            victim = random.choice(sorted(pids))
            root = os.path.join(work, "run", "checkpoints")
            if t % 2 == 0:
                # Anywhere in the run, mostly between saves: a random moment shortly after a
                # random step was logged.
                k = random.randint(1, KR_STEPS - 2)
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline and run.proc.poll() is None \
                        and f"step {k:4}/{KR_STEPS}" not in run.text():
                    time.sleep(0.001)
                time.sleep(random.uniform(0.0, 0.03))
            else:
                # While a save is being written: after a few saves, when a temporary directory
                # of the next one appears.
                want = random.randint(1, KR_STEPS // KR_EVERY - 2)
                deadline = time.monotonic() + 60
                while time.monotonic() < deadline and run.text().count("saved ") < want:
                    time.sleep(0.002)
                while time.monotonic() < deadline and run.proc.poll() is None \
                        and not glob.glob(os.path.join(root, "*.tmp-*")):
                    time.sleep(0.0002)
            t0 = time.monotonic()
            try:
                os.kill(pids[victim], signal.SIGKILL)
            except ProcessLookupError:
                pass
            code = run.wait(60)
            if code is None:
                r.detail = f"try {t}: the launcher was still running 60 s after the kill"
                kill_group(run)
                return r
            if code == 0:
                # The run finished before the kill: not a try.
                missed += 1
                continue
            teardowns.append(time.monotonic() - t0)
            left, clean = leftovers(list(pids.values()), shm)
            if not clean:
                r.detail = f"try {t}: leftovers after the kill: {left}"
                return r
            first = run.text()
            saved = [line.split("saved ", 1)[1].strip() for line in first.splitlines() if "saved " in line]
            newest = saved[-1] if saved else None
            want_step = (kr_step_of(newest) if newest else 0) or 0
            if newest and want_step == 0:
                r.detail = f"try {t}: the reported checkpoint {newest} is gone"
                return r
            metrics = os.path.join(work, "run", "metrics.jsonl")
            before = os.path.getsize(metrics) if os.path.exists(metrics) else 0
            first_losses = kr_losses(work)
            killed_at = max(first_losses, default=0)
            # The reference: a second resume, from a pristine copy of the checkpoints as the kill
            # left them, run without interruption.
            pristine = os.path.join(work, "pristine")
            if os.path.isdir(root):
                shutil.copytree(root, os.path.join(pristine, "run", "checkpoints"), symlinks=True)
            run2 = kr_run(work, resume=True)
            code2 = run2.wait(300)
            text = run2.text()
            if code2 != 0:
                r.detail = f"try {t}: the resumed run failed (exit {code2}):\n{text[-1500:]}"
                return r
            got_step = 0
            for line in text.splitlines():
                if "resumed from " in line and " at step " in line:
                    got_step = int(line.rsplit(" at step ", 1)[1].split()[0])
            if got_step < want_step:
                r.detail = (f"try {t}: resumed at step {got_step}, but {newest} (step {want_step}) "
                            f"was reported saved:\n{text[-1500:]}")
                r.data_lost = f"{want_step - got_step} steps"
                return r
            if "refused" in text or "skipping" in text:
                r.detail = f"try {t}: a sound checkpoint was refused:\n{text[-1500:]}"
                return r
            after = kr_losses(work, before)
            if set(after) != set(range(got_step + 1, KR_STEPS + 1)):
                r.detail = f"try {t}: the resumed run logged steps {sorted(after)}, not {got_step + 1}..{KR_STEPS}"
                return r
            # The steps the killed run took past the checkpoint, uninterrupted from it in memory,
            # must come out the same after loading it.
            redone = {s_: v for s_, v in first_losses.items() if s_ > got_step}
            if any(after[s_] != v for s_, v in redone.items()):
                diff = [(s_, after[s_], v) for s_, v in redone.items() if after[s_] != v][:3]
                r.detail = (f"try {t}: after resuming at step {got_step}, losses differ from the "
                            f"killed run's, which went on from the same state (step, resumed, "
                            f"killed run): {diff}")
                return r
            ref = kr_run(pristine, resume=True)
            if ref.wait(300) != 0:
                r.detail = f"try {t}: the reference resume failed:\n{ref.text()[-1500:]}"
                return r
            expect = kr_losses(pristine)
            if after != expect:
                diff = [(s_, after.get(s_), v) for s_, v in sorted(expect.items()) if after.get(s_) != v][:3]
                r.detail = (f"try {t}: losses after resuming at step {got_step} differ from an "
                            f"uninterrupted run from the same checkpoint (step, resumed, "
                            f"uninterrupted): {diff}")
                return r
            lost.append(max(0, killed_at - got_step))
            print(f"    try {t}: killed rank {victim} after step {killed_at}, newest reported save "
                  f"step {want_step}, resumed at step {got_step}, {len(redone)} redone and "
                  f"{KR_STEPS - got_step} losses equal",
                  file=sys.stderr, flush=True)
            t += 1
        finally:
            shutil.rmtree(work, ignore_errors=True)
    r.verdict = "PASS"
    r.teardown = f"max {max(teardowns):.2f} s"
    r.leftovers = "0 proc, 0 shm"
    r.data_lost = f"steps since the last save only (max {max(lost)}, of every {KR_EVERY})"
    r.detail = (f"{tries} resumes at the newest reported checkpoint; losses equal to the killed "
                f"run's past it and to an uninterrupted run from it")
    return r


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
    "kill-resume": lambda: kill_resume(TRIES[0]),
}

# How many times kill-resume kills and resumes (--tries).
TRIES = [20]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--only", help="comma-separated scenario names (see --list)")
    ap.add_argument("--list", action="store_true", help="list the scenarios and exit")
    ap.add_argument("--no-build", action="store_true", help="use the release binaries as they are")
    ap.add_argument("--seed", type=int, default=1, help="seed of the random kill times")
    ap.add_argument("--tries", type=int, default=20, help="kill-and-resume rounds of kill-resume")
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
    TRIES[0] = a.tries
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
