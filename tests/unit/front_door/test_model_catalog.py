"""ModelCatalog: routing by the request's `model` and the model list."""

import pytest

from serve_app.errors import APIError
from serve_app.front_door.admission.models import ModelCatalog, ModelEntry


@pytest.fixture
def router():
    return ModelCatalog(
        {
            "glm-4-9b-chat": ModelEntry("glm-4-9b-chat", "handle-a", 8192),
            "glm-4-9b-chat-1m": ModelEntry("glm-4-9b-chat-1m", "handle-b", 65536),
        }
    )


def test_routes_by_model_name(router):
    assert router.entry_for("glm-4-9b-chat").model == "handle-a"
    assert router.entry_for("glm-4-9b-chat-1m").model == "handle-b"


def test_unknown_model_is_404_naming_served_models(router):
    with pytest.raises(APIError) as info:
        router.entry_for("gpt-4")
    assert info.value.status == 404
    assert info.value.code == "model_not_found"
    assert "glm-4-9b-chat, glm-4-9b-chat-1m" in info.value.message


@pytest.mark.parametrize("model", [None, "", 42])
def test_missing_or_non_string_model_is_400(router, model):
    with pytest.raises(APIError) as info:
        router.entry_for(model)
    assert (info.value.status, info.value.param) == (400, "model")


def test_model_list_is_openai_shaped(router):
    listing = router.model_list()
    assert listing["object"] == "list"
    assert [m["id"] for m in listing["data"]] == ["glm-4-9b-chat", "glm-4-9b-chat-1m"]
    assert all(m["object"] == "model" and isinstance(m["created"], int) for m in listing["data"])
    assert all(m["owned_by"] == "serve_app" and m["simulated"] is False for m in listing["data"])


def test_a_simulated_model_says_so_in_the_model_list():
    router = ModelCatalog({"glm-4-9b-chat": ModelEntry("glm-4-9b-chat", "handle", 8192, simulated=True)})
    [model] = router.model_list()["data"]
    assert (model["owned_by"], model["simulated"]) == ("simulated", True)
