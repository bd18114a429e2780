"""The committed gRPC stubs are what `python -m baton.proto.codegen` makes of the committed `.proto` files.

protoc runs in a subprocess: grpc_tools' bundled C++ protobuf, once loaded into the test process, makes a
later import of NIXL's native library abort.
"""

import shutil
import subprocess
import sys

from baton.proto.v1 import generation_pb2, generation_pb2_grpc, worker_pb2, worker_pb2_grpc


def codegen_check(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "baton.proto.codegen", "--check", *args], capture_output=True,
                          text=True, timeout=120)


def test_committed_stubs_are_fresh():
    from importlib.metadata import version

    proc = codegen_check()
    # A different grpcio-tools writes other version stamps, so say which one regenerated them.
    assert proc.returncode == 0, (f"{proc.stderr} (grpcio-tools {version('grpcio-tools')}): "
                                  "run `python -m baton.proto.codegen` and commit the result")


def _methods(file_descriptor, service: str) -> dict[str, tuple[str, str, bool]]:
    methods = file_descriptor.services_by_name[service].methods
    return {m.name: (m.input_type.name, m.output_type.name, m.server_streaming) for m in methods}


def test_generation_service_methods():
    assert _methods(generation_pb2.DESCRIPTOR, "Generation") == {
        "Generate": ("GenerateRequest", "GenerateResponse", True),
        "Abort": ("AbortRequest", "AbortResponse", False),
        "Health": ("HealthRequest", "HealthResponse", False),
        "ModelInfo": ("ModelInfoRequest", "ModelInfoResponse", False),
    }
    for name in ("Generate", "Abort", "Health", "ModelInfo"):
        assert hasattr(generation_pb2_grpc.GenerationServicer, name)


def test_worker_service_methods():
    assert _methods(worker_pb2.DESCRIPTOR, "Worker") == {
        "Prefill": ("PrefillRequest", "PrefillResponse", False),
        "Decode": ("DecodeRequest", "DecodeResponse", True),
        "Abort": ("WorkerAbortRequest", "WorkerAbortResponse", False),
        "Load": ("LoadRequest", "LoadResponse", False),
        "Info": ("InfoRequest", "InfoResponse", False),
    }
    for name in ("Prefill", "Decode", "Abort", "Load", "Info"):
        assert hasattr(worker_pb2_grpc.WorkerServicer, name)


def test_worker_proto_shares_generation_types():
    # Decode carries the client's SamplingParams as is; a copy of the message would drift.
    sampling = worker_pb2.DecodeRequest.DESCRIPTOR.fields_by_name["sampling"].message_type
    assert sampling is generation_pb2.SamplingParams.DESCRIPTOR


def test_check_names_an_edited_stub(tmp_path):
    from baton.proto import codegen

    shutil.copytree(codegen.PROTO_DIR, tmp_path, dirs_exist_ok=True)
    stub = tmp_path / "v1" / "generation_pb2.py"
    stub.write_text(stub.read_text() + "# hand edit\n")
    proc = codegen_check("--stubs-dir", str(tmp_path))
    assert proc.returncode == 1 and "stale: proto/v1/generation_pb2.py" in proc.stderr
    assert "worker_pb2.py" not in proc.stderr
