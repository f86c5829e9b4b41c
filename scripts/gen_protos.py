"""Generate the Python gRPC stubs from protos/ into client/pagedserve_client/v1/.

Usage: python scripts/gen_protos.py [--out DIR]   (default: the client package)

grpcio-tools writes absolute imports (``from pagedserve.v1 import inference_pb2``) that would resolve to the
server package ``pagedserve``; they are rewritten to relative imports so the stubs live inside
``pagedserve_client.v1``. Typed stubs (``inference_pb2.pyi``, ``inference_pb2_grpc.pyi``) come from mypy-protobuf's
protoc plugins (dev extra). tests/unit/test_protos.py regenerates into a temp dir and fails on any drift.
"""
from __future__ import annotations

import argparse
import pathlib
import re
import shutil
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_ROOT = ROOT / "protos"
DEFAULT_OUT = ROOT / "client" / "pagedserve_client" / "v1"


def _plugin(name: str) -> str:
    """Path of a protoc plugin installed beside this Python (a venv's bin/) or on PATH."""
    beside = pathlib.Path(sys.executable).parent / name
    found = str(beside) if beside.exists() else shutil.which(name)
    if found is None:
        raise RuntimeError(f"{name} not found: pip install mypy-protobuf (the dev extra)")
    return found


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    """Run protoc (grpc_tools) on every .proto under protos/pagedserve/v1 and write the stubs to out_dir.

    Returns the written files. Raises RuntimeError when protoc fails.
    """
    import tempfile

    from grpc_tools import protoc
    import grpc_tools

    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in (PROTO_ROOT / "pagedserve" / "v1").glob("*.proto"))
    well_known = pathlib.Path(grpc_tools.__file__).parent / "_proto"
    with tempfile.TemporaryDirectory() as tmp:
        args = ["protoc", f"-I{PROTO_ROOT}", f"-I{well_known}",
                f"--plugin=protoc-gen-mypy={_plugin('protoc-gen-mypy')}",
                f"--plugin=protoc-gen-mypy_grpc={_plugin('protoc-gen-mypy_grpc')}",
                f"--python_out={tmp}", f"--grpc_python_out={tmp}", f"--mypy_out={tmp}", f"--mypy_grpc_out={tmp}",
                *protos]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed: {' '.join(args)}")
        out_dir.mkdir(parents=True, exist_ok=True)
        written = []
        for src in sorted((pathlib.Path(tmp) / "pagedserve" / "v1").iterdir()):
            text = re.sub(r"^from pagedserve\.v1 import", "from . import", src.read_text(), flags=re.M)
            dst = out_dir / src.name
            dst.write_text(text)
            written.append(dst)
        init = out_dir / "__init__.py"
        init.write_text('"""Generated gRPC stubs for pagedserve.v1 (scripts/gen_protos.py). Do not edit."""\n')
        written.append(init)
    return written


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_OUT)
    args = parser.parse_args()
    for path in generate(args.out):
        print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
