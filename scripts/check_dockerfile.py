#!/usr/bin/env python3
"""Runs the Dockerfile's dependency layer without docker.

The build stage copies the manifest and fetches the crates before it copies
the source, so that a source edit does not fetch them again. Cargo reads
every target the manifest names before it fetches, so a target added to
Cargo.toml (a `[[bench]]`, say) breaks that step unless the Dockerfile
copies it too; nothing else builds the image in the tests (CI has no
registry to pull the base images from). This runs the stage's
instructions up to its `COPY . .` in an empty directory, as docker would:
COPY from the repository, RUN with `sh -c`. An instruction it does not
know fails it, so the check cannot pass by skipping what it should run.

    python3 scripts/check_dockerfile.py [Dockerfile]
"""

import os
import shlex
import shutil
import subprocess
import sys
import tempfile

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def instructions(text):
    """(keyword, arguments) of each instruction: comments dropped,
    backslash continuations joined."""
    out, pending = [], ""
    for line in text.splitlines():
        stripped = line.strip()
        # A comment may sit inside a continued instruction too.
        if stripped.startswith("#") or not (stripped or pending):
            continue
        if stripped.endswith("\\"):
            pending += stripped[:-1] + " "
            continue
        whole = pending + stripped
        pending = ""
        keyword, _, args = whole.partition(" ")
        out.append((keyword.upper(), args.strip()))
    if pending:
        raise SystemExit("Dockerfile ends inside a continued instruction")
    return out


def dependency_layer(steps):
    """The first stage's instructions after its FROM, up to `COPY . .`."""
    if not steps or steps[0][0] != "FROM":
        raise SystemExit("the Dockerfile does not start with FROM")
    layer = []
    for keyword, args in steps[1:]:
        if keyword == "FROM":
            break
        if keyword == "COPY" and args.split() == [".", "."]:
            return layer
        layer.append((keyword, args))
    raise SystemExit("the build stage has no `COPY . .`: nothing to check")


def copy(args, workdir):
    words = shlex.split(args)
    if any(w.startswith("--") for w in words):
        raise SystemExit(f"COPY with a flag in the dependency layer: {args}")
    *sources, dest = words
    target = os.path.join(workdir, dest)
    into_dir = dest.endswith("/") or len(sources) > 1
    for source in sources:
        path = os.path.join(REPO, source)
        if not os.path.exists(path):
            raise SystemExit(f"COPY {source}: no such file in the repository")
        if os.path.isdir(path):
            shutil.copytree(path, target, dirs_exist_ok=True)
        else:
            os.makedirs(target if into_dir else os.path.dirname(target), exist_ok=True)
            shutil.copy(path, target)


def main():
    dockerfile = sys.argv[1] if len(sys.argv) > 1 else os.path.join(REPO, "Dockerfile")
    with open(dockerfile, encoding="utf-8") as f:
        layer = dependency_layer(instructions(f.read()))
    with tempfile.TemporaryDirectory() as workdir:
        for keyword, args in layer:
            print(f"check_dockerfile: {keyword} {args}")
            if keyword == "WORKDIR":
                continue  # the empty directory stands for it
            if keyword == "COPY":
                copy(args, workdir)
            elif keyword == "RUN":
                rc = subprocess.run(["sh", "-c", args], cwd=workdir).returncode
                if rc != 0:
                    print(f"check_dockerfile: RUN failed (exit {rc})", file=sys.stderr)
                    return 1
            else:
                raise SystemExit(f"check_dockerfile: {keyword} is not handled: update this check")
    print("check_dockerfile: the dependency layer runs")
    return 0


if __name__ == "__main__":
    sys.exit(main())
