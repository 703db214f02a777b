"""The project's pins against what torch's Linux wheels require, read from PyPI alone.

For every torch release the project admits, reads the requirements of its Linux x86-64 wheel from
the registry (pip's dry-run report carries the wheel's metadata; the wheel is not downloaded),
with this machine's own wheel sources switched off (no pip config files, no PIP_* variables):
those sources hold a CPU build of torch that requires no triton, which once hid that PyPI's
torch 2.13.0 needs triton==3.7.1 while the project pinned triton==3.6.0. Fails when a package the
project names (in its dependencies or any extra) has no release that both torch's requirement and
the project's own specifier admit.
   python .ci/check_pins.py [--pyproject pyproject.toml]
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import subprocess
import sys
import tempfile

import tomllib
from packaging.markers import default_environment
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.utils import canonicalize_name
from packaging.version import InvalidVersion, Version

PLATFORM = "manylinux_2_28_x86_64"
LINUX = {**default_environment(), "platform_system": "Linux", "sys_platform": "linux",
         "platform_machine": "x86_64", "extra": ""}


def pip(*args: str) -> str:
    """pip against PyPI only."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PIP_")}
    env["PIP_CONFIG_FILE"] = os.devnull
    r = subprocess.run([sys.executable, "-m", "pip", *args], env=env, capture_output=True,
                       text=True)
    if r.returncode:
        raise SystemExit(f"pip {' '.join(args)} failed:\n{r.stderr[-2000:]}")
    return r.stdout


@functools.cache
def releases(name: str) -> list[Version]:
    """Every final release of `name` on the registry."""
    out = pip("index", "versions", name)
    line = next(x for x in out.splitlines() if x.startswith("Available versions:"))
    found = []
    for text in line.split(":", 1)[1].split(","):
        try:
            version = Version(text.strip())
        except InvalidVersion:
            continue
        if not version.is_prerelease:
            found.append(version)
    return found


def linux_requirements(name: str, version: Version) -> list[Requirement]:
    """The requirements of the Linux x86-64 wheel of name==version that apply on Linux."""
    with tempfile.TemporaryDirectory() as target:
        report = json.loads(pip(
            "install", "--dry-run", "--no-deps", "--ignore-installed", "--quiet",
            "--only-binary=:all:", "--platform", PLATFORM, "--target", target,
            "--report", "-", f"{name}=={version}"))
    metadata = report["install"][0]["metadata"]
    reqs = [Requirement(text) for text in metadata.get("requires_dist", [])]
    return [r for r in reqs if r.marker is None or r.marker.evaluate(LINUX)]


def named(pyproject: dict) -> dict[str, SpecifierSet]:
    """Every package the project names, with the specifiers it gives (all extras merged)."""
    project = pyproject["project"]
    texts = list(project.get("dependencies", []))
    for extra in project.get("optional-dependencies", {}).values():
        texts += extra
    out: dict[str, SpecifierSet] = {}
    for text in texts:
        req = Requirement(text)
        name = canonicalize_name(req.name)
        out[name] = out.get(name, SpecifierSet()) & req.specifier
    return out


def check(pyproject: dict) -> list[str]:
    ours = named(pyproject)
    conflicts = []
    torches = [v for v in releases("torch") if v in ours["torch"]]
    if not torches:
        return [f"no torch release on the registry satisfies 'torch{ours['torch']}'"]
    for torch in torches:
        checked = []
        for req in linux_requirements("torch", torch):
            name = canonicalize_name(req.name)
            if name not in ours:
                continue
            both = [v for v in releases(name) if v in req.specifier and v in ours[name]]
            checked.append(f"{name}{req.specifier or ''}")
            if not both:
                conflicts.append(f"torch {torch} (Linux) requires {name}{req.specifier}, but "
                                 f"the project says {name}{ours[name]}: no release satisfies both")
        print(f"torch {torch}: {', '.join(checked) or 'nothing the project names'}")
    return conflicts


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pyproject", default="pyproject.toml")
    a = p.parse_args()
    with open(a.pyproject, "rb") as f:
        conflicts = check(tomllib.load(f))
    for line in conflicts:
        print(f"conflict: {line}", file=sys.stderr)
    if not conflicts:
        print("pins agree with every admitted torch's Linux wheel")
    return 1 if conflicts else 0


if __name__ == "__main__":
    sys.exit(main())
