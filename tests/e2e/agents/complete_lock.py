"""Adds the other platforms' optional binary packages to package-lock.json.

npm 11 writes the lock with only this machine's platform package for opencode-ai, Kilo and
qwen-code's clipboard helper (Claude Code's and Codex's get every platform), and `npm ci`
then refuses the lock ("Missing: opencode-darwin-arm64@ from lock file"). Each missing one is
added as a minimal entry (version, optional, os, cpu[, libc]) read from its name: `npm ci`
skips it on any other platform, and a machine of that platform resolves it by version.

    cd tests/e2e/agents && npm install && python3 complete_lock.py && npm ci --dry-run
"""

import json
import re
from pathlib import Path

LOCK = Path(__file__).resolve().parent / "package-lock.json"
OS = (("darwin", "darwin"), ("linux", "linux"), ("win32", "win"))


def main() -> None:
    lock = json.loads(LOCK.read_text())
    packages = lock["packages"]
    added = []
    for path, meta in list(packages.items()):
        for name, version in (meta.get("optionalDependencies") or {}).items():
            key = "node_modules/" + name
            if key in packages or (path and f"{path}/node_modules/{name}" in packages):
                continue
            if not re.match(r"^\d", version):
                continue
            low = name.lower()
            os_ = [o for o, pat in OS if pat in low]
            cpu = [c for c in ("arm64", "x64", "arm") if re.search(rf"[-_]{c}($|[-_])", low)]
            if not os_ or not cpu:
                continue
            entry = {"version": version, "optional": True, "os": os_, "cpu": cpu}
            if "musl" in low:
                entry["libc"] = ["musl"]
            elif os_ == ["linux"] and "gnu" in low:
                entry["libc"] = ["glibc"]
            packages[key] = entry
            added.append(name)
    lock["packages"] = dict(sorted(packages.items(), key=lambda kv: (kv[0] != "", kv[0])))
    LOCK.write_text(json.dumps(lock, indent=2) + "\n")
    print(f"added {len(added)}: {' '.join(added)}")


if __name__ == "__main__":
    main()
