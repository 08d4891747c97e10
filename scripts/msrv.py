#!/usr/bin/env python3
"""Checks that the workspace's stated MSRV (`rust-version` in Cargo.toml) is true of its
dependencies: no crate in the build graph (library, command line, tests, examples, benches, as
locked in Cargo.lock, for this host) declares a higher `rust-version`.

This is the part of an MSRV check that needs no old toolchain. Whether our own code uses a std
API newer than the MSRV is clippy's `incompatible_msrv` lint (run by `.ci/run`'s clippy step);
language features newer than the MSRV are only caught by building with that toolchain, which
`.ci/run` does when it is installed (`rustup toolchain install <msrv>`).

    python3 scripts/msrv.py            # exit 1 and a list when a dependency needs more
"""
import json
import subprocess
import sys


def version_key(v):
    return tuple(int(p) for p in v.split("."))


def main():
    meta = json.loads(
        subprocess.run(
            ["cargo", "metadata", "--format-version", "1", "--locked"],
            check=True,
            capture_output=True,
            text=True,
        ).stdout
    )
    declared = {(p["name"], p["version"]): p.get("rust_version") for p in meta["packages"]}
    members = [p for p in meta["packages"] if p["id"] in meta["workspace_members"]]
    ours = {p["name"]: p.get("rust_version") for p in members}
    if len(set(ours.values())) != 1 or None in ours.values():
        print(f"error: the workspace members state different MSRVs: {ours}")
        return 1
    msrv = next(iter(ours.values()))
    # The graph actually built on this host (cargo tree applies target cfgs and features).
    tree = subprocess.run(
        ["cargo", "tree", "--workspace", "--locked", "-e", "normal,build,dev",
         "--prefix", "none", "--format", "{p}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    needs = {}
    highest = "0"
    for line in tree.splitlines():
        parts = line.split()
        if len(parts) < 2 or not parts[1].startswith("v"):
            continue
        name, version = parts[0], parts[1][1:]
        rv = declared.get((name, version))
        if rv and version_key(rv) > version_key(highest):
            highest = rv
        if rv and version_key(rv) > version_key(msrv):
            needs[(name, version)] = rv
    if needs:
        print(f"error: rust-version = \"{msrv}\" in Cargo.toml, but these dependencies need more:")
        for (name, version), rv in sorted(needs.items(), key=lambda kv: version_key(kv[1])):
            print(f"  {name} {version}: rust-version {rv}")
        return 1
    print(f"MSRV {msrv}: every dependency in the build graph states {highest} or less")
    return 0


if __name__ == "__main__":
    sys.exit(main())
