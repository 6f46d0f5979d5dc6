"""Write the gRPC API's Python code from its .proto: ``make proto`` (``python -m tools.build_proto``).

The generated modules are checked in, so neither the app nor its image needs
grpcio-tools; ``tests/repo/test_grpc_proto.py`` builds them again into a
temporary directory and fails if they differ from the checked-in ones. The
.proto sits at ``proto/glm4serve/v1/`` (its package's path, as protobuf tools
expect); it is compiled as if it were at ``serve_app/front_door/grpc_api/``, so the code
lands there and imports itself from there.
"""

from __future__ import annotations

from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
PROTO = REPO / "proto" / "glm4serve" / "v1" / "generation.proto"
PACKAGE_DIR = "serve_app/front_door/grpc_api"  # where the code is imported from
GENERATED = ("generation_pb2.py", "generation_pb2.pyi", "generation_pb2_grpc.py")


def build(out: Path) -> list[Path]:
    """Compile the .proto into ``out`` (the package's files land in ``out/serve_app/front_door/grpc_api``)."""
    from importlib.resources import files

    from grpc_tools import protoc

    args = [
        "protoc",
        f"--proto_path={PACKAGE_DIR}={PROTO.parent}",
        f"--proto_path={files('grpc_tools') / '_proto'}",  # protobuf's well-known types (Struct)
        f"--python_out={out}",
        f"--pyi_out={out}",
        f"--grpc_python_out={out}",
        str(PROTO),
    ]
    if protoc.main(args) != 0:
        raise RuntimeError(f"protoc failed on {PROTO}")
    return [out / PACKAGE_DIR / name for name in GENERATED]


if __name__ == "__main__":
    written = build(REPO)
    print("\n".join(str(path.relative_to(REPO)) for path in written))
