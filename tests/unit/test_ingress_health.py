"""How the ingress reads Serve's status for GET /health."""

from ray.serve._private.common import ReplicaState
from ray.serve.schema import ApplicationStatusOverview, DeploymentStatusOverview, ServeStatus

from serve_app.ingress import running_models


def overview(**states: int) -> DeploymentStatusOverview:
    return DeploymentStatusOverview(
        status="HEALTHY",
        status_trigger="CONFIG_UPDATE_COMPLETED",
        replica_states={ReplicaState(name): count for name, count in states.items()},
        message="",
    )


def status_with(deployments: dict) -> ServeStatus:
    app = ApplicationStatusOverview(status="RUNNING", message="", last_deployed_time_s=0.0, deployments=deployments)
    return ServeStatus(applications={"glm": app})


DEPLOYMENTS = {"glm-4-9b-chat": "model-glm-4-9b-chat", "second": "model-second"}


def test_model_with_a_running_replica_is_up_and_one_without_is_down():
    status = status_with(
        {"model-glm-4-9b-chat": overview(RUNNING=1, STARTING=1), "model-second": overview(STARTING=1)}
    )
    assert running_models(status, "glm", DEPLOYMENTS) == {"glm-4-9b-chat": True, "second": False}


def test_missing_deployment_or_application_is_down():
    assert running_models(status_with({}), "glm", DEPLOYMENTS) == {"glm-4-9b-chat": False, "second": False}
    assert running_models(ServeStatus(), "glm", DEPLOYMENTS) == {"glm-4-9b-chat": False, "second": False}
