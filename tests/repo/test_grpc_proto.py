"""The gRPC API's checked-in Python code is what its .proto compiles to, with the pinned grpcio-tools."""

from pathlib import Path

from tools.build_proto import GENERATED, PACKAGE_DIR, REPO, build


def test_checked_in_code_matches_the_proto(tmp_path: Path):
    for built in build(tmp_path):
        checked_in = REPO / PACKAGE_DIR / built.name
        assert built.read_bytes() == checked_in.read_bytes(), f"{checked_in} is stale: run `make proto`"
    assert sorted(p.name for p in (REPO / PACKAGE_DIR).glob("generation_pb2*")) == sorted(GENERATED)


def test_the_service_has_the_api_s_streaming_calls_the_multiplexed_one_and_the_answers_controls():
    from serve_app.front_door.grpc_api import generation_pb2 as pb

    service = pb.DESCRIPTOR.services_by_name["Generation"]
    assert service.full_name == "glm4serve.v1.Generation"
    calls = {m.name: (m.input_type.name, m.output_type.name, m.client_streaming) for m in service.methods}
    assert calls == {
        "ChatCompletion": ("ChatCompletionRequest", "ChatCompletionResponse", False),
        "Completion": ("CompletionRequest", "CompletionResponse", False),
        "Stream": ("StreamRequest", "StreamResponse", True),
        "Resume": ("ResumeRequest", "StreamResponse", False),
        "CancelAnswer": ("AnswerRequest", "AnswerState", False),
        "DeleteAnswer": ("AnswerRequest", "AnswerState", False),
    }
    streamed = {m.name for m in service.methods if m.server_streaming}
    assert streamed == {"ChatCompletion", "Completion", "Stream", "Resume"}  # (the answers' controls are unary)
