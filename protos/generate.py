"""Regenerate the checked-in Python stubs from protos/temper/v1/*.proto.

Run with the pinned grpcio-tools (pyproject's `dev` extra): `python protos/generate.py`.
`--check` regenerates into a temporary folder and exits 1 if anything differs from what is checked in.
"""

from __future__ import annotations

import argparse
import filecmp
import shutil
import sys
import tempfile
from pathlib import Path

PROTO_ROOT = Path(__file__).resolve().parent
PACKAGE_DIR = PROTO_ROOT / "temper" / "v1"
PINNED_GRPCIO_TOOLS = "1.85.1"


def generate(out_root: Path) -> list[Path]:
    import grpc_tools
    from grpc_tools import protoc

    from importlib.metadata import version

    if version("grpcio-tools") != PINNED_GRPCIO_TOOLS:
        raise SystemExit(f"grpcio-tools {PINNED_GRPCIO_TOOLS} is required, found {version('grpcio-tools')}")
    protos = sorted(PACKAGE_DIR.glob("*.proto"))
    include = Path(grpc_tools.__file__).parent / "_proto"
    args = [
        "protoc",
        f"-I{PROTO_ROOT}",
        f"-I{include}",
        f"--python_out={out_root}",
        f"--pyi_out={out_root}",
        f"--grpc_python_out={out_root}",
        *[str(p.relative_to(PROTO_ROOT)) for p in protos],
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    return sorted((out_root / "temper" / "v1").glob("*_pb2*.py*"))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="fail if the checked-in stubs are stale")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        generated = generate(Path(tmp))
        stale = []
        for path in generated:
            target = PACKAGE_DIR / path.name
            if not target.exists() or not filecmp.cmp(path, target, shallow=False):
                stale.append(path.name)
                if not args.check:
                    shutil.copyfile(path, target)
        known = {p.name for p in generated}
        extra = [p.name for p in PACKAGE_DIR.glob("*_pb2*.py*") if p.name not in known]
    if args.check:
        if stale or extra:
            print(f"stubs out of date: {sorted(stale + extra)}; run python protos/generate.py", file=sys.stderr)
            return 1
        print("stubs up to date")
        return 0
    print(f"regenerated {len(stale)} file(s)" if stale else "stubs already up to date")
    return 0


if __name__ == "__main__":
    sys.exit(main())
