"""Regenerates the committed gRPC code in protos/ from protos/preload.proto.

    python scripts/gen_protos.py            # rewrite protos/*_pb2*.py{,i}
    python scripts/gen_protos.py --out DIR  # write elsewhere (the staleness test does this)
"""

import argparse
import pathlib
import re
import sys

from grpc_tools import protoc

ROOT = pathlib.Path(__file__).resolve().parent.parent
PROTO_DIR = ROOT / "protos"
GENERATED = ("preload_pb2.py", "preload_pb2.pyi", "preload_pb2_grpc.py")


def generate(out_dir: pathlib.Path) -> list[pathlib.Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        f"-I{PROTO_DIR}",
        f"--python_out={out_dir}",
        f"--pyi_out={out_dir}",
        f"--grpc_python_out={out_dir}",
        str(PROTO_DIR / "preload.proto"),
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed; see the message above")
    # protoc writes a top-level import; the code lives in the `protos` package.
    grpc_file = out_dir / "preload_pb2_grpc.py"
    text = re.sub(r"^import preload_pb2 as", "from protos import preload_pb2 as", grpc_file.read_text(), flags=re.M)
    grpc_file.write_text(text)
    return [out_dir / name for name in GENERATED]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=pathlib.Path, default=PROTO_DIR)
    for path in generate(parser.parse_args().out):
        print(path, file=sys.stderr)


if __name__ == "__main__":
    main()
